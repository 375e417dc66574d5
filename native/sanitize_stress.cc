// Stress driver for the sanitizer build (CMake -DSHARDFUSE_NATIVE_SANITIZE=ON builds it as
// shardfuse_native_stress; docs/kernels.md): random attention problems, forward and
// backward, run by several caller threads at once (the situation of 8 XLA CPU devices
// calling the kernels together), each checked against a naive double-precision reference.
// With AddressSanitizer/UBSan any out-of-bounds access, use after free or undefined
// behaviour aborts the run; a wrong result is counted and printed.
//
// usage: shardfuse_native_stress [problems per caller = 50] [callers = 4] [seed = 1]
//        (SHARDFUSE_NATIVE_THREADS sets the kernels' own threads per call.)
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention.h"

namespace {

using shardfuse::Problem;

struct Case {
  Problem p;
  bool bf16;
  std::vector<int32_t> q_pos, kv_pos, q_seg, kv_seg;
  std::vector<float> q, k, v, d_out;  // float32 values (bf16-representable when bf16)
  std::string name;
};

float round_bf16(float x) { return shardfuse::bf16_to_f32(shardfuse::f32_to_bf16(x)); }

Case make_case(std::mt19937_64& rng) {
  auto uni = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto coin = [&](double prob) { return std::bernoulli_distribution(prob)(rng); };
  Case c;
  Problem& p = c.p;
  const int lengths[] = {1, 2, 7, 63, 64, 65, 97, 113, 127, 128, 129, 255, 256, 257, 300};
  auto length = [&] { return coin(0.6) ? lengths[uni(0, 14)] : uni(1, 320); };
  const bool big = coin(0.08);  // long unmasked problems: the 128 x 256 tiles
  p.B = uni(1, 3);
  p.K = uni(1, 3);
  p.H = p.K * uni(1, 3);
  const int dims[] = {1, 3, 8, 15, 16, 17, 31, 32, 33, 40, 64, 65, 96, 127, 128, 129, 200, 256};
  p.D = coin(0.7) ? dims[uni(0, 17)] : uni(1, 256);
  p.T = big ? uni(256, 400) : length();
  p.S = big ? uni(1024, 1100) : length();
  if (big) {
    p.B = 1;
    p.H = p.K = 1;
    p.D = std::min(p.D, 64);
  }
  // Bound the reference's cost (B H T S D) so that a run stays minutes under ASan.
  while (static_cast<double>(p.B) * p.H * p.T * p.S * p.D > 4e7 && p.D > 8) p.D /= 2;
  const bool masked = !big && coin(0.7);
  p.causal = masked && coin(0.5);
  p.left = masked && coin(0.3) ? uni(0, 64) : -1;
  p.right = masked && coin(0.2) ? uni(0, 64) : -1;
  p.has_segments = masked && coin(0.35);
  p.softcap = coin(0.25) ? static_cast<float>(uni(1, 30)) : 0.0f;
  p.scale = 1.0f / std::sqrt(static_cast<float>(p.D)) * (coin(0.2) ? 3.0f : 1.0f);
  c.bf16 = coin(0.4);
  // Positions: contiguous from an offset (a ring step), or shuffled (zigzag-like).
  const int q_off = uni(0, 3) == 0 ? uni(0, 500) : 0, kv_off = uni(0, 3) == 0 ? uni(0, 500) : 0;
  for (int t = 0; t < p.T; ++t) c.q_pos.push_back(q_off + t);
  for (int s = 0; s < p.S; ++s) c.kv_pos.push_back(kv_off + s);
  if (coin(0.2)) std::shuffle(c.q_pos.begin(), c.q_pos.end(), rng);
  if (coin(0.2)) std::shuffle(c.kv_pos.begin(), c.kv_pos.end(), rng);
  const int n_seg = uni(1, 4);
  for (int i = 0; i < p.B * p.T; ++i) c.q_seg.push_back(coin(0.1) ? 99 : uni(0, n_seg));
  for (int i = 0; i < p.B * p.S; ++i) c.kv_seg.push_back(uni(0, n_seg));
  if (!p.has_segments) c.q_seg = c.kv_seg = {0};  // the placeholder Python passes
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto fill = [&](std::vector<float>& x, size_t n) {
    x.resize(n);
    for (float& e : x) e = c.bf16 ? round_bf16(normal(rng)) : normal(rng);
  };
  fill(c.q, static_cast<size_t>(p.B) * p.T * p.H * p.D);
  fill(c.k, static_cast<size_t>(p.B) * p.S * p.K * p.D);
  fill(c.v, static_cast<size_t>(p.B) * p.S * p.K * p.D);
  fill(c.d_out, static_cast<size_t>(p.B) * p.T * p.H * p.D);
  p.q_pos = c.q_pos.data();
  p.kv_pos = c.kv_pos.data();
  p.q_seg = c.q_seg.data();
  p.kv_seg = c.kv_seg.data();
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "B%d T%d S%d H%d K%d D%d causal%d win(%" PRId64 ",%" PRId64
                ") seg%d cap%g %s",
                p.B, p.T, p.S, p.H, p.K, p.D, p.causal, p.left, p.right, p.has_segments,
                p.softcap, c.bf16 ? "bf16" : "f32");
  c.name = buf;
  return c;
}

