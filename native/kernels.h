// Building blocks of the CPU flash attention kernels: SIMD vectors (GCC vector
// extensions, so the width follows the compiler's target ISA: 16 lanes with
// AVX-512, 8 with AVX/AVX2, 4 otherwise), a vectorised exp, a register-tiled
// matmul micro-kernel, bfloat16 conversion and a small thread pool.
//
// Axis glossary: B batch, T query length, S key length, H query heads, K kv
// heads, G = H / K, D head dim, Dp = D padded to a multiple of the vector width.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

namespace shardfuse {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif

typedef float Vec __attribute__((vector_size(kLanes * 4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * 4)));
// Unaligned, may-alias views for loads and stores.
typedef float VecU __attribute__((vector_size(kLanes * 4), aligned(4), may_alias));

inline Vec load(const float* p) { return *reinterpret_cast<const VecU*>(p); }
inline void store(float* p, Vec x) { *reinterpret_cast<VecU*>(p) = x; }
inline Vec splat(float x) { return -Vec{} + x; }  // x + -0.0 is x: one broadcast

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 88 (Cephes expf: range reduction by ln 2, degree-6 polynomial,
// about 1 ulp); x < -87.3 (so also -inf) gives exactly 0.
inline Vec vexp(Vec x) {
  const Vec lo = splat(-87.3f);
  Vec xc = x < lo ? lo : x;
  xc = xc > splat(88.0f) ? splat(88.0f) : xc;
  Vec n = xc * splat(1.44269504088896341f);
  // Round to nearest (the values are small: the magic-number trick is exact).
  n = (n + splat(12582912.0f)) - splat(12582912.0f);
  Vec r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  Vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  Vec y = p * scale;
  return x < lo ? Vec{} : y;
}

// tanh(x) = 1 - 2 / (exp(2x) + 1), the argument clamped where tanh is +-1 in float32.
inline Vec vtanh(Vec x) {
  Vec xc = x > splat(20.0f) ? splat(20.0f) : x;
  xc = xc < splat(-20.0f) ? splat(-20.0f) : xc;
  // Small |x|: the odd series avoids the cancellation of 1 - 2 / (e + 1).
  Vec x2 = xc * xc;
  Vec series = xc * (splat(1.0f) + x2 * (splat(-1.0f / 3) + x2 * (splat(2.0f / 15) +
                                                                  x2 * splat(-17.0f / 315))));
  Vec big = splat(1.0f) - splat(2.0f) / (vexp(splat(2.0f) * xc) + splat(1.0f));
  Vec ax = xc < Vec{} ? -xc : xc;
  return ax < splat(0.0625f) ? series : big;
}

// x with its lanes rotated by w (lane i takes lane i + w mod kLanes).
template <int W>
inline Vec rotate(Vec x) {
  IVec lanes;
  for (int i = 0; i < kLanes; ++i) lanes[i] = (i + W) % kLanes;
  return __builtin_shuffle(x, lanes);
}

// Horizontal max and sum as trees of log2(kLanes) rotations (a chain of kLanes scalar
// steps was 1% of the forward: one per row per tile, each waiting on the one before).
inline float hmax(Vec x) {
  if constexpr (kLanes >= 16) x = x > rotate<8>(x) ? x : rotate<8>(x);
  if constexpr (kLanes >= 8) x = x > rotate<4>(x) ? x : rotate<4>(x);
  x = x > rotate<2>(x) ? x : rotate<2>(x);
  x = x > rotate<1>(x) ? x : rotate<1>(x);
  return x[0];
}

inline float hsum(Vec x) {
  if constexpr (kLanes >= 16) x += rotate<8>(x);
  if constexpr (kLanes >= 8) x += rotate<4>(x);
  x += rotate<2>(x);
  x += rotate<1>(x);
  return x[0];
}

// bfloat16 <-> float32 (round to nearest even; NaN stays NaN).
inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// dst[i] = float(src[offset + i]) for i < n. Plain loops, which the compiler vectorises: a
// memcpy call per 64-byte panel row cost more than the copy.
inline void load_row(const void* src, size_t offset, int64_t n, bool bf16, float* dst) {
  if (bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
  } else {
    const float* s = static_cast<const float*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
  }
}

// dst[offset + i] = src[i] (rounded to bfloat16 if bf16) for i < n.
inline void store_row(const float* src, int64_t n, void* dst, size_t offset, bool bf16) {
  if (bf16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  } else {
    float* d = static_cast<float*>(dst) + offset;
    for (int64_t i = 0; i < n; ++i) d[i] = src[i];
  }
}

// C[M, N] (+)= A[M, Kd] B[Kd, N], float32. A's element (m, k) is a[m * a_row + k * a_col]
// (any strides: it is read one broadcast scalar at a time), B and C row-major with
// leading dimensions ldb and ldc; N a multiple of kLanes.
template <int MR, int NV, bool ACC>
inline void micro_kernel(int Kd, const float* a, long a_row, long a_col, const float* b,
                         long ldb, float* c, long ldc) {
  Vec acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = ACC ? load(c + m * ldc + v * kLanes) : Vec{};
  if (Kd < 1) __builtin_unreachable();  // gemm handles Kd < 1 (without it, GCC spills acc)
  for (int k = 0; k < Kd; ++k) {
    Vec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load(b + k * ldb + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      Vec av = splat(a[m * a_row + k * a_col]);
      for (int v = 0; v < NV; ++v) acc[m][v] += av * bv[v];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) store(c + m * ldc + v * kLanes, acc[m][v]);
}

#if defined(__AVX512F__)
constexpr int kRows = 8, kCols = 3;  // 8 x 3 zmm accumulators of 32 registers
#else
constexpr int kRows = 6, kCols = 2;  // 6 x 2 ymm accumulators of 16 registers
#endif

// How `vectors` columns of vectors split into micro-kernel panels: `wide` panels of kCols
// vectors, then `pairs` of 2, then single vectors for the rest. A 1-vector panel (twice the
// loads per FMA) only where N is one vector (N = 64 as 3 + 1 ran 4-7% slower than 2 + 2).
struct ColumnPanels {
  int wide = 0, pairs = 0;
  explicit ColumnPanels(int vectors) {
    wide = vectors / kCols;
    if constexpr (kCols == 3) {
      if (vectors % 3 == 2) pairs = 1;
      if (vectors % 3 == 1 && wide > 0) wide -= 1, pairs = 2;
    } else {
      pairs = (vectors - wide * kCols) / 2;
    }
  }
};

template <int MR, bool ACC>
inline void row_panel(int N, int Kd, const float* a, long a_row, long a_col, const float* b,
                      long ldb, float* c, long ldc) {
  const ColumnPanels panels(N / kLanes);
  int n = 0;
  for (int i = 0; i < panels.wide; ++i, n += kCols * kLanes)
    micro_kernel<MR, kCols, ACC>(Kd, a, a_row, a_col, b + n, ldb, c + n, ldc);
  for (int i = 0; i < panels.pairs; ++i, n += 2 * kLanes)
    micro_kernel<MR, 2, ACC>(Kd, a, a_row, a_col, b + n, ldb, c + n, ldc);
  for (; n < N; n += kLanes) micro_kernel<MR, 1, ACC>(Kd, a, a_row, a_col, b + n, ldb, c + n, ldc);
}

template <int MR, bool ACC>
inline void rest_rows(int rest, int N, int Kd, const float* a, long a_row, long a_col,
                      const float* b, long ldb, float* c, long ldc) {
  if constexpr (MR > 0) {
    if (rest == MR) return row_panel<MR, ACC>(N, Kd, a, a_row, a_col, b, ldb, c, ldc);
    rest_rows<MR - 1, ACC>(rest, N, Kd, a, a_row, a_col, b, ldb, c, ldc);
  }
}

template <bool ACC>
inline void gemm(int M, int N, int Kd, const float* a, long a_row, long a_col, const float* b,
                 long ldb, float* c, long ldc) {
  if (Kd < 1) {  // an empty sum (the micro-kernels assume at least one term)
    if (!ACC)
      for (int m = 0; m < M; ++m) std::fill_n(c + m * ldc, N, 0.0f);
    return;
  }
  int m = 0;
  for (; m + kRows <= M; m += kRows)
    row_panel<kRows, ACC>(N, Kd, a + m * a_row, a_row, a_col, b, ldb, c + m * ldc, ldc);
  rest_rows<kRows - 1, ACC>(M - m, N, Kd, a + m * a_row, a_row, a_col, b, ldb, c + m * ldc, ldc);
}

// Threads for the kernels: SHARDFUSE_NATIVE_THREADS, else the hardware's count. Fixed per
// process, so that the backward's static schedule (and its sums) is the same every run.
int num_threads();

// The count num_threads() takes when SHARDFUSE_NATIVE_THREADS is unset (<= 0: the hardware's);
// effective only before the first kernel runs (the extension's loader sets it: the cores over
// the process's CPU devices, which run their programs at once).
void set_default_threads(int threads);

// Runs fn(item, thread) for item in [0, n) on up to num_threads() threads, dynamically
// scheduled (each item must be independent of the others).
void parallel_for(int n, const std::function<void(int, int)>& fn);

// The same on at most max_threads threads (>= 1): for small work, where a thread costs more
// to start (and, with every core busy, to be scheduled) than the work it would take.
void parallel_for(int n, int max_threads, const std::function<void(int, int)>& fn);

// Runs fn(thread) on each of `threads` threads (thread 0 is the caller).
void run_threads(int threads, const std::function<void(int)>& fn);

// n float32s of scratch (zeroed unless asked not to be), reused across calls. A large
// buffer allocated afresh on every call costs a page fault per 4 KiB page as it is first
// written (measured: the backward of GQA 8:2 D128 at 2048 tokens touched 14k fresh pages
// per call, 6% of its time). A Scratch takes the smallest big-enough buffer from a
// process-wide pool (or allocates one) and gives it back when it dies; the pool keeps at
// most kScratchKeepBytes, dropping its smallest buffers first. Thread-safe.
class Scratch {
 public:
  static constexpr size_t kScratchKeepBytes = size_t{256} << 20;

  Scratch() = default;
  explicit Scratch(size_t n, bool zero = true) { acquire(n, zero); }
  ~Scratch() { release(); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch(Scratch&& other) noexcept : buf_(std::move(other.buf_)) {}

  // n floats, zeroed if `zero` (else what a reused buffer held: for a caller that writes
  // every element it reads); a buffer held before goes back to the pool first.
  void acquire(size_t n, bool zero = true);
  float* data() { return buf_.data(); }
  const float* data() const { return buf_.data(); }

 private:
  void release();
  std::vector<float> buf_;
};

// The attention problem, everything static plus the inputs' positions and segment ids.
struct Problem {
  int B, T, S, H, K, D;
  bool causal;
  int64_t left, right;  // window sides, -1 = unbounded
  float softcap;        // 0 = none
  float scale;
  bool has_segments;
  const int32_t* q_pos;   // [T]
  const int32_t* kv_pos;  // [S]
  const int32_t* q_seg;   // [B, T] (has_segments)
  const int32_t* kv_seg;  // [B, S]

  int G() const { return H / K; }
  int Dp() const { return round_up(D, kLanes); }
  bool visible(int b, int t, int s) const {
    int64_t diff = static_cast<int64_t>(q_pos[t]) - kv_pos[s];
    if (causal && diff < 0) return false;
    if (left >= 0 && diff > left) return false;
    if (right >= 0 && -diff > right) return false;
    if (has_segments && q_seg[b * T + t] != kv_seg[b * S + s]) return false;
    return true;
  }
};

// What a tile of queries x keys needs: nothing (no pair visible), no mask (every pair
// visible and no padding) or an elementwise mask.
enum class Tile : uint8_t { kSkip, kFull, kPartial };

// Tile kinds `[B, nq, nk]` from the blocks' position and segment ranges.
std::vector<Tile> classify_tiles(const Problem& p, int block_q, int block_kv);

}  // namespace shardfuse
