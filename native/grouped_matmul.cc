// Grouped matmul and its transpose on the CPU, as GotoBLAS-style blocked GEMMs per group:
// the work is cut into items (a group's block of output rows and columns), scheduled
// dynamically over the threads; each item walks the contracted dim in blocks, packing
// the weight block it multiplies (float32, zero padded to whole vectors) into its
// thread's buffer and running the register-tiled micro-kernels of kernels.h into a
// float32 accumulator, which is cast and stored once. Each output element belongs to one
// item and is summed in a fixed order: results are the same every run. Items are ordered
// largest first, so that a skewed routing's big group does not run last.
#include "grouped_matmul.h"

#include <algorithm>
#include <atomic>
#include <numeric>

namespace shardfuse {

namespace {

std::atomic<int64_t> g_macs{0};

// kLanes floats from src[index...] (float32, or bfloat16 widened: its bits are the float's top
// half).
inline Vec load_vec(const void* src, size_t index, bool bf16) {
  if (!bf16) return load(static_cast<const float*>(src) + index);
  typedef uint16_t Half __attribute__((vector_size(kLanes * 2), aligned(2), may_alias));
  typedef uint32_t Bits __attribute__((vector_size(kLanes * 4)));
  const Half half = *reinterpret_cast<const Half*>(static_cast<const uint16_t*>(src) + index);
  const Bits bits = __builtin_convertvector(half, Bits) << 16;
  Vec x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline float load_one(const void* src, size_t index, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(src)[index])
              : static_cast<const float*>(src)[index];
}

// Calls fn(first column, width in vectors) for each micro-kernel panel of a block of
// `cols` columns (a multiple of kLanes), split as the attention kernels' row_panel does.
template <typename Fn>
inline void for_each_panel(int cols, Fn&& fn) {
  const ColumnPanels panels(cols / kLanes);
  int n = 0;
  for (int i = 0; i < panels.wide; ++i, n += kCols * kLanes) fn(n, kCols);
  for (int i = 0; i < panels.pairs; ++i, n += 2 * kLanes) fn(n, 2);
  for (; n < cols; n += kLanes) fn(n, 1);
}

// Packs the block [depth, cols] whose element (k, n) is src[base + k * k_stride + n *
// n_stride] as float32 panels: the panel of columns [n0, n0 + w) is [depth, w] row-major at
// dst + depth * n0, zero past column `cols` up to `cols_padded`. A micro-kernel then reads
// its panel contiguously (one [depth, w] run instead of depth rows of a wide block).
void pack_panels(const void* src, bool bf16, size_t base, size_t k_stride, size_t n_stride,
                 int depth, int cols, int cols_padded, float* dst) {
  if (n_stride == 1) {  // rows contiguous in the source: read each once, in order
    struct Panel {
      int n0, width, valid;
    };
    Panel panels[kItemCols / kLanes];
    int count = 0;
    for_each_panel(cols_padded, [&](int n0, int vectors) {
      const int width = vectors * kLanes;
      panels[count++] = {n0, width, std::clamp(cols - n0, 0, width)};
    });
    for (int k = 0; k < depth; ++k) {
      const size_t row = base + k * k_stride;
      for (int p = 0; p < count; ++p) {
        const Panel& panel = panels[p];
        float* out = dst + static_cast<size_t>(depth) * panel.n0 +
                     static_cast<size_t>(k) * panel.width;
        if (panel.valid == panel.width) {  // whole vectors: the common case
          for (int v = 0; v < panel.width; v += kLanes)
            store(out + v, load_vec(src, row + panel.n0 + v, bf16));
        } else {
          load_row(src, row + panel.n0, panel.valid, bf16, out);
          std::fill(out + panel.valid, out + panel.width, 0.0f);
        }
      }
    }
    return;
  }
  for_each_panel(cols_padded, [&](int n0, int vectors) {  // columns contiguous (k_stride 1)
    const int width = vectors * kLanes, valid = std::clamp(cols - n0, 0, width);
    float* panel = dst + static_cast<size_t>(depth) * n0;
    for (int k = 0; k < depth; ++k)
      std::fill(panel + static_cast<size_t>(k) * width + valid,
                panel + static_cast<size_t>(k + 1) * width, 0.0f);
    for (int c = 0; c < valid; ++c) {
      const size_t column = base + (n0 + c) * n_stride;
      for (int k = 0; k < depth; ++k)
        panel[static_cast<size_t>(k) * width + c] = load_one(src, column + k * k_stride, bf16);
    }
  });
}

// Packs the block [rows, depth] whose element (m, k) is src[base + m * m_stride + k *
// k_stride] as float32 tiles of kRows rows: tile t is [depth, kRows] row-major at dst + t *
// kRows * depth, so a micro-kernel reads its rows' next kRows values from one place at each
// step (read in place, rows 2 KiB apart fall into the same few L1 sets and evict each other).
void pack_tiles(const void* src, bool bf16, size_t base, size_t m_stride, size_t k_stride,
                int rows, int depth, float* dst) {
  if (k_stride == 1) {  // each row contiguous in the source: read it once, in order
    for (int t0 = 0; t0 < rows; t0 += kRows) {
      float* tile = dst + static_cast<size_t>(t0) * depth;
      for (int m = 0; m < std::min(kRows, rows - t0); ++m) {
        const size_t row = base + (t0 + m) * m_stride;
        for (int k = 0; k < depth; ++k)
          tile[static_cast<size_t>(k) * kRows + m] = load_one(src, row + k, bf16);
      }
    }
    return;
  }
  // The rows contiguous (m_stride 1): each step's values read once, in order, into every
  // tile (x of the weights' gradient, read transposed). Tile by tile instead, the steps
  // 1 KiB apart were a quarter of a 128-row expert's weight gradient.
  const int whole = rows / kRows * kRows;
  for (int k = 0; k < depth; ++k) {
    const size_t in = base + k * k_stride;
    float* out = dst + static_cast<size_t>(k) * kRows;
    if (!bf16) {
      const float* row = static_cast<const float*>(src) + in;
      for (int t0 = 0; t0 < whole; t0 += kRows)
        std::memcpy(out + static_cast<size_t>(t0) * depth, row + t0, sizeof(float) * kRows);
    } else {
      for (int t0 = 0; t0 < whole; t0 += kRows)
        load_row(src, in + t0, kRows, true, out + static_cast<size_t>(t0) * depth);
    }
    if (whole < rows)
      load_row(src, in + whole, rows - whole, bf16, out + static_cast<size_t>(whole) * depth);
  }
}

// A block of rows: packed by pack_tiles (lda 0), or read in place, row m at ptr + m * lda.
struct Rows {
  const float* ptr;
  long lda;
  const float* tile(int m, int depth) const {  // the tile whose first row is m
    return ptr + (lda ? m * lda : static_cast<long>(m) * depth);
  }
};

template <int MR, int NV, bool ACC>
inline void rows_kernel(int depth, const float* a, long lda, const float* b, float* c,
                        long ldc) {
  if (lda)
    micro_kernel<MR, NV, ACC>(depth, a, lda, 1, b, NV * kLanes, c, ldc);
  else
    micro_kernel<MR, NV, ACC>(depth, a, 1, kRows, b, NV * kLanes, c, ldc);
}

template <int MR, int NV, bool ACC>
inline void tail_rows(int rest, int depth, const float* a, long lda, const float* b, float* c,
                      long ldc) {
  if constexpr (MR > 0) {
    if (rest == MR) return rows_kernel<MR, NV, ACC>(depth, a, lda, b, c, ldc);
    tail_rows<MR - 1, NV, ACC>(rest, depth, a, lda, b, c, ldc);
  }
}

// One packed panel against every tile of rows: the panel stays in L1 while the rows stream.
template <int NV, bool ACC>
void panel_rows(int rows, int depth, Rows a, const float* b, float* c, long ldc) {
  int m = 0;
  for (; m + kRows <= rows; m += kRows)
    rows_kernel<kRows, NV, ACC>(depth, a.tile(m, depth), a.lda, b, c + m * ldc, ldc);
  tail_rows<kRows - 1, NV, ACC>(rows - m, depth, a.tile(m, depth), a.lda, b, c + m * ldc, ldc);
}

template <bool ACC>
void packed_gemm(int rows, int cols, int depth, Rows a, const float* b, float* c) {
  for_each_panel(cols, [&](int n0, int vectors) {
    const float* panel = b + static_cast<size_t>(depth) * n0;
    if (vectors == kCols)
      panel_rows<kCols, ACC>(rows, depth, a, panel, c + n0, cols);
    else if (vectors == 2)
      panel_rows<2, ACC>(rows, depth, a, panel, c + n0, cols);
    else
      panel_rows<1, ACC>(rows, depth, a, panel, c + n0, cols);
  });
}

// c [rows, cols] (+)= a [rows, depth] b [depth, cols], b packed by pack_panels; depth >= 1.
void block_gemm(bool accumulate, int rows, int cols, int depth, Rows a, const float* b,
                float* c) {
  if (accumulate)
    packed_gemm<true>(rows, cols, depth, a, b, c);
  else
    packed_gemm<false>(rows, cols, depth, a, b, c);
}

// One item: rows [row0, row0 + rows) (of lhs, or of the weight gradient) by columns
// [col0, col0 + cols) of the output of group g.
struct Item {
  int g;
  int64_t row0, col0;
  int rows, cols;
  int64_t cost;  // for scheduling: multiply-adds, at least one per output element
  int64_t macs;  // multiply-adds
};

// Per-thread buffers: a packed block of rows (lhs, or x transposed), a packed block of
// the weights (or y), the item's float32 accumulator.
struct Workspace {
  static constexpr size_t kA = size_t{kRowBlock} * kDepthBlock;
  static constexpr size_t kB = size_t{kDepthBlock} * kItemCols;
  static constexpr size_t kC = size_t{kItemRows} * kItemCols;
  static constexpr size_t kFloats = kA + kB + kC;
  float* a;
  float* b;
  float* c;
  explicit Workspace(float* base) : a(base), b(base + kA), c(base + kA + kB) {}
};

void run_items(std::vector<Item>& items, const std::function<void(const Item&, Workspace&)>& fn) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.cost > y.cost; });
  // One thread per kMinThreadWork multiply-adds: a small call (a few experts' rows on one
  // of 8 simulated devices) runs on its caller instead of waiting for a thread to start.
  int64_t work = 0, macs = 0;
  for (const Item& it : items) work += it.cost, macs += it.macs;
  g_macs.fetch_add(macs, std::memory_order_relaxed);
  const int threads = static_cast<int>(
      std::clamp<int64_t>(work / kMinThreadWork, 1, static_cast<int64_t>(num_threads())));
  Scratch scratch(Workspace::kFloats * threads, /*zero=*/false);
  parallel_for(static_cast<int>(items.size()), threads, [&](int item, int thread) {
    Workspace w(scratch.data() + Workspace::kFloats * thread);
    fn(items[item], w);
  });
}

