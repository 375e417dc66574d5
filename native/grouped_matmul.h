// Grouped matmul on the CPU (the mixture-of-experts matmul) and its transpose, float32 or
// bfloat16 operands with float32 accumulation, on the attention kernels' register-tiled
// micro-kernels and thread pool (kernels.h).
//
// Axis glossary: M rows of lhs, sorted by group; K the contracted dim; N the output
// width; G the local groups. Local group j owns rows [start + sizes[:j].sum(),
// start + sizes[:j + 1].sum()), clipped to [0, M); every other output row is zero.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace shardfuse {

// Work blocks (GotoBLAS's mc, nc, kc): an item is up to kItemRows output rows (of lhs, or
// of the weight gradient) by kItemCols columns; it packs the other operand kDepthBlock
// contracted elements at a time (a [kDepthBlock, kItemCols] float32 block, 512 KiB, read
// from L2/L3 one micro-kernel panel at a time) and its own rows kRowBlock at a time (a
// multiple of the micro-kernel's 6 (AVX2) or 8 (AVX-512) rows; 192 KiB, L2).
constexpr int kRowBlock = 192;
constexpr int kItemRows = 4 * kRowBlock;
constexpr int kItemCols = 512;
constexpr int kDepthBlock = 256;
// Multiply-adds per thread below which a call uses fewer threads (8M: about a millisecond of
// one core's float32 work; a thread's start and join cost tens of microseconds on an idle
// machine and up to a scheduler quantum on a busy one).
constexpr int64_t kMinThreadWork = int64_t{1} << 23;

// Multiply-adds the grouped matmul kernels have executed in this process (every call's
// items: the rows of its local groups times the output columns times the depth; rows no
// group owns cost nothing). A profiling counter: the tests compare it with the active
// FLOPs of a compiled mixture-of-experts step, whose XLA cost analysis cannot see inside
// the custom calls.
int64_t grouped_matmul_macs();

// The row range [begin, end) of each local group, every size clipped so that the ranges
// stay inside [0, M) (negative sizes count as 0).
struct GroupRows {
  std::vector<int64_t> begin, end;
  GroupRows(int64_t M, int G, const int32_t* sizes, int64_t start);
};

// out [M, N] (float32, or bfloat16 if out_bf16): out[m] = lhs[m] @ rhs[j] for the rows of
// local group j, zero for the other rows. lhs [M, K]; rhs [G, K, N], or [G, N, K] if
// rhs_transposed; both float32, or both bfloat16 if bf16.
void grouped_matmul(int64_t M, int64_t K, int64_t N, int G, const int32_t* sizes,
                    int64_t start, const void* lhs, const void* rhs, bool bf16,
                    bool rhs_transposed, void* out, bool out_bf16);

// out [G, A, B] (float32, or bfloat16 if out_bf16): out[j] = x[rows of j]^T y[rows of j],
// zero for empty groups. x [M, A] and y [M, B] both float32, or both bfloat16 if bf16.
void grouped_matmul_transposed(int64_t M, int64_t A, int64_t B, int G, const int32_t* sizes,
                               int64_t start, const void* x, const void* y, bool bf16,
                               void* out, bool out_bf16);

}  // namespace shardfuse
