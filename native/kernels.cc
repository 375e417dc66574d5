// Threads and tile classification shared by the forward and backward kernels.
#include "kernels.h"

#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <system_error>

namespace shardfuse {

namespace {
std::atomic<int> configured_threads{0};
}  // namespace

int num_threads() {
  static const int threads = [] {
    if (const char* env = std::getenv("SHARDFUSE_NATIVE_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    if (int n = configured_threads.load(); n > 0) return std::clamp(n, 1, 64);
    int n = static_cast<int>(std::thread::hardware_concurrency());
    return std::clamp(n, 1, 64);
  }();
  return threads;
}

void set_default_threads(int threads) { configured_threads.store(threads); }

void run_threads(int threads, const std::function<void(int)>& fn) {
  if (threads <= 1) {
    fn(0);
    return;
  }
  // Never std::terminate: an exception inside a thread (bad_alloc) is kept and rethrown
  // here after every thread has joined (the FFI handler turns it into an error), and a
  // thread the system refuses to start (EAGAIN under load: 8 devices' custom calls at
  // once) runs its index on the caller instead. Every caller claims work dynamically, so
  // running an index late still covers all the work.
  std::exception_ptr error;
  std::mutex error_mutex;
  auto guarded = [&](int t) {
    try {
      fn(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  std::vector<int> inline_threads;
  pool.reserve(threads - 1);
  for (int t = 1; t < threads; ++t) {
    try {
      pool.emplace_back(guarded, t);
    } catch (const std::system_error&) {
      inline_threads.push_back(t);
    }
  }
  guarded(0);
  for (int t : inline_threads) guarded(t);
  for (auto& thread : pool) thread.join();
  if (error) std::rethrow_exception(error);
}

void parallel_for(int n, const std::function<void(int, int)>& fn) {
  parallel_for(n, num_threads(), fn);
}

void parallel_for(int n, int max_threads, const std::function<void(int, int)>& fn) {
  std::atomic<int> next{0};
  run_threads(std::clamp(std::min(n, max_threads), 1, num_threads()), [&](int thread) {
    for (int item = next.fetch_add(1); item < n; item = next.fetch_add(1)) fn(item, thread);
  });
}

namespace {

struct ScratchPool {
  std::mutex mutex;
  std::vector<std::vector<float>> free;  // sorted by capacity, smallest first
  size_t kept_bytes = 0;
};

ScratchPool& scratch_pool() {
  static ScratchPool* pool = new ScratchPool;  // never destroyed: usable at exit
  return *pool;
}

size_t bytes_of(const std::vector<float>& buf) { return buf.capacity() * sizeof(float); }

}  // namespace

void Scratch::acquire(size_t n, bool zero) {
  release();
  {
    ScratchPool& pool = scratch_pool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    auto fit = std::find_if(pool.free.begin(), pool.free.end(),
                            [n](const std::vector<float>& buf) { return buf.capacity() >= n; });
    if (fit != pool.free.end()) {
      pool.kept_bytes -= bytes_of(*fit);
      buf_ = std::move(*fit);
      pool.free.erase(fit);
    }
  }
  // Within capacity: no allocation, no fresh pages (resize writes only elements past the
  // buffer's previous size).
  if (zero)
    buf_.assign(n, 0.0f);
  else
    buf_.resize(n);
}

void Scratch::release() {
  if (buf_.capacity() == 0) return;
  std::vector<float> buf = std::move(buf_);
  buf_ = std::vector<float>();
  if (bytes_of(buf) > kScratchKeepBytes) return;
  ScratchPool& pool = scratch_pool();
  std::lock_guard<std::mutex> lock(pool.mutex);
  auto at = std::find_if(pool.free.begin(), pool.free.end(), [&](const std::vector<float>& b) {
    return b.capacity() >= buf.capacity();
  });
  pool.kept_bytes += bytes_of(buf);
  pool.free.insert(at, std::move(buf));
  while (pool.kept_bytes > kScratchKeepBytes) {  // drop the smallest first
    pool.kept_bytes -= bytes_of(pool.free.front());
    pool.free.erase(pool.free.begin());
  }
}

namespace {

struct Range {
  int64_t lo = std::numeric_limits<int64_t>::max();
  int64_t hi = std::numeric_limits<int64_t>::min();
  void add(int64_t x) {
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
};

}  // namespace

std::vector<Tile> classify_tiles(const Problem& p, int block_q, int block_kv) {
  const int nq = (p.T + block_q - 1) / block_q, nk = (p.S + block_kv - 1) / block_kv;
  std::vector<Range> qpos(nq), kpos(nk);
  for (int t = 0; t < p.T; ++t) qpos[t / block_q].add(p.q_pos[t]);
  for (int s = 0; s < p.S; ++s) kpos[s / block_kv].add(p.kv_pos[s]);
  std::vector<Tile> tiles(static_cast<size_t>(p.B) * nq * nk);
  for (int b = 0; b < p.B; ++b) {
    std::vector<Range> qseg(nq), kseg(nk);
    if (p.has_segments) {
      for (int t = 0; t < p.T; ++t) qseg[t / block_q].add(p.q_seg[b * p.T + t]);
      for (int s = 0; s < p.S; ++s) kseg[s / block_kv].add(p.kv_seg[b * p.S + s]);
    }
    for (int i = 0; i < nq; ++i) {
      for (int j = 0; j < nk; ++j) {
        const Range &q = qpos[i], &k = kpos[j];
        // Masks on differences q_pos - kv_pos, as masks.py defines them.
        bool some = !(p.causal && k.lo > q.hi) && !(p.left >= 0 && q.lo - k.hi > p.left) &&
                    !(p.right >= 0 && k.lo - q.hi > p.right);
        bool every = (!p.causal || k.hi <= q.lo) && (p.left < 0 || q.hi - k.lo <= p.left) &&
                     (p.right < 0 || k.hi - q.lo <= p.right);
        if (p.has_segments) {
          const Range &qs = qseg[i], &ks = kseg[j];
          some = some && !(qs.hi < ks.lo || ks.hi < qs.lo);
          every = every && qs.lo == qs.hi && ks.lo == ks.hi && qs.lo == ks.lo;
        }
        bool padded = (i + 1) * block_q > p.T || (j + 1) * block_kv > p.S;
        tiles[(static_cast<size_t>(b) * nq + i) * nk + j] =
            !some ? Tile::kSkip : (every && !padded ? Tile::kFull : Tile::kPartial);
      }
    }
  }
  return tiles;
}

}  // namespace shardfuse