// The item's accumulator c [rows, cols] = a [rows, depth] b [depth, cols], a block at a
// time: each block of b (pack_b(d0, depth, dst)) is packed once and multiplied by every
// block of rows (pack_a(r0, rows, d0, depth, dst) -> Rows: packed into dst, or in place)
// while it sits in the caches.
template <typename PackA, typename PackB>
void item_gemm(const Item& it, int64_t depth_total, Workspace& w, PackA&& pack_a,
               PackB&& pack_b) {
  const int cols = round_up(it.cols, kLanes);
  if (depth_total == 0) std::fill_n(w.c, static_cast<size_t>(it.rows) * cols, 0.0f);
  for (int64_t d0 = 0; d0 < depth_total; d0 += kDepthBlock) {
    const int depth = static_cast<int>(std::min<int64_t>(kDepthBlock, depth_total - d0));
    pack_b(d0, depth, w.b);
    for (int r0 = 0; r0 < it.rows; r0 += kRowBlock) {
      const int rows = std::min(kRowBlock, it.rows - r0);
      const Rows a = pack_a(r0, rows, d0, depth, w.a);
      block_gemm(d0 > 0, rows, cols, depth, a, w.b, w.c + static_cast<size_t>(r0) * cols);
    }
  }
}

// Items of up to kItemRows x kItemCols covering rows [begin, end) x columns [0, cols) of
// group g; cost: multiply-adds.
void add_items(std::vector<Item>& items, int g, int64_t begin, int64_t end, int64_t cols,
               int64_t depth) {
  for (int64_t r = begin; r < end; r += kItemRows)
    for (int64_t n = 0; n < cols; n += kItemCols) {
      const int rows = static_cast<int>(std::min<int64_t>(kItemRows, end - r));
      const int width = static_cast<int>(std::min<int64_t>(kItemCols, cols - n));
      const int64_t macs = int64_t{rows} * width * depth;
      items.push_back({g, r, n, rows, width, std::max<int64_t>(macs, int64_t{rows} * width), macs});
    }
}

