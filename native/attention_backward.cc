// Flash attention backward on the CPU (FlashAttention-2, Dao 2023), from the saved lse:
// per (batch, kv head, block of keys), for each query head of the group and each query
// block it sees, recompute p = exp(s - lse), then
//   dV += p^T dO,  dP = dO V^T,  dS = p (dP - delta) [tanh' for the softcap],
//   dK += dS^T Q,  dQ += dS K,
// five register-tiled matmuls per tile. dK and dV belong to the work item. Items are
// split statically (longest first) into groups, each summing its dQ into its own float32
// buffer; the buffers are reduced in group order at the end, so the sums, and the
// results, are the same every run whichever thread ran which group. Threads claim groups
// dynamically, so one the OS deschedules (a loaded machine) does not hold the others up.
#include <numeric>

#include "attention.h"

namespace shardfuse {

namespace {

// Row-major float32 copies [n, Dp] (zero padded) of x's [.., n, .., D] slices; `scale`d.
void pack_rows(const void* x, bool bf16, int n, int heads, int head, int D, int Dp, float scale,
               size_t base, float* dst) {
  for (int r = 0; r < n; ++r) {
    const size_t src = base + (static_cast<size_t>(r) * heads + head) * D;
    for (int d = 0; d < D; ++d) dst[r * Dp + d] = scale * load_element(x, src + d, bf16);
  }
}

// Assigns items of the given costs to threads, longest first onto the least loaded thread.
std::vector<std::vector<int>> schedule(const std::vector<double>& cost, int threads) {
  std::vector<int> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return cost[a] > cost[b]; });
  std::vector<std::vector<int>> plan(threads);
  std::vector<double> load(threads, 0.0);
  for (int item : order) {
    int t = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    plan[t].push_back(item);
    load[t] += cost[item];
  }
  return plan;
}

// Groups of backward items: several per thread for dynamic balance, as many as fit in
// kDqBudget bytes of dQ buffers (one each), at least one per thread.
constexpr size_t kDqBudget = size_t{64} << 20;
constexpr int kGroupsPerThread = 2;

int dq_groups(int items, int threads, size_t dq_floats) {
  const size_t fit = kDqBudget / std::max<size_t>(1, dq_floats * sizeof(float));
  const int wanted = std::min(items, threads * kGroupsPerThread);
  return std::max(std::min(wanted, static_cast<int>(std::min<size_t>(fit, wanted))), threads);
}

