"""Flash attention on NVIDIA GPUs: Triton kernels called through jax-triton, with a custom VJP.

FlashAttention-2 (Dao 2023, arXiv:2307.08691): the forward keeps an online
softmax per query block and saves only `out` and the float32 `lse`; the
backward recomputes probabilities block by block from `lse`, with
`delta = rowsum(dO * O) - dlse` computed first, then dK/dV (one program per
key block and kv head, looping over the G query heads that share it: GQA
without repeating K/V) and dQ (one program per query block), both without
atomics, so results are deterministic. The kernels are in `triton_kernels.py`,
their tile sizes and launch options in `triton_configs.py`.

This wrapper computes, in JAX, which blocks each program visits
(`masks.visit_ranges`: `[B, n_outer, 4] = (lo, full_lo, full_hi, hi)`): blocks that no query
of a block can see (causal, window, disjoint segment ids, padding) are never
loaded, and fully visible blocks run without a mask. Positions need not be
monotone: the ranges are conservative and the element mask decides.

Axis glossary: B batch, T query length, S key length, H query heads,
K kv heads, G = H // K, D head dim, nq/nk query/key blocks.

Without an NVIDIA GPU (compute capability >= 8.0), triton or jax_triton,
`flash_attention` raises NotImplementedError with the reason, so that
dispatch falls back; on CPU the kernels run under the Triton interpreter
with `launcher=triton.launch.InterpretLauncher()`.
"""

import jax
import jax.numpy as jnp

from shardfuse.kernels.attention import base, masks, protocol, triton_configs
from shardfuse.kernels.triton import launch

_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (B * H programs)


def _tile(length: int, configured: int, requested: int | None, name: str) -> int:
    """Rows per tile: the requested size, else the configured one shrunk to fit short inputs."""
    if requested is not None:
        if requested < 16 or requested & (requested - 1):
            raise NotImplementedError(
                f"implementation 'triton' needs block sizes that are powers of two >= 16; "
                f"got BlockSizes.{name}={requested}"
            )
        return requested
    return min(configured, max(16, 1 << (length - 1).bit_length()))


def kernel_config(config, tuned, T, S):
    """The `tuned` `AttentionKernelConfig` with the user's `BlockSizes` applied, fitted to T, S."""
    block_m = _tile(T, tuned.block_m, config.block_sizes.block_q, "block_q")
    block_n = _tile(S, tuned.block_n, config.block_sizes.block_kv, "block_kv")
    return triton_configs.AttentionKernelConfig(block_m, block_n, tuned.num_warps, tuned.num_stages)


def kernel_options(config, dtype, has_segments: bool):
    """The kernels' shared `tl.constexpr` options."""
    left, right = config.window if config.window is not None else (None, None)
    return dict(
        SCALE=float(config.scale),
        SOFTCAP=float(config.logit_softcap or 0.0),
        CAUSAL=bool(config.causal),
        WINDOW_LEFT=-1 if left is None else int(left),
        WINDOW_RIGHT=-1 if right is None else int(right),
        HAS_SEGMENTS=bool(has_segments),
        IEEE=jnp.dtype(dtype) == jnp.float32,
    )


def _segments(q_seg, kv_seg):
    """int32 segment ids, or 1-element placeholders the kernels never read."""
    if q_seg is None:
        placeholder = jnp.zeros((1,), jnp.int32)
        return placeholder, placeholder
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, launcher=None):
    """The forward kernel on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`.

    `launcher`: None (jax-triton on this GPU) or `triton.launch.InterpretLauncher()`.
    Used by `flash_attention` and by collectives that merge partial results.
    """
    launcher = _launcher_for(config, q, k, launcher)
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    configs = triton_configs.default_configs(launcher.compute_capability, D, q.dtype)
    tile = kernel_config(config, configs.forward, T, S)
    visible, full = masks.block_table(
        config, q_pos, kv_pos, q_seg, kv_seg, tile.block_m, tile.block_n
    )
    ranges = masks.visit_ranges(visible, full, B)  # [B, nq, 4] over key blocks
    q_seg_arg, kv_seg_arg = _segments(q_seg, kv_seg)
    out, lse = launcher(
        "attention_forward_kernel",
        [q, k, v, q_pos, kv_pos, q_seg_arg, kv_seg_arg, ranges],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        (ranges.shape[1], B * H),
        tile,
        dict(
            T=T,
            S=S,
            H=H,
            K=K,
            D=D,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_D=triton_configs.padded_head_dim(D),
            **kernel_options(config, q.dtype, q_seg is not None),
        ),
    )
    return out, lse