void zero_rows(void* out, int64_t first, int64_t last, int64_t N, bool out_bf16) {
  if (last <= first) return;
  const size_t bytes = (out_bf16 ? 2 : 4) * static_cast<size_t>(N);
  std::memset(static_cast<char*>(out) + first * bytes, 0, (last - first) * bytes);
}

}  // namespace

int64_t grouped_matmul_macs() { return g_macs.load(std::memory_order_relaxed); }

GroupRows::GroupRows(int64_t M, int G, const int32_t* sizes, int64_t start)
    : begin(G), end(G) {
  int64_t row = std::clamp<int64_t>(start, 0, M);
  for (int j = 0; j < G; ++j) {
    begin[j] = row;
    row = std::min<int64_t>(M, row + std::max<int32_t>(sizes[j], 0));
    end[j] = row;
  }
}

void grouped_matmul(int64_t M, int64_t K, int64_t N, int G, const int32_t* sizes,
                    int64_t start, const void* lhs, const void* rhs, bool bf16,
                    bool rhs_transposed, void* out, bool out_bf16) {
  const GroupRows groups(M, G, sizes, start);
  // Rows no local group owns: before the first group (other shards' groups) and after the
  // last (other shards', and rows past the sum of the sizes).
  const int64_t first = G ? groups.begin[0] : M, last = G ? groups.end[G - 1] : M;
  zero_rows(out, 0, first, N, out_bf16);
  zero_rows(out, last, M, N, out_bf16);
  std::vector<Item> items;
  for (int j = 0; j < G; ++j) add_items(items, j, groups.begin[j], groups.end[j], N, K);
  const size_t weights = static_cast<size_t>(K) * N;  // per group
  // float32 rows are read in place (packing them was 15% of a 128-row expert's time), unless
  // rows a multiple of 4 KiB apart would share one L1 set and evict each other.
  const bool in_place = !bf16 && (K * sizeof(float)) % 4096 != 0;
  run_items(items, [&](const Item& it, Workspace& w) {
    const int cols = round_up(it.cols, kLanes);
    const size_t g_base = weights * it.g;
    item_gemm(
        it, K, w,
        [&](int r0, int rows, int64_t k0, int depth, float* dst) -> Rows {
          const size_t first = (it.row0 + r0) * K + k0;
          if (in_place) return {static_cast<const float*>(lhs) + first, static_cast<long>(K)};
          pack_tiles(lhs, bf16, first, K, 1, rows, depth, dst);
          return {dst, 0};
        },
        [&](int64_t k0, int depth, float* dst) {
          // element (k, n) = rhs[g, k0 + k, col0 + n] (rhs[g, col0 + n, k0 + k] transposed)
          if (rhs_transposed)
            pack_panels(rhs, bf16, g_base + it.col0 * K + k0, 1, K, depth, it.cols, cols, dst);
          else
            pack_panels(rhs, bf16, g_base + k0 * N + it.col0, N, 1, depth, it.cols, cols, dst);
        });
    for (int r = 0; r < it.rows; ++r)
      store_row(w.c + static_cast<size_t>(r) * cols, it.cols, out, (it.row0 + r) * N + it.col0,
                out_bf16);
  });
}

