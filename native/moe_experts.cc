// The fused routed SwiGLU experts (moe_experts.h): a stable counting sort of the rows by
// expert, the rows gathered into sorted order, the two grouped matmuls (grouped_matmul.h)
// with the activation between them, the results scattered back. The backward recomputes
// the sort (O(R)) and the activation from the saved up projection, so that its only residual
// is h. Row-wise loops run over items of rows on the kernels' threads when the rows are big
// enough to pay for them; the matmuls schedule their own.
#include "moe_experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "grouped_matmul.h"
#include "kernels.h"

namespace shardfuse {

namespace {

constexpr int kRowsPerItem = 64;
// Elements per thread below which a row-wise loop stays on fewer threads (about a quarter
// millisecond of copying or activation on one core).
constexpr int64_t kMinThreadElements = int64_t{1} << 20;

struct SortedRows {
  std::vector<int32_t> perm;   // perm[i]: the row at sorted position i (computed rows only)
  std::vector<int32_t> sizes;  // [G]: rows of each expert
  int64_t count = 0;           // rows computed
};

SortedRows sort_rows(int64_t R, int G, const int32_t* ids) {
  SortedRows s;
  s.sizes.assign(G, 0);
  for (int64_t r = 0; r < R; ++r)
    if (ids[r] >= 0 && ids[r] < G) ++s.sizes[ids[r]];
  std::vector<int64_t> next(G);
  for (int g = 0; g < G; ++g) {
    next[g] = s.count;
    s.count += s.sizes[g];
  }
  s.perm.resize(s.count);
  for (int64_t r = 0; r < R; ++r)
    if (ids[r] >= 0 && ids[r] < G) s.perm[next[ids[r]]++] = static_cast<int32_t>(r);
  return s;
}

// fn(first, last) over [0, rows) in items of kRowsPerItem rows of `width` elements each.
void for_rows(int64_t rows, int64_t width, const std::function<void(int64_t, int64_t)>& fn) {
  const int items = static_cast<int>((rows + kRowsPerItem - 1) / kRowsPerItem);
  const int threads = static_cast<int>(std::max<int64_t>(1, rows * width / kMinThreadElements));
  parallel_for(items, threads, [&](int item, int) {
    const int64_t first = int64_t{item} * kRowsPerItem;
    fn(first, std::min(rows, first + kRowsPerItem));
  });
}

// dst[i] = src[perm[i]] for the s.count computed rows (rows of row_bytes).
void gather_rows(const void* src, const SortedRows& s, size_t row_bytes, void* dst) {
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  for_rows(s.count, static_cast<int64_t>(row_bytes / 4), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      std::memcpy(out + i * row_bytes, in + size_t(s.perm[i]) * row_bytes, row_bytes);
  });
}

// dst[perm[i]] = src[i]; dst's other rows (of R: those whose id is outside [0, G)) zero.
void scatter_rows(const void* src, const SortedRows& s, int64_t R, int G, const int32_t* ids,
                  size_t row_bytes, void* dst) {
  const char* in = static_cast<const char*>(src);
  char* out = static_cast<char*>(dst);
  for_rows(R, static_cast<int64_t>(row_bytes / 4), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      if (ids[r] < 0 || ids[r] >= G) std::memset(out + r * row_bytes, 0, row_bytes);
  });
  for_rows(s.count, static_cast<int64_t>(row_bytes / 4), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      std::memcpy(out + size_t(s.perm[i]) * row_bytes, in + i * row_bytes, row_bytes);
  });
}

inline float load_at(const void* p, int64_t i, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

inline void store_at(void* p, int64_t i, float v, bool bf16) {
  if (bf16)
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
  else
    static_cast<float*>(p)[i] = v;
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// a [M, H] = silu(gate) * up of h [M, 2H] (interleaved columns), in float32, stored as h's type.
void swiglu(const void* h, int64_t M, int64_t H, bool bf16, void* a) {
  for_rows(M, 2 * H, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t j = 0; j < H; ++j) {
        const float g = load_at(h, r * 2 * H + 2 * j, bf16);
        const float u = load_at(h, r * 2 * H + 2 * j + 1, bf16);
        store_at(a, r * H + j, g * sigmoid(g) * u, bf16);
      }
  });
}

