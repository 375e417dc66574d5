"""Ring attention per shard: K/V rotate around a mesh axis while flash-attention blocks compute.

Ring Attention (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context"). Each of the N devices of the ring
holds a shard of the queries and of the keys/values, in one of the layouts of
`layouts.py`. Forward, N steps: at step s device r holds the K/V shard of
device `src = (r - s) mod N`; it starts sending it on to device r + 1 (a
`ppermute` the compiler overlaps with the compute) and computes that block's
`(out_b, lse_b)` with the single-device kernel, on absolute positions so that
causal, window and segment masks are those of the whole sequence. Partial
results merge in float32 through their lse:

    lse = logaddexp(lse_acc, lse_b)
    out = exp(lse_acc - lse) * out_acc + exp(lse_b - lse) * out_b

with both exponents <= 0 (no overflow) and rows that see nothing (lse = -inf)
contributing exactly 0. Steps whose block no query can see (decided on the
positions' and segment ids' ranges) skip the compute under `lax.cond` but
still pass K/V on.

Backward (`jax.custom_vjp`), a second ring: only q, k, v, out and lse are
saved (memory O(local length), nothing per step). K/V travel again, each with
its float32 dK/dV accumulator one step behind: at step s device r receives
the accumulator of the shard it now holds, adds this block's share computed
from the global out and lse (FlashAttention-2 backward), and sends it on;
after N steps every accumulator is back on its owner. dQ accumulates locally.
"""

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from shardfuse.collectives.ring_attention import blocks, layouts
from shardfuse.kernels import vma
from shardfuse.kernels.attention import base, masks

# Largest xla tile that zigzag chunks are cut into, so tiles never straddle two chunks.
_MAX_ALIGNED_BLOCK = 256


@dataclasses.dataclass(frozen=True)
class RingSpec:
    """Static description of one ring: hashable, the custom_vjp's non-differentiable argument.

    Attributes:
      axis_name: the mesh axis (or tuple of axes) the ring runs over.
      ring_size: N, devices on that axis.
      layout: "contiguous", "zigzag" or "striped".
      config: the validated attention options.
      q_offset: added to the queries' layout positions (`S - T` of the
        global sequences: bottom-right alignment).
      implementation: the single-device attention each step runs.
    """

    axis_name: Hashable
    ring_size: int
    layout: str
    config: base.AttentionConfig
    q_offset: int
    implementation: str


def _full(shape, value, dtype, *likes):
    """A constant that varies over the same mesh axes as `likes` (loop carries and
    cond branches inside `shard_map` must agree on that)."""
    return vma.to_varying(jnp.full(shape, value, dtype), vma.common_axes(*likes))


def step_visible(config, q_pos, kv_pos, q_seg, kv_seg):
    """bool scalar: False only if no query of this shard can see any key of this block
    (the block-range rule of kernels/attention/masks.py on the whole shard)."""
    seg_ranges = ()
    if q_seg is not None:  # [B] ranges: the step runs if any batch row may see a key
        seg_ranges = (masks.value_range(q_seg), masks.value_range(kv_seg))
    some, _ = masks.block_visibility(
        config, masks.value_range(q_pos), masks.value_range(kv_pos), *seg_ranges
    )
    return jnp.any(some)


def _merge(acc, block):
    """Merges two partial results `(out f32 [B, T, H, D], lse f32 [B, H, T])` through their lse."""
    out_acc, lse_acc = acc
    out_b, lse_b = block
    top = jnp.maximum(lse_acc, lse_b)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # both -inf: log(0 + 0) = -inf below
    lse = top + jnp.log(jnp.exp(lse_acc - top) + jnp.exp(lse_b - top))
    ref = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def weight(x):  # [B, H, T] -> [B, T, H, 1], in [0, 1]
        return jnp.swapaxes(jnp.exp(x - ref), 1, 2)[..., None]

    out = weight(lse_acc) * out_acc + weight(lse_b) * out_b.astype(jnp.float32)
    return out, lse


def _positions(spec, index, q_len, kv_len):
    q_pos = layouts.shard_positions(index, q_len, spec.ring_size, spec.layout) + spec.q_offset

    def kv_pos(src):
        return layouts.shard_positions(src, kv_len, spec.ring_size, spec.layout)

    return q_pos, kv_pos


def _send(x, spec):
    """Passes `x` one device on around the ring (r -> r + 1)."""
    n = spec.ring_size
    return lax.ppermute(x, spec.axis_name, [(i, (i + 1) % n) for i in range(n)])


