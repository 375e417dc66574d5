// shardfuse._native: the CPU attention and grouped matmul kernels as XLA FFI handlers, and a minimal
// CPython module handing them to Python as FFI capsules (no binding library: the
// module only returns capsules and a few build facts). Python registers them with
// jax.ffi.register_ffi_target (shardfuse/kernels/attention/native_cpu.py).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <climits>
#include <exception>
#include <string>
#include <utility>

#include "attention.h"
#include "grouped_matmul.h"
#include "moe_experts.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace shardfuse {
namespace {

// Checks shapes and dtypes (a malformed call is an error, never a crash) and fills p.
ffi::Error make_problem(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& q_pos,
                        const ffi::Buffer<ffi::S32>& kv_pos, const ffi::Buffer<ffi::S32>& q_seg,
                        const ffi::Buffer<ffi::S32>& kv_seg, bool causal, int64_t window_left,
                        int64_t window_right, float softcap, float scale, bool has_segments,
                        Problem* p, bool* bf16) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("q, k and v must have rank 4");
  const auto type = q.element_type();
  if (type != ffi::DataType::F32 && type != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("q must be float32 or bfloat16");
  if (k.element_type() != type || v.element_type() != type)
    return ffi::Error::InvalidArgument("q, k and v must share one dtype");
  for (int a = 0; a < 4; ++a)
    if (kd[a] != vd[a]) return ffi::Error::InvalidArgument("k and v shapes differ");
  p->B = static_cast<int>(qd[0]);
  p->T = static_cast<int>(qd[1]);
  p->H = static_cast<int>(qd[2]);
  p->D = static_cast<int>(qd[3]);
  p->S = static_cast<int>(kd[1]);
  p->K = static_cast<int>(kd[2]);
  if (kd[0] != qd[0] || kd[3] != qd[3] || p->K == 0 || p->H % p->K != 0)
    return ffi::Error::InvalidArgument("k, v must be [B, S, K, D] with H % K == 0");
  if (q_pos.element_count() != static_cast<size_t>(p->T) ||
      kv_pos.element_count() != static_cast<size_t>(p->S))
    return ffi::Error::InvalidArgument("positions must be [T] and [S]");
  if (has_segments && (q_seg.element_count() != static_cast<size_t>(p->B) * p->T ||
                       kv_seg.element_count() != static_cast<size_t>(p->B) * p->S))
    return ffi::Error::InvalidArgument("segment ids must be [B, T] and [B, S]");
  p->causal = causal;
  p->left = window_left;
  p->right = window_right;
  p->softcap = softcap;
  p->scale = scale;
  p->has_segments = has_segments;
  p->q_pos = q_pos.typed_data();
  p->kv_pos = kv_pos.typed_data();
  p->q_seg = q_seg.typed_data();
  p->kv_seg = kv_seg.typed_data();
  *bf16 = type == ffi::DataType::BF16;
  return ffi::Error::Success();
}

template <typename Fn>
ffi::Error guarded(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("shardfuse native kernel: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_pos,
                   ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   bool causal, int64_t window_left, int64_t window_right, float softcap,
                   float scale, bool has_segments) {
  Problem p;
  bool bf16;
  ffi::Error error = make_problem(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window_left,
                                  window_right, softcap, scale, has_segments, &p, &bf16);
  if (error.failure()) return error;
  if (out->element_type() != q.element_type() || out->element_count() != q.element_count() ||
      lse->element_count() != static_cast<size_t>(p.B) * p.H * p.T)
    return ffi::Error::InvalidArgument("out must be like q and lse [B, H, T]");
  return guarded([&] {
    attention_forward(p, q.untyped_data(), k.untyped_data(), v.untyped_data(), bf16,
                      out->untyped_data(), lse->typed_data());
  });
}

// Whether x is float32 (false) or bfloat16 (true); anything else is an error.
bool is_bf16(const ffi::AnyBuffer& x, bool* ok) {
  *ok = x.element_type() == ffi::F32 || x.element_type() == ffi::BF16;
  return x.element_type() == ffi::BF16;
}

ffi::Error Backward(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                    ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> kv_pos,
                    ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                    ffi::AnyBuffer d_out, ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse,
                    ffi::Buffer<ffi::F32> d_lse, ffi::Result<ffi::Buffer<ffi::F32>> dq,
                    ffi::Result<ffi::Buffer<ffi::F32>> dk, ffi::Result<ffi::Buffer<ffi::F32>> dv,
                    bool causal, int64_t window_left, int64_t window_right, float softcap,
                    float scale, bool has_segments) {
  Problem p;
  bool bf16;
  ffi::Error error = make_problem(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal, window_left,
                                  window_right, softcap, scale, has_segments, &p, &bf16);
  if (error.failure()) return error;
  bool d_out_ok, out_ok;
  const bool d_out_bf16 = is_bf16(d_out, &d_out_ok), out_bf16 = is_bf16(out, &out_ok);
  if (!d_out_ok || !out_ok)
    return ffi::Error::InvalidArgument("out and d_out must be float32 or bfloat16");
  const size_t rows = static_cast<size_t>(p.B) * p.H * p.T;
  if (d_out.element_count() != q.element_count() || out.element_count() != q.element_count() ||
      lse.element_count() != rows || d_lse.element_count() != rows ||
      dq->element_count() != q.element_count() || dk->element_count() != k.element_count() ||
      dv->element_count() != v.element_count())
    return ffi::Error::InvalidArgument("backward operands do not match q, k, v");
  return guarded([&] {
    attention_backward(p, q.untyped_data(), k.untyped_data(), v.untyped_data(), bf16,
                       d_out.untyped_data(), d_out_bf16, out.untyped_data(), out_bf16,
                       lse.typed_data(), d_lse.typed_data(), dq->typed_data(), dk->typed_data(),
                       dv->typed_data());
  });
}

// The local groups' sizes [G] and the first row of the first of them (a one-element
// buffer); a malformed call is an error.
ffi::Error check_groups(const ffi::Buffer<ffi::S32>& sizes, const ffi::Buffer<ffi::S32>& start,
                        int64_t G) {
  if (sizes.element_count() != static_cast<size_t>(G))
    return ffi::Error::InvalidArgument("group_sizes must hold one size per group of rhs");
  if (start.element_count() != 1)
    return ffi::Error::InvalidArgument("start must hold one row index");
  return ffi::Error::Success();
}

bool is_f32_or_bf16(const ffi::AnyBuffer& x) {
  return x.element_type() == ffi::F32 || x.element_type() == ffi::BF16;
}

ffi::Error GroupedMatmul(ffi::AnyBuffer lhs, ffi::AnyBuffer rhs, ffi::Buffer<ffi::S32> sizes,
                         ffi::Buffer<ffi::S32> start, ffi::Result<ffi::AnyBuffer> out,
                         bool transpose_rhs) {
  auto ld = lhs.dimensions(), rd = rhs.dimensions(), od = out->dimensions();
  if (ld.size() != 2 || rd.size() != 3 || od.size() != 2)
    return ffi::Error::InvalidArgument("lhs, rhs and out must be [M, K], [G, K, N] and [M, N]");
  if (!is_f32_or_bf16(lhs) || rhs.element_type() != lhs.element_type() || !is_f32_or_bf16(*out))
    return ffi::Error::InvalidArgument("lhs and rhs must be both float32 or both bfloat16");
  const int64_t M = ld[0], K = ld[1], G = rd[0];
  const int64_t N = transpose_rhs ? rd[1] : rd[2];
  if ((transpose_rhs ? rd[2] : rd[1]) != K || od[0] != M || od[1] != N)
    return ffi::Error::InvalidArgument("shapes do not fit lhs [M, K] by rhs into out [M, N]");
  ffi::Error error = check_groups(sizes, start, G);
  if (error.failure()) return error;
  return guarded([&] {
    grouped_matmul(M, K, N, static_cast<int>(G), sizes.typed_data(), start.typed_data()[0],
                   lhs.untyped_data(), rhs.untyped_data(), lhs.element_type() == ffi::BF16,
                   transpose_rhs, out->untyped_data(), out->element_type() == ffi::BF16);
  });
}

ffi::Error GroupedMatmulTransposed(ffi::AnyBuffer x, ffi::AnyBuffer y,
                                   ffi::Buffer<ffi::S32> sizes, ffi::Buffer<ffi::S32> start,
                                   ffi::Result<ffi::AnyBuffer> out) {
  auto xd = x.dimensions(), yd = y.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || od.size() != 3)
    return ffi::Error::InvalidArgument("x, y and out must be [M, A], [M, B] and [G, A, B]");
  if (!is_f32_or_bf16(x) || y.element_type() != x.element_type() || !is_f32_or_bf16(*out))
    return ffi::Error::InvalidArgument("x and y must be both float32 or both bfloat16");
  const int64_t M = xd[0], A = xd[1], B = yd[1], G = od[0];
  if (yd[0] != M || od[1] != A || od[2] != B)
    return ffi::Error::InvalidArgument("shapes do not fit x [M, A]^T y [M, B] into [G, A, B]");
  ffi::Error error = check_groups(sizes, start, G);
  if (error.failure()) return error;
  return guarded([&] {
    grouped_matmul_transposed(M, A, B, static_cast<int>(G), sizes.typed_data(),
                              start.typed_data()[0], x.untyped_data(), y.untyped_data(),
                              x.element_type() == ffi::BF16, out->untyped_data(),
                              out->element_type() == ffi::BF16);
  });
}


// rows [R, F], ids [R], gate_up [G, F, 2H], down [G, H, F], all of one type (float32 or
// bfloat16), and the H they imply; an error for anything else.
ffi::Error check_experts(const ffi::AnyBuffer& rows, const ffi::Buffer<ffi::S32>& ids,
                         const ffi::AnyBuffer& gate_up, const ffi::AnyBuffer& down, int64_t* H) {
  auto rd = rows.dimensions(), id = ids.dimensions();
  auto gd = gate_up.dimensions(), dd = down.dimensions();
  if (rd.size() != 2 || id.size() != 1 || gd.size() != 3 || dd.size() != 3)
    return ffi::Error::InvalidArgument(
        "rows, ids, gate_up and down must be [R, F], [R], [G, F, 2H] and [G, H, F]");
  if (!is_f32_or_bf16(rows) || gate_up.element_type() != rows.element_type() ||
      down.element_type() != rows.element_type())
    return ffi::Error::InvalidArgument("rows, gate_up and down must be all float32 or bfloat16");
  *H = dd[1];
  if (id[0] != rd[0] || gd[1] != rd[1] || gd[2] != 2 * *H || dd[0] != gd[0] || dd[2] != rd[1])
    return ffi::Error::InvalidArgument("shapes do not fit rows [R, F] through experts [G, F, 2H], "
                                       "[G, H, F]");
  if (gd[0] > INT32_MAX) return ffi::Error::InvalidArgument("too many experts");
  return ffi::Error::Success();
}

bool same_shape_and_type(const ffi::AnyBuffer& x, const ffi::AnyBuffer& like) {
  auto a = x.dimensions(), b = like.dimensions();
  return x.element_type() == like.element_type() && a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error MoeExpertsForward(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer gate_up,
                             ffi::AnyBuffer down, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> h) {
  int64_t H = 0;
  ffi::Error error = check_experts(rows, ids, gate_up, down, &H);
  if (error.failure()) return error;
  const int64_t R = rows.dimensions()[0], F = rows.dimensions()[1];
  auto hd = h->dimensions();
  if (!same_shape_and_type(*y, rows) || h->element_type() != rows.element_type() ||
      hd.size() != 2 || hd[0] != R || hd[1] != 2 * H)
    return ffi::Error::InvalidArgument("y and h must be [R, F] and [R, 2H] of the rows' type");
  return guarded([&] {
    moe_experts_forward(R, F, H, static_cast<int>(gate_up.dimensions()[0]), ids.typed_data(),
                        rows.untyped_data(), gate_up.untyped_data(), down.untyped_data(),
                        rows.element_type() == ffi::BF16, y->untyped_data(), h->untyped_data());
  });
}

ffi::Error MoeExpertsBackward(ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> ids,
                              ffi::AnyBuffer gate_up, ffi::AnyBuffer down, ffi::AnyBuffer h,
                              ffi::AnyBuffer dy, ffi::Result<ffi::AnyBuffer> d_rows,
                              ffi::Result<ffi::AnyBuffer> d_gate_up,
                              ffi::Result<ffi::AnyBuffer> d_down) {
  int64_t H = 0;
  ffi::Error error = check_experts(rows, ids, gate_up, down, &H);
  if (error.failure()) return error;
  const int64_t R = rows.dimensions()[0], F = rows.dimensions()[1];
  auto hd = h.dimensions();
  if (h.element_type() != rows.element_type() || hd.size() != 2 || hd[0] != R || hd[1] != 2 * H ||
      !same_shape_and_type(dy, rows) || !same_shape_and_type(*d_rows, rows) ||
      !same_shape_and_type(*d_gate_up, gate_up) || !same_shape_and_type(*d_down, down))
    return ffi::Error::InvalidArgument(
        "h, dy and the gradients must match the forward's shapes and the rows' type");
  return guarded([&] {
    moe_experts_backward(R, F, H, static_cast<int>(gate_up.dimensions()[0]), ids.typed_data(),
                         rows.untyped_data(), gate_up.untyped_data(), down.untyped_data(),
                         h.untyped_data(), dy.untyped_data(), rows.element_type() == ffi::BF16,
                         d_rows->untyped_data(), d_gate_up->untyped_data(),
                         d_down->untyped_data());
  });
}

}  // namespace
}  // namespace shardfuse

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardfuseGroupedMatmul, shardfuse::GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_rhs"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardfuseGroupedMatmulTransposed,
                              shardfuse::GroupedMatmulTransposed,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardfuseMoeExpertsForward, shardfuse::MoeExpertsForward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardfuseMoeExpertsBackward, shardfuse::MoeExpertsBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