template <int BQ, int BKV>
void backward_tiles(const Problem& p, const void* q, const void* k, const void* v, bool bf16,
                    const void* d_out, bool d_out_bf16, const void* out, bool out_bf16,
                    const float* lse_in, const float* d_lse, float* dq, float* dk, float* dv) {
  const int nq = (p.T + BQ - 1) / BQ, nk = (p.S + BKV - 1) / BKV;
  const int Dp = p.Dp(), G = p.G(), Tp = nq * BQ, Sp = nk * BKV;
  const std::vector<Tile> tiles = classify_tiles(p, BQ, BKV);

  // Packed float32 operands: per query head Q * scale and dO [Tp, Dp]; per kv head
  // K [Sp, Dp], and K, V transposed per block [nk, Dp, BKV]. Per query row: lse (-inf, a
  // row that sees nothing, as 0: exp(s - lse) stays finite where the mask zeroes p anyway)
  // and delta = rowsum(dO * O) - d_lse.
  // Without padding the packing writes every element: no zeroing first.
  const size_t q_head = static_cast<size_t>(Tp) * Dp, kv_head = static_cast<size_t>(Sp) * Dp;
  const bool padded = Dp != p.D || Tp != p.T || Sp != p.S;
  Scratch qs(q_head * p.B * p.H, padded), dos(q_head * p.B * p.H, padded);
  Scratch kn(kv_head * p.B * p.K, padded), kt(kv_head * p.B * p.K, padded);
  Scratch vt(kv_head * p.B * p.K, padded);
  const size_t q_rows = static_cast<size_t>(p.B) * p.H * p.T;
  Scratch lse_rows(q_rows, false), delta_rows(q_rows, false);
  parallel_for(p.B * p.H, [&](int item, int) {
    const int b = item / p.H, h = item % p.H;
    const size_t base = static_cast<size_t>(b) * p.T * p.H * p.D;
    pack_rows(q, bf16, p.T, p.H, h, p.D, Dp, p.scale, base, qs.data() + q_head * item);
    float* do_head = dos.data() + q_head * item;
    pack_rows(d_out, d_out_bf16, p.T, p.H, h, p.D, Dp, 1.0f, base, do_head);
    const size_t row0 = static_cast<size_t>(item) * p.T;
    for (int t = 0; t < p.T; ++t) {
      const size_t src = base + (static_cast<size_t>(t) * p.H + h) * p.D;
      float sum = 0.0f;
      for (int d = 0; d < p.D; ++d)
        sum += do_head[t * Dp + d] * load_element(out, src + d, out_bf16);
      delta_rows.data()[row0 + t] = sum - d_lse[row0 + t];
      const float l = lse_in[row0 + t];
      lse_rows.data()[row0 + t] = std::isfinite(l) ? l : 0.0f;
    }
  });
  const float* lse = lse_rows.data();
  const float* delta = delta_rows.data();
  parallel_for(p.B * p.K, [&](int item, int) {
    const int b = item / p.K, kvh = item % p.K;
    const size_t base = static_cast<size_t>(b) * p.S * p.K * p.D;
    float* k_rows = kn.data() + kv_head * item;
    pack_rows(k, bf16, p.S, p.K, kvh, p.D, Dp, 1.0f, base, k_rows);
    float* kt_head = kt.data() + kv_head * item;
    float* vt_head = vt.data() + kv_head * item;
    for (int s = 0; s < p.S; ++s) {
      const size_t src = base + (static_cast<size_t>(s) * p.K + kvh) * p.D;
      const size_t col = static_cast<size_t>(s / BKV) * Dp * BKV + s % BKV;
      for (int d = 0; d < p.D; ++d) {
        kt_head[col + d * BKV] = k_rows[static_cast<size_t>(s) * Dp + d];
        vt_head[col + d * BKV] = load_element(v, src + d, bf16);
      }
    }
  });

  // Work items (b, kv head, key block), costed by the tiles they visit.
  const int items = p.B * p.K * nk;
  std::vector<double> cost(items, 0.0);
  for (int item = 0; item < items; ++item) {
    const int j = item % nk, b = item / (nk * p.K);
    for (int i = 0; i < nq; ++i) {
      Tile tile = tiles[(static_cast<size_t>(b) * nq + i) * nk + j];
      cost[item] += tile == Tile::kSkip ? 0.0 : (tile == Tile::kFull ? 1.0 : 1.5);
    }
  }
  const int threads = std::max(1, std::min(num_threads(), items));
  const size_t dq_floats = q_head * p.B * p.H;
  const int groups = dq_groups(items, threads, dq_floats);
  const auto plan = schedule(cost, groups);
  // Each group's dQ buffer is not zeroed: the group's first product into a tile of it
  // writes (gemm<false>), later ones add; `touched` says which tiles hold a sum.
  std::vector<Scratch> dq_group(groups);
  std::vector<std::vector<uint8_t>> touched(groups);
  std::atomic<int> next_group{0};

  run_threads(threads, [&](int) {
    std::vector<float> probs(BQ * BKV), dprobs(BQ * BKV);
    std::vector<float> tanh_buf(p.softcap > 0 ? BQ * BKV : 0);
    std::vector<float> dk_blk(BKV * Dp), dv_blk(BKV * Dp);
    std::vector<float> q_clean, k_clean;
    std::vector<uint8_t> mask(BQ * BKV);
    for (int group = next_group.fetch_add(1); group < groups; group = next_group.fetch_add(1)) {
      Scratch& dq_acc = dq_group[group];
      dq_acc.acquire(dq_floats, false);
      std::vector<uint8_t>& dq_touched = touched[group];
      dq_touched.assign(static_cast<size_t>(p.B) * p.H * nq, 0);
      for (int item : plan[group]) {
        const int j = item % nk, kvh = (item / nk) % p.K, b = item / (nk * p.K);
        const size_t kv_index = static_cast<size_t>(b) * p.K + kvh;
        const float* kt_j = kt.data() + kv_head * kv_index + static_cast<size_t>(j) * Dp * BKV;
        const float* vt_j = vt.data() + kv_head * kv_index + static_cast<size_t>(j) * Dp * BKV;
        const float* kn_j = kn.data() + kv_head * kv_index + static_cast<size_t>(j) * BKV * Dp;
        std::fill(dk_blk.begin(), dk_blk.end(), 0.0f);
        std::fill(dv_blk.begin(), dv_blk.end(), 0.0f);
        for (int g = 0; g < G; ++g) {
          const int h = kvh * G + g;
          const size_t head = static_cast<size_t>(b) * p.H + h;
          for (int i = 0; i < nq; ++i) {
            const Tile tile = tiles[(static_cast<size_t>(b) * nq + i) * nk + j];
            if (tile == Tile::kSkip) continue;
            const int t0 = i * BQ, rows = std::min(BQ, p.T - t0);
            const float* q_i = qs.data() + q_head * head + static_cast<size_t>(t0) * Dp;
            const float* do_i = dos.data() + q_head * head + static_cast<size_t>(t0) * Dp;
            const float* k_src = kn_j;
            const float* lse_i = lse + head * p.T + t0;
            const float* delta_i = delta + head * p.T + t0;
            float* pr = probs.data();
            float* dpr = dprobs.data();
            gemm<false>(rows, BKV, Dp, q_i, Dp, 1, kt_j, BKV, pr, BKV);
            if (p.softcap > 0) apply_softcap(pr, rows * BKV, p.softcap, tanh_buf.data());
            TileMask<BQ, BKV> tm;
            if (tile == Tile::kPartial) {
              tm = tile_mask<BQ, BKV>(p, b, t0, rows, j * BKV, mask.data());
              // Queries and keys this tile never pairs may hold NaN: 0 * NaN would leak.
              if (!tm.every_row_sees) {
                q_clean.assign(q_i, q_i + rows * Dp);
                for (int r = 0; r < rows; ++r)
                  if (!tm.row_sees[r]) std::fill_n(q_clean.data() + r * Dp, Dp, 0.0f);
                q_i = q_clean.data();
              }
              if (!tm.every_col_seen) {
                k_clean.assign(kn_j, kn_j + BKV * Dp);
                for (int c = 0; c < BKV; ++c)
                  if (!tm.col_seen[c]) std::fill_n(k_clean.data() + c * Dp, Dp, 0.0f);
                k_src = k_clean.data();
              }
            }
            for (int r = 0; r < rows; ++r) {
              float* row = pr + r * BKV;
              const Vec l = splat(lse_i[r]);
              for (int c = 0; c < BKV; c += kLanes) store(row + c, vexp(load(row + c) - l));
              if (tile == Tile::kPartial) {
                const uint8_t* m = mask.data() + r * BKV;
                for (int c = 0; c < BKV; ++c)
                  if (!m[c]) row[c] = 0.0f;
              }
            }
            // dV += p^T dO (p read transposed through its strides).
            gemm<true>(BKV, Dp, rows, pr, 1, BKV, do_i, Dp, dv_blk.data(), Dp);
            gemm<false>(rows, BKV, Dp, do_i, Dp, 1, vt_j, BKV, dpr, BKV);
            for (int r = 0; r < rows; ++r) {
              float* ds = dpr + r * BKV;
              const float* prow = pr + r * BKV;
              const Vec dl = splat(delta_i[r]);
              for (int c = 0; c < BKV; c += kLanes) {
                Vec x = load(prow + c) * (load(ds + c) - dl);
                if (p.softcap > 0) {
                  Vec t = load(tanh_buf.data() + r * BKV + c);
                  x = x * (splat(1.0f) - t * t);
                }
                store(ds + c, x);
              }
              if (tile == Tile::kPartial) {
                const uint8_t* m = mask.data() + r * BKV;
                for (int c = 0; c < BKV; ++c)
                  if (!m[c]) ds[c] = 0.0f;
              }
            }
            gemm<true>(BKV, Dp, rows, dpr, 1, BKV, q_i, Dp, dk_blk.data(), Dp);
            float* dq_i = dq_acc.data() + q_head * head + static_cast<size_t>(t0) * Dp;
            uint8_t& dq_held = dq_touched[head * nq + i];
            if (dq_held)
              gemm<true>(rows, Dp, BKV, dpr, BKV, 1, k_src, Dp, dq_i, Dp);
            else
              gemm<false>(rows, Dp, BKV, dpr, BKV, 1, k_src, Dp, dq_i, Dp);
            dq_held = 1;
          }
        }
        const int s0 = j * BKV, cols = std::min(BKV, p.S - s0);
        for (int c = 0; c < cols; ++c) {
          const size_t dst = ((static_cast<size_t>(b) * p.S + s0 + c) * p.K + kvh) * p.D;
          std::copy_n(dk_blk.data() + c * Dp, p.D, dk + dst);
          std::copy_n(dv_blk.data() + c * Dp, p.D, dv + dst);
        }
      }
    }
  });

  // dQ = scale * sum over groups (in group order) of their dS K, vectorised over D.
  parallel_for(p.B * p.H, [&](int head, int) {
    const int b = head / p.H, h = head % p.H;
    std::vector<float> sum(Dp);
    for (int t = 0; t < p.T; ++t) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int g = 0; g < groups; ++g) {
        if (!touched[g][static_cast<size_t>(head) * nq + t / BQ]) continue;
        const float* src = dq_group[g].data() + q_head * head + static_cast<size_t>(t) * Dp;
        for (int d = 0; d < Dp; d += kLanes)
          store(sum.data() + d, load(sum.data() + d) + load(src + d));
      }
      float* dst = dq + ((static_cast<size_t>(b) * p.T + t) * p.H + h) * p.D;
      for (int d = 0; d < p.D; ++d) dst[d] = p.scale * sum[d];
    }
  });
}

}  // namespace

void attention_backward(const Problem& p, const void* q, const void* k, const void* v,
                        bool bf16, const void* d_out, bool d_out_bf16, const void* out,
                        bool out_bf16, const float* lse, const float* d_lse, float* dq, float* dk,
                        float* dv) {
  auto run = use_full_tiles(p) ? backward_tiles<kBlockQFull, kBlockKVFull>
                               : backward_tiles<kBlockQ, kBlockKV>;
  run(p, q, k, v, bf16, d_out, d_out_bf16, out, out_bf16, lse, d_lse, dq, dk, dv);
}

}  // namespace shardfuse
