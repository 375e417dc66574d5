"""Flash attention on the CPU: C++ kernels (`native/`) called as XLA FFI custom calls.

FlashAttention-2 (Dao 2023, arXiv:2307.08691) for the CPU: the forward runs an
online softmax over blocks of keys for each (batch, query head, block of
queries), 64 x 128 tiles where a mask (causal, window, segment ids) lets tiles
be skipped, 128 x 256 on long unmasked problems, with register-tiled float32
matmuls and vectorised exponentials; the
backward recomputes `p = exp(s - lse)` per tile and accumulates dK/dV per key
block (GQA: the G query heads sharing a kv head in one work item) and dQ per
thread, reduced in a fixed order (deterministic). Tiles no query sees are
skipped, tiles every query sees run unmasked. Threads: the cores over the
process's CPU devices (`default_threads`; `SHARDFUSE_NATIVE_THREADS` to change).
The kernels ignore `BlockSizes`. CPU's default
(`implementation=None` tries `("native_cpu", "xla")`); ring attention's per-step blocks
follow the same preference.

float32 and bfloat16 inputs, float32 accumulation and lse; any head dim up to
512; operands on one device or inside `shard_map` (the custom calls have no partitioning
rule: XLA would gather operands it partitions onto every device). Anything else (float16,
another platform, a build without the extension, a batch XLA shards outside
`shard_map`) raises NotImplementedError, so that dispatch falls back to `xla`.

The extension `shardfuse._native` is built by the top-level CMakeLists.txt when
the package is installed (skip it with `SHARDFUSE_NATIVE=0`); `status` says why
it is missing when it is.

Axis glossary: B batch, T query length, S key length, H query heads, K kv
heads, D head dim.
"""

import functools
import importlib
import importlib.resources
import os

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse.kernels import vma
from shardfuse.kernels.attention import base, protocol

MAX_HEAD_DIM = 512
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_FORWARD = "shardfuse_attention_forward"
_BACKWARD = "shardfuse_attention_backward"


def _why_not_built() -> str:
    """The build's own note on why it skipped the extension, else a generic reason."""
    try:
        note = importlib.resources.files("shardfuse").joinpath("_native_build.txt").read_text()
    except (FileNotFoundError, OSError):
        note = ""
    note = note.strip()
    if note and note != "built":
        return f"shardfuse._native was not built: {note}"
    return (
        "shardfuse._native is not built (install from source with a C++ compiler and CMake: "
        "pip install -e .)"
    )


@functools.cache
def _extension():
    """The imported extension, its FFI targets registered once; NotImplementedError if absent."""
    try:
        native = importlib.import_module("shardfuse._native")
    except ImportError as e:
        if getattr(e, "name", None) == "shardfuse._native":
            raise NotImplementedError(_why_not_built()) from None
        raise NotImplementedError(f"shardfuse._native does not load: {e}") from e
    if hasattr(native, "set_default_threads"):  # (an extension built before it: every core)
        native.set_default_threads(default_threads())
    for name, capsule in native.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    return native


