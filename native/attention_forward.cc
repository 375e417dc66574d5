// Flash attention forward on the CPU (FlashAttention-2, Dao 2023): for each
// (batch, query head, block of BQ queries), a loop over blocks of BKV
// keys keeps the running row maximum m, normaliser l and a float32 accumulator,
// rescaled as m grows; lse = m + log l. Scores are one register-tiled matmul per
// tile against K packed transposed, probabilities one more against V; the
// exponentials are vectorised. Tiles nothing sees are skipped, tiles everything
// sees run without a mask. Work items are independent: dynamically scheduled.
#include "attention.h"

namespace shardfuse {

namespace {

// K transposed per block [B, K, nk, Dp, BKV] and V [B, K, nk * BKV, Dp], float32,
// zero padded.
template <int BKV>
struct PackedKV {
  int nk, Dp;
  Scratch kt, v;
  const float* kt_block(int b, int kvh, int j, int K) const {
    return kt.data() + ((static_cast<size_t>(b) * K + kvh) * nk + j) * Dp * BKV;
  }
  const float* v_block(int b, int kvh, int j, int K) const {
    return v.data() + ((static_cast<size_t>(b) * K + kvh) * nk + j) * BKV * Dp;
  }
};

template <int BKV>
PackedKV<BKV> pack_kv(const Problem& p, const void* k, const void* v, bool bf16) {
  PackedKV<BKV> packed;
  packed.nk = (p.S + BKV - 1) / BKV;
  packed.Dp = p.Dp();
  const size_t per_head = static_cast<size_t>(packed.nk) * BKV * packed.Dp;
  const bool padded = packed.Dp != p.D || packed.nk * BKV != p.S;  // else all written
  packed.kt.acquire(per_head * p.B * p.K, padded);
  packed.v.acquire(per_head * p.B * p.K, padded);
  parallel_for(p.B * p.K, [&](int item, int) {
    const int b = item / p.K, kvh = item % p.K;
    float* kt = packed.kt.data() + per_head * item;
    float* vv = packed.v.data() + per_head * item;
    for (int s = 0; s < p.S; ++s) {
      const size_t src = ((static_cast<size_t>(b) * p.S + s) * p.K + kvh) * p.D;
      const int j = s / BKV, c = s % BKV;
      float* kt_col = kt + static_cast<size_t>(j) * packed.Dp * BKV + c;
      float* v_row = vv + static_cast<size_t>(s) * packed.Dp;
      for (int d = 0; d < p.D; ++d) {
        kt_col[d * BKV] = load_element(k, src + d, bf16);
        v_row[d] = load_element(v, src + d, bf16);
      }
    }
  });
  return packed;
}

template <int BQ, int BKV>
void forward_tiles(const Problem& p, const void* q, const void* k, const void* v, bool bf16,
                   void* out, float* lse) {
  const int nq = (p.T + BQ - 1) / BQ;
  const PackedKV<BKV> kv = pack_kv<BKV>(p, k, v, bf16);
  const int nk = kv.nk, Dp = kv.Dp, G = p.G();
  const std::vector<Tile> tiles = classify_tiles(p, BQ, BKV);

  // Per-thread buffers, allocated once per call (per item they were 300 KB of malloc and
  // zeroing, 2% of the forward): queries (scaled; the padding columns zero), scores,
  // accumulator, row max and sum, mask, a sanitised V block.
  struct Workspace {
    std::vector<float> qs, scores, acc, m, l, v_clean;
    std::vector<uint8_t> mask;
  };
  std::vector<Workspace> work(num_threads());
  parallel_for(p.B * p.H * nq, [&](int item, int thread) {
    const int i = item % nq, h = (item / nq) % p.H, b = item / (nq * p.H), kvh = h / G;
    const int t0 = i * BQ, rows = std::min(BQ, p.T - t0);
    Workspace& w = work[thread];
    if (w.qs.empty()) {
      w.qs.assign(BQ * Dp, 0.0f);
      w.scores.resize(BQ * BKV);
      w.acc.resize(BQ * Dp);
      w.m.resize(BQ);
      w.l.resize(BQ);
      w.mask.resize(BQ * BKV);
    }
    auto& [qs, scores, acc, m, l, v_clean, mask] = w;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(l.begin(), l.end(), 0.0f);
    for (int r = 0; r < rows; ++r) {
      const size_t src = ((static_cast<size_t>(b) * p.T + t0 + r) * p.H + h) * p.D;
      for (int d = 0; d < p.D; ++d) qs[r * Dp + d] = p.scale * load_element(q, src + d, bf16);
    }
    for (int j = 0; j < nk; ++j) {
      const Tile tile = tiles[(static_cast<size_t>(b) * nq + i) * nk + j];
      if (tile == Tile::kSkip) continue;
      float* s = scores.data();
      gemm<false>(rows, BKV, Dp, qs.data(), Dp, 1, kv.kt_block(b, kvh, j, p.K), BKV, s,
                  BKV);
      if (p.softcap > 0) apply_softcap(s, rows * BKV, p.softcap, nullptr);
      const float* v_blk = kv.v_block(b, kvh, j, p.K);
      if (tile == Tile::kPartial) {
        TileMask<BQ, BKV> tm = tile_mask<BQ, BKV>(p, b, t0, rows, j * BKV, mask.data());
        for (int x = 0; x < rows * BKV; ++x)
          if (!mask[x]) s[x] = kNegInf;
        if (!tm.every_col_seen) {
          // Keys nobody in this tile sees may hold NaN or inf: 0 * NaN would leak.
          v_clean.assign(v_blk, v_blk + BKV * Dp);
          for (int c = 0; c < BKV; ++c)
            if (!tm.col_seen[c]) std::fill_n(v_clean.data() + c * Dp, Dp, 0.0f);
          v_blk = v_clean.data();
        }
      }
      for (int r = 0; r < rows; ++r) {
        float* row = s + r * BKV;
        Vec mx = splat(kNegInf);
        for (int c = 0; c < BKV; c += kLanes) {
          Vec x = load(row + c);
          mx = x > mx ? x : mx;
        }
        const float m_new = std::max(m[r], hmax(mx));
        if (m_new == kNegInf) {  // nothing visible yet: p = 0, the accumulator stays 0
          std::fill_n(row, BKV, 0.0f);
          continue;
        }
        const float alpha = std::exp(m[r] - m_new);  // exp(-inf) = 0 on the first block
        Vec sum{};
        for (int c = 0; c < BKV; c += kLanes) {
          Vec e = vexp(load(row + c) - splat(m_new));
          store(row + c, e);
          sum += e;
        }
        l[r] = l[r] * alpha + hsum(sum);
        m[r] = m_new;
        if (alpha != 1.0f) {
          float* a = acc.data() + r * Dp;
          for (int d = 0; d < Dp; d += kLanes) store(a + d, load(a + d) * splat(alpha));
        }
      }
      gemm<true>(rows, Dp, BKV, s, BKV, 1, v_blk, Dp, acc.data(), Dp);
    }
    for (int r = 0; r < rows; ++r) {
      const size_t dst = ((static_cast<size_t>(b) * p.T + t0 + r) * p.H + h) * p.D;
      const bool seen = l[r] > 0.0f;
      const float inv = seen ? 1.0f / l[r] : 0.0f;
      for (int d = 0; d < p.D; ++d) store_element(out, dst + d, acc[r * Dp + d] * inv, bf16);
      lse[(static_cast<size_t>(b) * p.H + h) * p.T + t0 + r] =
          seen ? m[r] + std::log(l[r]) : kNegInf;
    }
  });
}

}  // namespace

void attention_forward(const Problem& p, const void* q, const void* k, const void* v, bool bf16,
                       void* out, float* lse) {
  if (use_full_tiles(p))
    forward_tiles<kBlockQFull, kBlockKVFull>(p, q, k, v, bf16, out, lse);
  else
    forward_tiles<kBlockQ, kBlockKV>(p, q, k, v, bf16, out, lse);
}

}  // namespace shardfuse
