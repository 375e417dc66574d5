// CPU flash attention, forward and backward, on row-major [B, T, H, D] queries and
// [B, S, K, D] keys/values (float32 or bfloat16; float32 accumulation), masks on
// absolute positions (causal, window, segment ids) and an optional logit softcap.
#pragma once

#include "kernels.h"

namespace shardfuse {

// Tile sizes (queries x keys; keys a multiple of 2 * kLanes). Masked problems (causal,
// window, segment ids) run small tiles, which skip more of what nobody sees; unmasked
// ones large tiles, which spend less per score on the softmax bookkeeping and on
// reloading the accumulators (measured: 64 x 128 is ~8% faster on causal, 128 x 256
// ~10% faster on full attention, 2048 keys, D 64 and 128).
constexpr int kBlockQ = 64;
constexpr int kBlockKV = 128;
constexpr int kBlockQFull = 128;
constexpr int kBlockKVFull = 256;

// Whether a problem runs the large unmasked tiles: no mask, and long enough that
// the larger tiles still give every thread several work items.
inline bool use_full_tiles(const Problem& p) {
  const bool masked = p.causal || p.left >= 0 || p.right >= 0 || p.has_segments;
  return !masked && p.T >= 2 * kBlockQFull && p.S >= 4 * kBlockKVFull;
}

inline float load_element(const void* x, size_t index, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[index])
              : static_cast<const float*>(x)[index];
}

inline void store_element(void* x, size_t index, float value, bool bf16) {
  if (bf16)
    static_cast<uint16_t*>(x)[index] = f32_to_bf16(value);
  else
    static_cast<float*>(x)[index] = value;
}

// s = cap * tanh(s / cap) in place over n (a multiple of kLanes) scores; tanh saved if asked.
inline void apply_softcap(float* s, int n, float cap, float* tanh_out) {
  const Vec inv = splat(1.0f / cap), c = splat(cap);
  for (int x = 0; x < n; x += kLanes) {
    Vec t = vtanh(load(s + x) * inv);
    if (tanh_out) store(tanh_out + x, t);
    store(s + x, c * t);
  }
}

template <int BQ, int BKV>
struct TileMask {
  bool every_row_sees = true, every_col_seen = true;
  uint8_t row_sees[BQ] = {};
  uint8_t col_seen[BKV] = {};
};

// mask[r * BKV + c]: query t0 + r sees key s0 + c (padding rows/columns never do).
template <int BQ, int BKV>
inline TileMask<BQ, BKV> tile_mask(const Problem& p, int b, int t0, int rows, int s0,
                                   uint8_t* mask) {
  TileMask<BQ, BKV> tm;
  const int cols = std::min(BKV, p.S - s0);
  for (int r = 0; r < BQ; ++r) {
    uint8_t* row = mask + r * BKV;
    std::fill_n(row, BKV, uint8_t{0});
    if (r >= rows) continue;
    for (int c = 0; c < cols; ++c) {
      uint8_t seen = p.visible(b, t0 + r, s0 + c);
      row[c] = seen;
      tm.row_sees[r] |= seen;
      tm.col_seen[c] |= seen;
    }
  }
  for (int r = 0; r < rows; ++r) tm.every_row_sees &= tm.row_sees[r] != 0;
  for (int c = 0; c < BKV; ++c) tm.every_col_seen &= tm.col_seen[c] != 0;
  return tm;
}

// out [B, T, H, D] in the inputs' dtype; lse float32 [B, H, T] (-inf where nothing is seen).
void attention_forward(const Problem& p, const void* q, const void* k, const void* v, bool bf16,
                       void* out, float* lse);

// The forward's out and its cotangent d_out [B, T, H, D] (each float32, or bfloat16 where
// its flag says so), lse and its cotangent d_lse (float32 [B, H, T]; lse -inf where a row
// sees nothing): float32 dq [B, T, H, D], dk and dv [B, S, K, D]. The row statistics
// delta = rowsum(d_out * out) - d_lse are computed here, beside the packing of d_out
// (as an XLA op before the call they were a single-threaded dot: 6% of the step).
void attention_backward(const Problem& p, const void* q, const void* k, const void* v,
                        bool bf16, const void* d_out, bool d_out_bf16, const void* out,
                        bool out_bf16, const float* lse, const float* d_lse, float* dq, float* dk,
                        float* dv);

}  // namespace shardfuse