void grouped_matmul_transposed(int64_t M, int64_t A, int64_t B, int G, const int32_t* sizes,
                               int64_t start, const void* x, const void* y, bool bf16,
                               void* out, bool out_bf16) {
  const GroupRows groups(M, G, sizes, start);
  std::vector<Item> items;
  for (int j = 0; j < G; ++j) add_items(items, j, 0, A, B, groups.end[j] - groups.begin[j]);
  const size_t per_group = static_cast<size_t>(A) * B;
  run_items(items, [&](const Item& it, Workspace& w) {
    const int cols = round_up(it.cols, kLanes);
    const int64_t begin = groups.begin[it.g];
    // The contracted dim is the group's rows: x's block is read transposed, element
    // (a, r) = x[begin + r, row0 + a]; y's block is its rows begin + r of columns col0...
    item_gemm(
        it, groups.end[it.g] - begin, w,
        [&](int r0, int rows, int64_t d0, int depth, float* dst) -> Rows {
          pack_tiles(x, bf16, (begin + d0) * A + it.row0 + r0, 1, A, rows, depth, dst);
          return {dst, 0};
        },
        [&](int64_t d0, int depth, float* dst) {
          pack_panels(y, bf16, (begin + d0) * B + it.col0, B, 1, depth, it.cols, cols, dst);
        });
    for (int r = 0; r < it.rows; ++r)
      store_row(w.c + static_cast<size_t>(r) * cols, it.cols, out,
                per_group * it.g + (it.row0 + r) * B + it.col0, out_bf16);
  });
}

}  // namespace shardfuse