// Exact-size heap copies in the kernels' input dtype, so that ASan sees one byte past.
std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = shardfuse::f32_to_bf16(x[i]);
  return y;
}

struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

Reference reference(const Case& c) {
  const Problem& p = c.p;
  const int G = p.G(), D = p.D;
  Reference r;
  r.out.assign(c.q.size(), 0.0);
  r.dq.assign(c.q.size(), 0.0);
  r.dk.assign(c.k.size(), 0.0);
  r.dv.assign(c.v.size(), 0.0);
  r.lse.assign(static_cast<size_t>(p.B) * p.H * p.T, -INFINITY);
  std::vector<double> s(p.S), pr(p.S), dp(p.S);
  for (int b = 0; b < p.B; ++b)
    for (int h = 0; h < p.H; ++h)
      for (int t = 0; t < p.T; ++t) {
        const float* qr = &c.q[((static_cast<size_t>(b) * p.T + t) * p.H + h) * D];
        const float* dor = &c.d_out[((static_cast<size_t>(b) * p.T + t) * p.H + h) * D];
        double mx = -INFINITY;
        std::vector<double> raw(p.S);
        for (int j = 0; j < p.S; ++j) {
          const float* kr = &c.k[((static_cast<size_t>(b) * p.S + j) * p.K + h / G) * D];
          double x = 0;
          for (int d = 0; d < D; ++d) x += static_cast<double>(qr[d]) * kr[d];
          x *= p.scale;
          raw[j] = x;
          if (p.softcap > 0) x = p.softcap * std::tanh(x / p.softcap);
          s[j] = p.visible(b, t, j) ? x : -INFINITY;
          mx = std::max(mx, s[j]);
        }
        if (mx == -INFINITY) continue;  // nothing seen: out 0, lse -inf, no gradient
        double l = 0;
        for (int j = 0; j < p.S; ++j) l += (pr[j] = std::exp(s[j] - mx));
        for (int j = 0; j < p.S; ++j) pr[j] /= l;
        r.lse[(static_cast<size_t>(b) * p.H + h) * p.T + t] = mx + std::log(l);
        double* o = &r.out[((static_cast<size_t>(b) * p.T + t) * p.H + h) * D];
        for (int j = 0; j < p.S; ++j) {
          const float* vr = &c.v[((static_cast<size_t>(b) * p.S + j) * p.K + h / G) * D];
          for (int d = 0; d < D; ++d) o[d] += pr[j] * vr[d];
        }
        double delta = 0;
        for (int d = 0; d < D; ++d) delta += o[d] * dor[d];
        for (int j = 0; j < p.S; ++j) {
          if (pr[j] == 0) continue;
          const size_t kv = ((static_cast<size_t>(b) * p.S + j) * p.K + h / G) * D;
          double dpj = 0;
          for (int d = 0; d < D; ++d) dpj += static_cast<double>(dor[d]) * c.v[kv + d];
          double ds = pr[j] * (dpj - delta);
          if (p.softcap > 0) {
            double th = std::tanh(raw[j] / p.softcap);
            ds *= 1 - th * th;
          }
          ds *= p.scale;
          double* dqr = &r.dq[((static_cast<size_t>(b) * p.T + t) * p.H + h) * D];
          for (int d = 0; d < D; ++d) {
            dqr[d] += ds * c.k[kv + d];
            r.dk[kv + d] += ds * qr[d];
            r.dv[kv + d] += pr[j] * dor[d];
          }
        }
      }
  return r;
}