#define SHARDFUSE_ATTRS(binding)                 \
  binding.Attr<bool>("causal")                   \
      .Attr<int64_t>("window_left")              \
      .Attr<int64_t>("window_right")             \
      .Attr<float>("softcap")                    \
      .Attr<float>("scale")                      \
      .Attr<bool>("has_segments")

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardfuseAttentionForward, shardfuse::Forward,
                              SHARDFUSE_ATTRS(ffi::Ffi::Bind()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Ret<ffi::AnyBuffer>()
                                                  .Ret<ffi::Buffer<ffi::F32>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardfuseAttentionBackward, shardfuse::Backward,
                              SHARDFUSE_ATTRS(ffi::Ffi::Bind()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::Buffer<ffi::S32>>()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::AnyBuffer>()
                                                  .Arg<ffi::Buffer<ffi::F32>>()
                                                  .Arg<ffi::Buffer<ffi::F32>>()
                                                  .Ret<ffi::Buffer<ffi::F32>>()
                                                  .Ret<ffi::Buffer<ffi::F32>>()
                                                  .Ret<ffi::Buffer<ffi::F32>>()));

namespace {

PyObject* capsule(void* fn) { return PyCapsule_New(fn, nullptr, nullptr); }

PyObject* registrations(PyObject*, PyObject*) {
  const std::pair<const char*, void*> handlers[] = {
      {"shardfuse_attention_forward", reinterpret_cast<void*>(&ShardfuseAttentionForward)},
      {"shardfuse_attention_backward", reinterpret_cast<void*>(&ShardfuseAttentionBackward)},
      {"shardfuse_grouped_matmul", reinterpret_cast<void*>(&ShardfuseGroupedMatmul)},
      {"shardfuse_grouped_matmul_transposed",
       reinterpret_cast<void*>(&ShardfuseGroupedMatmulTransposed)},
      {"shardfuse_moe_experts_forward", reinterpret_cast<void*>(&ShardfuseMoeExpertsForward)},
      {"shardfuse_moe_experts_backward", reinterpret_cast<void*>(&ShardfuseMoeExpertsBackward)},
  };
  PyObject* dict = PyDict_New();
  if (!dict) return nullptr;
  for (const auto& [name, fn] : handlers) {
    PyObject* handler = capsule(fn);
    if (!handler || PyDict_SetItemString(dict, name, handler)) {
      Py_XDECREF(handler);
      Py_DECREF(dict);
      return nullptr;
    }
    Py_DECREF(handler);
  }
  return dict;
}

PyObject* build_info(PyObject*, PyObject*) {
#if defined(__AVX512F__)
  const char* isa = "avx512";
#elif defined(__AVX2__)
  const char* isa = "avx2";
#elif defined(__AVX__)
  const char* isa = "avx";
#else
  const char* isa = "generic";
#endif
  return Py_BuildValue("{s:s,s:i,s:i,s:i,s:i,s:i,s:i}", "isa", isa, "lanes", shardfuse::kLanes,
                       "threads", shardfuse::num_threads(), "block_q", shardfuse::kBlockQ,
                       "block_kv", shardfuse::kBlockKV, "block_q_full", shardfuse::kBlockQFull,
                       "block_kv_full", shardfuse::kBlockKVFull);
}

PyObject* set_default_threads(PyObject*, PyObject* arg) {
  const long n = PyLong_AsLong(arg);
  if (n == -1 && PyErr_Occurred()) return nullptr;
  shardfuse::set_default_threads(static_cast<int>(n));
  Py_RETURN_NONE;
}

PyObject* grouped_matmul_macs(PyObject*, PyObject*) {
  return PyLong_FromLongLong(shardfuse::grouped_matmul_macs());
}

PyMethodDef methods[] = {
    {"grouped_matmul_macs", grouped_matmul_macs, METH_NOARGS,
     "Multiply-adds the grouped matmul kernels have executed in this process."},
    {"set_default_threads", set_default_threads, METH_O,
     "The kernels' thread count where SHARDFUSE_NATIVE_THREADS is unset; before the first "
     "kernel runs (then fixed for the process)."},
    {"registrations", registrations, METH_NOARGS,
     "{target name: XLA FFI handler capsule} for jax.ffi.register_ffi_target (platform cpu)."},
    {"build_info", build_info, METH_NOARGS,
     "The target ISA, vector lanes, threads and tile sizes (masked; unmasked: *_full)."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_native",
                          "shardfuse's C++ CPU kernels (XLA FFI custom calls).", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module_def); }