def default_threads() -> int:
    """The kernels' threads per call where `SHARDFUSE_NATIVE_THREADS` is unset: this
    process's cores over its CPU devices (at least 1).

    The devices of a simulated mesh (`jax_num_cpu_devices=8`) run their programs at once,
    each calling the kernels: 2 threads per call on 2 cores would start a thread that waits
    for a core every other device holds (measured: a MoE training step on 8 devices of a
    2-core machine, 315 -> 268 ms). One CPU device keeps every core.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, jax.local_device_count("cpu")))


def extension_module():
    """The loaded `shardfuse._native` extension (the attention and grouped matmul kernels').

    Raises:
      NotImplementedError: it is not built here (the message says why).
    """
    return _extension()


def build_info() -> dict:
    """What the extension was compiled for, `{}` without it.

    Keys: `isa`, `lanes`, `threads`, `block_q`, `block_kv` (masked problems'
    tiles) and `block_q_full`, `block_kv_full` (long unmasked problems').
    """
    try:
        return dict(_extension().build_info())
    except NotImplementedError:
        return {}


def status(platform: str) -> tuple[bool, str]:
    """`(can_run_here, why)` for the registry and `shardfuse info`."""
    try:
        info = _extension().build_info()
    except NotImplementedError as e:
        return False, str(e)
    if platform != "cpu":
        return False, f"CPU kernels; the backend is {platform!r}"
    return True, f"C++ kernels built for {info['isa']}, {info['threads']} threads"


def _check(config, q, *others):
    """NotImplementedError for valid inputs these kernels do not run."""
    _extension()
    for x in (q, *others):
        if axes := vma.partitioned_axes(x):
            # The custom calls have no partitioning rule: XLA would gather the operands
            # onto every device and repeat the whole problem on each (or refuse an
            # Explicit sharding). Per device, inside shard_map, they run as they are.
            raise NotImplementedError(
                "implementation 'native_cpu' runs per device (inside shard_map, or on one "
                f"device); its operands are partitioned over mesh axes {list(axes)} "
                "outside shard_map"
            )
    if jax.default_backend() != "cpu":
        raise NotImplementedError(
            f"implementation 'native_cpu' runs on CPU; the backend is {jax.default_backend()!r}"
        )
    if jnp.dtype(q.dtype) not in _DTYPES:
        raise NotImplementedError(
            f"implementation 'native_cpu' supports float32 and bfloat16; got {q.dtype}"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"implementation 'native_cpu' supports head dims <= {MAX_HEAD_DIM}; got D={q.shape[-1]}"
        )


def _static(config, q, q_seg, kv_seg):
    """The FFI attributes and the segment id operands (a placeholder when there are none)."""
    left, right = config.window if config.window is not None else (None, None)
    attributes = dict(
        causal=np.bool_(config.causal),
        window_left=np.int64(-1 if left is None else left),
        window_right=np.int64(-1 if right is None else right),
        softcap=np.float32(config.logit_softcap or 0.0),
        scale=np.float32(config.scale),
        has_segments=np.bool_(q_seg is not None),
    )
    if q_seg is None:
        q_seg = kv_seg = vma.to_varying(jnp.zeros((1,), jnp.int32), vma.common_axes(q))
    return attributes, q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """`(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])`; see `protocol.AttentionBackend`."""
    _check(config, q, k, v)
    q, k, v, q_pos, kv_pos, q_seg, kv_seg = vma.match_varying(q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    B, T, H, _ = q.shape
    attributes, q_seg, kv_seg = _static(config, q, q_seg, kv_seg)
    out_types = (vma.ffi_result(q.shape, q.dtype, q), vma.ffi_result((B, H, T), jnp.float32, q))
    call = jax.ffi.ffi_call(_FORWARD, out_types, vmap_method="sequential")
    out, lse = call(q, k, v, q_pos, kv_pos, q_seg, kv_seg, **attributes)
    return out, lse


def backward(
    config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse, *, grad_dtype=jnp.float32
):
    """`(dq, dk, dv)` in `grad_dtype` from the (possibly global) `out` and `lse`."""
    _check(config, q, k, v, d_out)
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse = vma.match_varying(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse
    )
    # The kernel forms protocol.backward_row_stats itself (delta = rowsum(d_out * out) -
    # d_lse, lse's -inf as 0) while it packs d_out: as an XLA einsum before the call, it ran
    # as a single-threaded dot, 6% of a GQA D128 2048-token step. out and d_out keep their
    # own dtype (a ring's merged out is float32) where the kernel reads it.
    out, d_out = (x if x.dtype in _DTYPES else x.astype(jnp.float32) for x in (out, d_out))
    attributes, q_seg, kv_seg = _static(config, q, q_seg, kv_seg)
    out_types = tuple(vma.ffi_result(x.shape, jnp.float32, q) for x in (q, k, v))
    call = jax.ffi.ffi_call(_BACKWARD, out_types, vmap_method="sequential")
    dq, dk, dv = call(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, d_out, out, lse, d_lse.astype(jnp.float32),
        **attributes,
    )  # fmt: skip
    return dq.astype(grad_dtype), dk.astype(grad_dtype), dv.astype(grad_dtype)


_flash = protocol.differentiable(forward, backward)


def flash_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """The native CPU kernels on validated inputs; `(out [B, T, H, D], lse float32 [B, H, T])`.

    Differentiable: `protocol.differentiable(forward, backward)`.
    """
    return _flash(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