// max |x - ref| / (tol * (1 + max |ref|)); > 1 is a mismatch.
template <typename X>
double error(const X& x, const std::vector<double>& ref, double tol) {
  double worst = 0, scale = 1;
  for (double e : ref) scale = std::max(scale, std::abs(e));
  for (size_t i = 0; i < ref.size(); ++i) {
    double xi = static_cast<double>(x[i]);
    if (!std::isfinite(xi)) return INFINITY;
    worst = std::max(worst, std::abs(xi - ref[i]));
  }
  return worst / (tol * scale);
}

std::atomic<long> problems{0}, mismatches{0};
std::mutex print_mutex;

void run_case(const Case& c) {
  const Problem& p = c.p;
  const size_t rows = static_cast<size_t>(p.B) * p.H * p.T;
  std::vector<float> out32, lse(rows), dq(c.q.size()), dk(c.k.size()),
      dv(c.v.size());
  std::vector<uint16_t> q16, k16, v16, do16, out16;
  const void *q, *k, *v, *d_out;
  void* out;
  if (c.bf16) {
    q16 = to_bf16(c.q), k16 = to_bf16(c.k), v16 = to_bf16(c.v), do16 = to_bf16(c.d_out);
    out16.resize(c.q.size());
    q = q16.data(), k = k16.data(), v = v16.data(), d_out = do16.data(), out = out16.data();
  } else {
    out32.resize(c.q.size());
    q = c.q.data(), k = c.k.data(), v = c.v.data(), d_out = c.d_out.data(), out = out32.data();
  }
  shardfuse::attention_forward(p, q, k, v, c.bf16, out, lse.data());
  std::vector<float> out_f(c.q.size());
  for (size_t i = 0; i < out_f.size(); ++i)
    out_f[i] = c.bf16 ? shardfuse::bf16_to_f32(out16[i]) : out32[i];
  // No lse cotangent; the kernel forms delta = rowsum(d_out * out) and cleans lse's -inf
  // itself. A bfloat16 problem passes out as float32 every other case (out and d_out each
  // carry their own dtype, as a ring's float32 merged output does).
  const std::vector<float> d_lse(rows, 0.0f);
  const bool out_as_f32 = c.bf16 && (p.T + p.S) % 2 == 0;
  shardfuse::attention_backward(p, q, k, v, c.bf16, d_out, c.bf16,
                                out_as_f32 ? static_cast<const void*>(out_f.data()) : out,
                                c.bf16 && !out_as_f32, lse.data(), d_lse.data(), dq.data(),
                                dk.data(), dv.data());
  const Reference ref = reference(c);
  std::vector<double> lse_ref(ref.lse);
  std::vector<float> lse_cmp(lse);
  for (size_t i = 0; i < rows; ++i)  // -inf rows must match exactly; compare them as 0
    if (lse_ref[i] == -INFINITY) {
      if (lse[i] != -INFINITY) lse_cmp[i] = NAN;
      else lse_cmp[i] = 0.0f, lse_ref[i] = 0.0;
    }
  const double tol = c.bf16 ? 2e-2 : 1e-4;
  const double errors[] = {error(out_f, ref.out, tol), error(lse_cmp, lse_ref, tol),
                           error(dq, ref.dq, 4 * tol), error(dk, ref.dk, 4 * tol),
                           error(dv, ref.dv, 4 * tol)};
  double worst = 0;
  for (double e : errors) worst = std::max(worst, e);
  problems.fetch_add(1);
  if (!(worst <= 1.0)) {
    mismatches.fetch_add(1);
    std::lock_guard<std::mutex> lock(print_mutex);
    std::printf("MISMATCH %s: out %.3g lse %.3g dq %.3g dk %.3g dv %.3g\n", c.name.c_str(),
                errors[0], errors[1], errors[2], errors[3], errors[4]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int per_caller = argc > 1 ? std::atoi(argv[1]) : 50;
  const int callers = argc > 2 ? std::atoi(argv[2]) : 4;
  const uint64_t seed = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1;
  std::printf("shardfuse_native_stress: %d problems x %d callers, seed %" PRIu64
              ", %d kernel threads, %d lanes\n",
              per_caller, callers, seed, shardfuse::num_threads(), shardfuse::kLanes);
  std::vector<std::thread> pool;
  for (int w = 0; w < callers; ++w)
    pool.emplace_back([=] {
      std::mt19937_64 rng(seed * 1000003 + w);
      for (int i = 0; i < per_caller; ++i) run_case(make_case(rng));
    });
  for (auto& t : pool) t.join();
  std::printf("%ld problems, %ld mismatches\n", problems.load(), mismatches.load());
  return mismatches.load() ? 1 : 0;
}
