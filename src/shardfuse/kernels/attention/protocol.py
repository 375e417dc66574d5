"""What an attention backend provides: a block `forward` and a `backward` from the saved out/lse.

Every implementation module (`reference`, `xla`, `pallas_tpu`, `triton_gpu`)
exposes two functions on validated inputs (positions int32 `[T]` / `[S]`,
segment ids None or `[B, T]` / `[B, S]`):

    forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg) -> (out, lse)
    backward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
             *, grad_dtype=jnp.float32) -> (dq, dk, dv)

`out [B, T, H, D]` is in q's dtype, `lse [B, H, T]` float32. `backward`
recomputes `p = exp(s - lse)` and uses `delta = rowsum(d_out * out) - d_lse`
(FlashAttention-2, Dao 2023). `out` and `lse` need not be this call's own:
given the GLOBAL `out` and `lse` of a larger attention whose keys this call
sees a block of (a ring step), `p` is the block's slice of the global softmax
and `delta` is global too, so `backward` returns exactly the block's share of
the gradients, and summing the shares over the blocks gives the gradients of
the whole attention. Ring attention calls the two directly
(`collectives/ring_attention/blocks.py`); a backend's differentiable
`flash_attention(config, ...)` entry is `custom_vjp(forward, backward)`, built
once here by `differentiable`.

Axis glossary: B batch, T query length, S key length, H query heads, K kv
heads, D head dim.
"""

import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

from shardfuse.kernels import vma
from shardfuse.kernels.attention import base


class AttentionBackend(Protocol):
    """The two functions an attention implementation module exposes (a module satisfies this)."""

    def forward(self, config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        """`(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])`; lse = -inf where no key is
        visible, out 0 there."""
        ...

    def backward(
        self, config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse,
        d_out, d_lse, *, grad_dtype=jnp.float32,
    ):  # fmt: skip
        """`(dq [B, T, H, D], dk, dv [B, S, K, D])` in `grad_dtype`, from the (possibly global)
        `out`, float32 `lse` and the cotangents `d_out`, `d_lse` (float32 `[B, H, T]`)."""
        ...


def backward_row_stats(out, lse, d_out, d_lse, *, precision=None):
    """The float32 row statistics every backward starts from: `(lse, delta)`, each `[B, H, T]`.

        delta = rowsum(d_out * out) - d_lse        (since d lse / d s = p)

    and `lse` with its -inf (rows without a visible key) replaced by 0, so that
    `exp(s - lse)` stays finite where the mask zeroes `p` anyway.

    Args:
      out, d_out: `[B, T, H, D]` output and its cotangent (any float dtype).
      lse, d_lse: float32 `[B, H, T]` log-sum-exp and its cotangent.
      precision: of the `d_out * out` row sums (None: the default for float32).

    Example:
      >>> out = d_out = jnp.ones((1, 2, 1, 4))
      >>> lse, delta = backward_row_stats(out, jnp.array([[[-jnp.inf, 1.0]]]), d_out,
      ...                                 jnp.zeros((1, 1, 2)))
      >>> lse.tolist(), delta.tolist()
      ([[[0.0, 1.0]]], [[[4.0, 4.0]]])
    """
    f32 = jnp.float32
    # Summed to [B, T, H], then transposed: on XLA:CPU the einsum straight to [B, H, T] (or
    # a jnp.sum over D) ran single-threaded at 23 ms for [1, 2048, 8, 128]; this, 0.4 ms.
    delta = jnp.einsum("BTHD,BTHD->BTH", d_out.astype(f32), out.astype(f32), precision=precision)
    delta = jnp.swapaxes(delta, 1, 2)
    return jnp.where(jnp.isfinite(lse), lse, 0.0), delta - d_lse.astype(f32)


def differentiable(forward: Callable, backward: Callable) -> Callable:
    """`flash_attention(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, **static)` with a custom VJP.

    The forward saves `(q, k, v, positions, segment ids, out, lse)` and the
    backward calls `backward(..., out, lse, d_out, d_lse, grad_dtype=q.dtype)`:
    memory O(T + S) per head whatever the backend. `static` keyword options
    (hashable, not differentiated: a Pallas interpret mode, a Triton
    launcher) reach both functions unchanged.

    Inputs are first cast to one common set of varying mesh axes (`vma`), so
    that inside `shard_map` (a kv head replicated over a tensor-parallel axis)
    the cotangents match their primals.

    Args:
      forward: the backend's `forward`, see `AttentionBackend`.
      backward: the backend's `backward`.

    Returns:
      The differentiable entry, returning `(out, lse)`.

    Example:
      >>> from shardfuse.kernels.attention import protocol, xla
      >>> attention = protocol.differentiable(xla.forward, xla.backward)
      >>> q = k = v = jnp.ones((1, 8, 2, 16))
      >>> config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=0.25)
      >>> pos = jnp.arange(8, dtype=jnp.int32)
      >>> out, lse = attention(config, q, k, v, pos, pos, None, None)
      >>> out.shape, lse.shape
      ((1, 8, 2, 16), (1, 2, 8))
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def attention(config, static, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        return forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, **dict(static))

    def attention_fwd(config, static, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        out, lse = forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, **dict(static))
        return (out, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)

    def attention_bwd(config, static, residuals, cotangents):
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = residuals
        d_out, d_lse = cotangents
        dq, dk, dv = backward(
            config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
            grad_dtype=q.dtype, **dict(static),
        )  # fmt: skip
        grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
        return (*grads, None, None, None, None)

    attention.defvjp(attention_fwd, attention_bwd)

    def flash_attention(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, **static):
        q, k, v, q_pos, kv_pos, q_seg, kv_seg = vma.match_varying(
            q, k, v, q_pos, kv_pos, q_seg, kv_seg
        )
        static = tuple(sorted(static.items()))
        return attention(config, static, q, k, v, q_pos, kv_pos, q_seg, kv_seg)

    return flash_attention
