// The routed SwiGLU experts of a mixture-of-experts layer on the CPU, fused: the rows sorted
// by expert (a stable counting sort), both grouped matmuls, the activation and the unsort in
// one call each way, on the grouped matmul's kernels (grouped_matmul.h).
//
// Axis glossary: R rows (unsorted; a row whose id is outside [0, G) is not computed: its
// output and gradient are zero); F the model width; H the experts' hidden width; G the local
// experts. gate_up [G, F, 2H] holds interleaved columns (gate_0, up_0, gate_1, up_1, ...);
// down [G, H, F]. float32, or bfloat16 everywhere (products and sums in float32).
#pragma once

#include <cstdint>

namespace shardfuse {

// y [R, F] = (silu(gate) * up)(rows[r] @ gate_up[id]) @ down[id], zero for rows not computed;
// h [R, 2H] = the computed rows' up projections in sorted order (stable by expert, then row),
// zero past them: the backward's residual.
void moe_experts_forward(int64_t R, int64_t F, int64_t H, int G, const int32_t* ids,
                         const void* rows, const void* gate_up, const void* down, bool bf16,
                         void* y, void* h);

// The gradients of moe_experts_forward's y, from dy [R, F] and its residual h: d_rows [R, F]
// (zero for rows not computed), d_gate_up [G, F, 2H] and d_down [G, H, F] (zero for experts
// with no rows).
void moe_experts_backward(int64_t R, int64_t F, int64_t H, int G, const int32_t* ids,
                          const void* rows, const void* gate_up, const void* down, const void* h,
                          const void* dy, bool bf16, void* d_rows, void* d_gate_up,
                          void* d_down);

}  // namespace shardfuse
