"""One ring step's attention block, forward and backward, over the attention implementations.

The ring needs two things of a single-device attention backend:

- `forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg) -> (out, lse)`,
  the block's partial result with a float32 lse, for the lse merge;
- `backward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out,
  d_lse) -> float32 (dq, dk, dv)`, the block's share of the gradients given
  the GLOBAL `out` and `lse` of the whole ring (`p = exp(s - lse)` is then
  the block's slice of the global softmax, and `delta = rowsum(d_out * out)
  - d_lse` is global too).

`xla` provides both directly (`kernels/attention/xla.py`). Any other
implementation (reference, and pallas_tpu / triton once they exist) is used
through its `flash_attention(config, ...)` entry point and its VJP: with
`w = exp(lse_b - lse)`, the global result is `out = sum_b w_b out_b`, so

    d out_b = w_b d_out
    d lse_b = w_b (rowsum(d_out * (out_b - out)) + d_lse)

which costs one block forward more per step than a dedicated backward.
"""

import dataclasses
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from shardfuse.kernels.attention import api

# Implementations with a dedicated block backward from the global out / lse:
# name -> module exposing `forward` and `backward` with the signatures above.
BLOCK_KERNELS = {"xla": "shardfuse.kernels.attention.xla"}


@dataclasses.dataclass(frozen=True)
class BlockOps:
    """Forward and backward of one ring step with one attention implementation."""

    name: str
    forward: Callable
    backward: Callable


def candidates(implementation: str | None) -> tuple[str, ...]:
    """Implementations to try, best first: the one asked for, or the platform's preference."""
    if implementation is None:
        return api.PREFERENCE.get(jax.default_backend(), ("xla",))
    if implementation not in api.IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {[None, *api.IMPLEMENTATIONS]}"
        )
    return (implementation,)


def load(name: str) -> BlockOps:
    """The block ops of implementation `name`; NotImplementedError if it cannot run here."""
    if name in BLOCK_KERNELS:
        module = importlib.import_module(BLOCK_KERNELS[name])
        return BlockOps(name, module.forward, module.backward)
    attention = api.load_implementation(name)  # raises NotImplementedError if absent

    def backward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse):
        def block(q, k, v):
            return attention(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)

        (out_b, lse_b), vjp = jax.vjp(block, q, k, v)
        lse_ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
        # w <= 1 since lse >= lse_b; 0 where this block sees nothing.
        weight = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - lse_ref), 0.0)  # [B, H, T]
        d_out32 = d_out.astype(jnp.float32)
        d_out_b = (jnp.swapaxes(weight, 1, 2)[..., None] * d_out32).astype(out_b.dtype)
        shift = jnp.einsum(
            "BTHD,BTHD->BHT", d_out32, out_b.astype(jnp.float32) - out.astype(jnp.float32)
        )
        d_lse_b = weight * (shift + d_lse)
        dq, dk, dv = vjp((d_out_b, d_lse_b))
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    return BlockOps(name, attention, backward)
