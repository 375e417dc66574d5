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

// The row's gate and up columns (interleaved in h's row of 2H), widened to float32.
void split_row(const void* h, int64_t row, int64_t H, bool bf16, float* g, float* u) {
  const int64_t base = row * 2 * H;
  if (bf16) {
    const uint16_t* p = static_cast<const uint16_t*>(h) + base;
    for (int64_t j = 0; j < H; ++j) {
      g[j] = bf16_to_f32(p[2 * j]);
      u[j] = bf16_to_f32(p[2 * j + 1]);
    }
  } else {
    const float* p = static_cast<const float*>(h) + base;
    for (int64_t j = 0; j < H; ++j) {
      g[j] = p[2 * j];
      u[j] = p[2 * j + 1];
    }
  }
}

// sigmoid(g) lane by lane: 1 / (1 + exp(-g)) (vexp clamps -g at 88, so that g < -88 gives
// about 6e-39 where the exact value is smaller still).
inline Vec vsigmoid(Vec g) { return splat(1.0f) / (splat(1.0f) + vexp(-g)); }

// fn(j, n) over [0, H) a vector at a time: lanes [j, j + n), n == kLanes but at the tail.
template <typename Fn>
inline void for_lanes(int64_t H, Fn&& fn) {
  int64_t j = 0;
  for (; j + kLanes <= H; j += kLanes) fn(j, kLanes);
  if (j < H) fn(j, static_cast<int>(H - j));
}

// Loads n <= kLanes floats of p (the rest zero).
inline Vec load_n(const float* p, int n) {
  if (n == kLanes) return load(p);
  float tmp[kLanes] = {};
  std::memcpy(tmp, p, size_t(n) * 4);
  return load(tmp);
}

inline void store_n(float* p, Vec x, int n) {
  if (n == kLanes) return store(p, x);
  float tmp[kLanes];
  store(tmp, x);
  std::memcpy(p, tmp, size_t(n) * 4);
}

// a [M, H] = silu(gate) * up of h [M, 2H] (interleaved columns), in float32, stored as h's type.
void swiglu(const void* h, int64_t M, int64_t H, bool bf16, void* a) {
  for_rows(M, 2 * H, [&](int64_t first, int64_t last) {
    std::vector<float> g(H), u(H), out(H);
    for (int64_t r = first; r < last; ++r) {
      split_row(h, r, H, bf16, g.data(), u.data());
      for_lanes(H, [&](int64_t j, int n) {
        const Vec gv = load_n(&g[j], n);
        store_n(&out[j], gv * vsigmoid(gv) * load_n(&u[j], n), n);
      });
      store_row(out.data(), H, a, r * H, bf16);
    }
  });
}

// dh [M, 2H] (h's type) from da [M, H] (float32): d gate = da u silu'(gate), d up = da silu(gate).
void swiglu_backward(const void* h, const float* da, int64_t M, int64_t H, bool bf16, void* dh) {
  for_rows(M, 2 * H, [&](int64_t first, int64_t last) {
    std::vector<float> g(H), u(H), d(2 * H);
    for (int64_t r = first; r < last; ++r) {
      split_row(h, r, H, bf16, g.data(), u.data());
      for_lanes(H, [&](int64_t j, int n) {
        const Vec gv = load_n(&g[j], n), uv = load_n(&u[j], n), dv = load_n(da + r * H + j, n);
        const Vec s = vsigmoid(gv);
        store_n(&g[j], dv * uv * s * (splat(1.0f) + gv * (splat(1.0f) - s)), n);  // d gate
        store_n(&u[j], dv * gv * s, n);                                          // d up
      });
      for (int64_t j = 0; j < H; ++j) {  // interleaved again
        d[2 * j] = g[j];
        d[2 * j + 1] = u[j];
      }
      store_row(d.data(), 2 * H, dh, r * 2 * H, bf16);
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