def ring_forward(spec, q, k, v, q_seg, kv_seg):
    """The forward ring: `(out [B, T, H, D] in q's dtype, lse f32 [B, H, T])`."""
    ops = blocks.load(spec.implementation)
    config, n = spec.config, spec.ring_size
    B, T, H, D = q.shape
    index = lax.axis_index(spec.axis_name)
    q_pos, kv_pos_of = _positions(spec, index, T, k.shape[1])

    def step(s, kv, acc):
        k, v, kv_seg = kv
        kv_pos = kv_pos_of((index - s) % n)  # this block came from device r - s

        def compute(acc):
            return _merge(acc, ops.forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg))

        visible = step_visible(config, q_pos, kv_pos, q_seg, kv_seg)
        return lax.cond(visible, compute, lambda acc: acc, acc)

    def body(s, carry):
        kv, acc = carry
        with jax.named_scope("ring_attention_send_kv"):
            next_kv = _send(kv, spec)  # issued first: overlaps with this step's compute
        return next_kv, step(s, kv, acc)

    likes = (q, k, v, q_seg, kv_seg)
    acc = (
        _full((B, T, H, D), 0.0, jnp.float32, *likes),
        _full((B, H, T), -jnp.inf, jnp.float32, *likes),
    )
    kv, acc = lax.fori_loop(0, n - 1, body, ((k, v, kv_seg), acc))
    out, lse = step(n - 1, kv, acc)  # the last block: nothing left to send
    return out.astype(q.dtype), lse


def ring_backward(spec, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
    """The backward ring: `(dq, dk, dv)` in the inputs' dtypes, from the saved out and lse."""
    ops = blocks.load(spec.implementation)
    config, n = spec.config, spec.ring_size
    index = lax.axis_index(spec.axis_name)
    q_pos, kv_pos_of = _positions(spec, index, q.shape[1], k.shape[1])
    likes = (q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)

    def grads(s, kv, dq):
        """This block's share: `(dq + dq_b, dk_b, dv_b)`, float32."""
        k, v, kv_seg = kv
        kv_pos = kv_pos_of((index - s) % n)

        def compute(dq):
            dq_b, dk_b, dv_b = ops.backward(
                config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse
            )
            return dq + dq_b, dk_b, dv_b

        def skip(dq):
            zeros = _full(k.shape, 0.0, jnp.float32, *likes)
            return dq, zeros, zeros

        visible = step_visible(config, q_pos, kv_pos, q_seg, kv_seg)
        return lax.cond(visible, compute, skip, dq)

    def body(s, carry):
        kv, pending, dq = carry
        with jax.named_scope("ring_attention_send_kv"):
            next_kv = _send(kv, spec)
        with jax.named_scope("ring_attention_send_dkv"):
            # The accumulator of the shard held now, from the device that held it last step.
            dk_in, dv_in = _send(pending, spec)
        dq, dk_b, dv_b = grads(s, kv, dq)
        return next_kv, (dk_in + dk_b, dv_in + dv_b), dq

    kv = (k, v, kv_seg)
    dq = _full(q.shape, 0.0, jnp.float32, *likes)
    next_kv = _send(kv, spec) if n > 1 else kv
    dq, dk, dv = grads(0, kv, dq)  # own K/V first: their accumulators start here
    if n > 1:
        kv, (dk, dv), dq = lax.fori_loop(1, n - 1, body, (next_kv, (dk, dv), dq))
        dk_in, dv_in = _send((dk, dv), spec)
        dq, dk_b, dv_b = grads(n - 1, kv, dq)
        with jax.named_scope("ring_attention_send_dkv"):
            dk, dv = _send((dk_in + dk_b, dv_in + dv_b), spec)  # home to the owner
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring(spec: RingSpec, q, k, v, q_seg, kv_seg):
    """Ring attention on validated per-shard inputs: `(out, lse)`, with the ring backward."""
    return ring_forward(spec, q, k, v, q_seg, kv_seg)


def _ring_fwd(spec, q, k, v, q_seg, kv_seg):
    out, lse = ring_forward(spec, q, k, v, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _ring_bwd(spec, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = ring_backward(spec, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)
    return dq, dk, dv, None, None


ring.defvjp(_ring_fwd, _ring_bwd)


def aligned_block_sizes(config, layout, implementation, q_len, kv_len) -> base.AttentionConfig:
    """For zigzag on xla: tiles that never straddle the two chunks of a shard.

    A tile straddling an early and a late chunk is never fully masked, so the
    kernel could not skip the invisible half of a zigzag block. Sizes the user
    set are kept.
    """
    if layout != "zigzag" or implementation != "xla" or config.block_sizes != base.BlockSizes():
        return config

    def block(chunk):
        if chunk <= _MAX_ALIGNED_BLOCK:
            return chunk
        fits = [b for b in range(8, _MAX_ALIGNED_BLOCK + 1, 8) if chunk % b == 0]
        return max(fits) if fits else None

    sizes = base.BlockSizes(block_q=block(q_len // 2), block_kv=block(kv_len // 2))
    return dataclasses.replace(config, block_sizes=sizes)