def backward(
    config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
    *, grad_dtype=jnp.float32, launcher=None,
):  # fmt: skip
    """The delta, dK/dV and dQ kernels: `(dq, dk, dv)` in `grad_dtype` (float32 by default).

    `out` and `lse` may be those of a larger attention that this call is one
    block of (ring attention): `delta = rowsum(d_out * out) - d_lse` and
    `p = exp(s - lse)` then give this block's share of the gradients.
    """
    launcher = _launcher_for(config, q, k, launcher)
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    configs = triton_configs.default_configs(launcher.compute_capability, D, q.dtype)
    shape = dict(T=T, S=S, H=H, K=K, D=D, BLOCK_D=triton_configs.padded_head_dim(D))
    options = kernel_options(config, q.dtype, q_seg is not None)
    q_seg_arg, kv_seg_arg = _segments(q_seg, kv_seg)
    d_out = d_out.astype(q.dtype)

    delta_tile = kernel_config(config, configs.delta, T, S)
    (delta,) = launcher(
        "attention_backward_delta_kernel",
        [out, d_out, d_lse.astype(jnp.float32)],
        [jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        (-(-T // delta_tile.block_m), B * H),
        delta_tile,
        dict(T=T, H=H, D=D, BLOCK_M=delta_tile.block_m, BLOCK_D=shape["BLOCK_D"]),
    )
    inputs = [q, k, v, q_pos, kv_pos, q_seg_arg, kv_seg_arg]

    tile = kernel_config(config, configs.dkdv, T, S)
    visible, full = masks.block_table(
        config, q_pos, kv_pos, q_seg, kv_seg, tile.block_m, tile.block_n
    )
    # [B, nk, 4] over query blocks
    ranges = masks.visit_ranges(visible.transpose(0, 2, 1), full.transpose(0, 2, 1), B)
    dk, dv = launcher(
        "attention_backward_dkdv_kernel",
        [*inputs, ranges, d_out, lse, delta],
        [jax.ShapeDtypeStruct(k.shape, grad_dtype)] * 2,
        (ranges.shape[1], B * K),
        tile,
        dict(**shape, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, **options),
    )

    tile = kernel_config(config, configs.dq, T, S)
    visible, full = masks.block_table(
        config, q_pos, kv_pos, q_seg, kv_seg, tile.block_m, tile.block_n
    )
    ranges = masks.visit_ranges(visible, full, B)  # [B, nq, 4]
    (dq,) = launcher(
        "attention_backward_dq_kernel",
        [*inputs, ranges, d_out, lse, delta],
        [jax.ShapeDtypeStruct(q.shape, grad_dtype)],
        (ranges.shape[1], B * H),
        tile,
        dict(**shape, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, **options),
    )
    return dq, dk, dv


_flash = protocol.differentiable(forward, backward)


def _check_supported(q, k):
    """NotImplementedError for valid inputs these kernels cannot index or tile."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    if D > triton_configs.MAX_HEAD_DIM:
        raise NotImplementedError(
            f"implementation 'triton' supports head dims up to {triton_configs.MAX_HEAD_DIM}; "
            f"got D={D}"
        )
    if B * H > _MAX_GRID_Y:
        raise NotImplementedError(
            f"implementation 'triton' launches B * H = {B * H} programs on the second grid "
            f"axis; CUDA allows at most {_MAX_GRID_Y}"
        )
    # Offsets inside one batch element, lse rows and segment ids are int32 in the kernels.
    if max(T * H * D, S * K * D, B * H * T, B * S) >= 2**31:
        raise NotImplementedError(
            f"implementation 'triton' indexes with int32: T * H * D = {T * H * D}, "
            f"S * K * D = {S * K * D}, B * H * T = {B * H * T} and B * S = {B * S} "
            "must be < 2**31"
        )


def _launcher_for(config, q, k, launcher):
    """`launcher`, or the GPU's; NotImplementedError for inputs these kernels cannot run."""
    _check_supported(q, k)
    launcher = launch.resolve(launcher, triton_configs.KERNELS_MODULE)
    triton_configs.default_configs(launcher.compute_capability, q.shape[3], q.dtype)
    for size, name in (
        (config.block_sizes.block_q, "block_q"),
        (config.block_sizes.block_kv, "block_kv"),
    ):
        _tile(1, 16, size, name)
    return launcher


def flash_attention(
    config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, launcher=None
):
    """Flash attention with Triton kernels on validated inputs (see `api.flash_attention`).

    Args:
      config: the validated `AttentionConfig`; `config.block_sizes` (powers of
        two >= 16) override every kernel's tile sizes.
      q: `[B, T, H, D]` float32, bfloat16 or float16.
      k, v: `[B, S, K, D]`, `H % K == 0`.
      q_pos, kv_pos: int32 `[T]`, `[S]` absolute positions.
      q_seg, kv_seg: None or int `[B, T]`, `[B, S]` segment ids.
      launcher: None for jax-triton on this machine's GPU, or
        `triton.launch.InterpretLauncher()` to run the kernels on CPU.

    Returns:
      `(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])`, differentiable
      in q, k and v.

    Raises:
      NotImplementedError: no usable NVIDIA GPU, triton or jax_triton (with
        launcher=None), head dim > 256, float32 inputs with head dim > 64,
        block sizes that are not powers of two >= 16, or sizes beyond the
        kernels' int32 indexing.

    Example:
      On a GPU, through the public API:

      >>> import jax, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (1, 256, 8, 128), jax.numpy.bfloat16)
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 256, 2, 128), jax.numpy.bfloat16)
      >>> out = sf.flash_attention(q, k, v, causal=True, implementation="triton")  # doctest: +SKIP

      On CPU, the same kernels under the Triton interpreter (needs torch and triton):

      >>> from shardfuse.kernels.attention import base, triton_gpu
      >>> from shardfuse.kernels.triton.launch import InterpretLauncher
      >>> q = k = v = jax.numpy.ones((1, 32, 2, 16))
      >>> config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=0.25)
      >>> pos = jax.numpy.arange(32)
      >>> out, lse = triton_gpu.flash_attention(  # doctest: +SKIP
      ...     config, q, k, v, pos, pos, None, None, launcher=InterpretLauncher())
    """
    launcher = _launcher_for(config, q, k, launcher)  # NotImplementedError before tracing
    q_pos = jnp.asarray(q_pos, jnp.int32)
    kv_pos = jnp.asarray(kv_pos, jnp.int32)
    return _flash(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, launcher=launcher)
