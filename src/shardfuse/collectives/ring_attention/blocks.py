"""One ring step's attention block, forward and backward, over the attention implementations.

The ring runs, per step, the two functions of the backend protocol
(`kernels/attention/protocol.py`) of the single-device implementation:

- `forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg) -> (out, lse)`,
  the block's partial result with a float32 lse, for the lse merge;
- `backward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out,
  d_lse) -> float32 (dq, dk, dv)`, the block's share of the gradients given
  the GLOBAL `out` and `lse` of the whole ring (`p = exp(s - lse)` is then
  the block's slice of the global softmax, and `delta = rowsum(d_out * out)
  - d_lse` is global too).

Every implementation (reference, xla, pallas_tpu, triton) provides both, so
the backward ring runs only backward kernels: no block forward is recomputed
per step.
"""

import dataclasses
from collections.abc import Callable

from shardfuse.kernels.attention import api


@dataclasses.dataclass(frozen=True)
class BlockOps:
    """Forward and backward of one ring step with one attention implementation."""

    name: str
    forward: Callable
    backward: Callable


def candidates(implementation) -> tuple[str, ...]:
    """Implementations to try, in order: the attention registry's reading of `implementation=`
    (None: the platform's preference; a name; a sequence of names). ValueError if unknown."""
    return api.ATTENTION.candidates(implementation)


def load(name: str) -> BlockOps:
    """The block ops of implementation `name`: the protocol's `forward` and `backward` of the
    attention registry's module for `name`; NotImplementedError if it cannot be imported."""
    return BlockOps(name, api.ATTENTION.load(name, "forward"), api.ATTENTION.load(name, "backward"))


def attend_whole(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, implementation):
    """`(out, lse)` of `sf.flash_attention` with `config`'s mask, softcap, scale and blocks.

    The one block of the strategies that do not ring: all_gather (this device's
    queries against the gathered K/V) and Ulysses (a head slice against the
    whole sequence), with the positions they computed.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.kernels.attention import base
      >>> q = k = v = jnp.ones((1, 4, 2, 8))
      >>> config = base.validate(q, k, v, causal=True)
      >>> pos = jnp.arange(4, dtype=jnp.int32)
      >>> out, lse = attend_whole(config, q, k, v, pos, pos, None, None, "xla")
      >>> out.shape, lse.shape
      ((1, 4, 2, 8), (1, 2, 4))
    """
    return api.flash_attention(
        q, k, v, causal=config.causal, q_positions=q_pos, kv_positions=kv_pos,
        q_segment_ids=q_seg, kv_segment_ids=kv_seg, window=config.window,
        logit_softcap=config.logit_softcap, scale=config.scale, return_lse=True,
        implementation=implementation, block_sizes=config.block_sizes,
    )  # fmt: skip