// dh [M, 2H] (h's type) from da [M, H] (float32): d gate = da u silu'(gate), d up = da silu(gate).
void swiglu_backward(const void* h, const float* da, int64_t M, int64_t H, bool bf16, void* dh) {
  for_rows(M, 2 * H, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t j = 0; j < H; ++j) {
        const float g = load_at(h, r * 2 * H + 2 * j, bf16);
        const float u = load_at(h, r * 2 * H + 2 * j + 1, bf16);
        const float s = sigmoid(g), d = da[r * H + j];
        store_at(dh, r * 2 * H + 2 * j, d * u * s * (1.0f + g * (1.0f - s)), bf16);
        store_at(dh, r * 2 * H + 2 * j + 1, d * g * s, bf16);
      }
  });
}

// Scratch for n elements of `bytes` each.
size_t words(int64_t n, size_t bytes) { return (size_t(n) * bytes + 3) / 4; }

}  // namespace

void moe_experts_forward(int64_t R, int64_t F, int64_t H, int G, const int32_t* ids,
                         const void* rows, const void* gate_up, const void* down, bool bf16,
                         void* y, void* h) {
  const size_t es = bf16 ? 2 : 4;
  const SortedRows s = sort_rows(R, G, ids);
  const int64_t M = s.count;
  Scratch xs(words(M * F, es), false), a(words(M * H, es), false), ys(words(M * F, es), false);
  gather_rows(rows, s, F * es, xs.data());
  grouped_matmul(M, F, 2 * H, G, s.sizes.data(), 0, xs.data(), gate_up, bf16, false, h, bf16);
  std::memset(static_cast<char*>(h) + M * 2 * H * es, 0, (R - M) * 2 * H * es);
  swiglu(h, M, H, bf16, a.data());
  grouped_matmul(M, H, F, G, s.sizes.data(), 0, a.data(), down, bf16, false, ys.data(), bf16);
  scatter_rows(ys.data(), s, R, G, ids, F * es, y);
}

void moe_experts_backward(int64_t R, int64_t F, int64_t H, int G, const int32_t* ids,
                          const void* rows, const void* gate_up, const void* down, const void* h,
                          const void* dy, bool bf16, void* d_rows, void* d_gate_up,
                          void* d_down) {
  const size_t es = bf16 ? 2 : 4;
  const SortedRows s = sort_rows(R, G, ids);
  const int64_t M = s.count;
  Scratch xs(words(M * F, es), false), dys(words(M * F, es), false);
  Scratch da(size_t(M * H), false), a(words(M * H, es), false), dh(words(M * 2 * H, es), false);
  gather_rows(rows, s, F * es, xs.data());
  gather_rows(dy, s, F * es, dys.data());
  // d act = dy @ down[e]^T (float32), then through the activation.
  grouped_matmul(M, F, H, G, s.sizes.data(), 0, dys.data(), down, bf16, true, da.data(), false);
  swiglu(h, M, H, bf16, a.data());
  swiglu_backward(h, da.data(), M, H, bf16, dh.data());
  grouped_matmul_transposed(M, H, F, G, s.sizes.data(), 0, a.data(), dys.data(), bf16, d_down,
                            bf16);
  grouped_matmul_transposed(M, F, 2 * H, G, s.sizes.data(), 0, xs.data(), dh.data(), bf16,
                            d_gate_up, bf16);
  // d rows = dh @ gate_up[e]^T, back to the rows' order (reusing the gathered rows' buffer).
  grouped_matmul(M, 2 * H, F, G, s.sizes.data(), 0, dh.data(), gate_up, bf16, true, xs.data(),
                 bf16);
  scatter_rows(xs.data(), s, R, G, ids, F * es, d_rows);
}

}  // namespace shardfuse
