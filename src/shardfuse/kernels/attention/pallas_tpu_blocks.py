"""Tiling of the Pallas TPU flash attention: block sizes, the TPU tiling rule, block tables.

Mosaic (the Pallas TPU compiler) maps the last two dims of every block onto
the vector registers' (8 sublanes, 128 lanes) tiles, so each block's last two
dims must be multiples of (8, 128) or the whole array dim. The kernels keep
per-row statistics (lse, positions, segment ids) lane-dense, in `[.., 128]`
and `[8, ..]` broadcasts as splash attention does, and the dK/dV kernel holds
the transposed scores `[block_kv, block_q]`; so `block_q` and `block_kv` are
both lane dims somewhere and must be multiples of 128. Sequences are padded to
block multiples by the wrapper and the padding is masked by index.

Block skipping (splash attention, Pallas TPU ops in JAX): a table of block
states says, per batch and `(query block, key block)`, whether no query of the
block sees any key (skip: no MXU work), some do (apply the mask), or every
query sees every key (no mask work). A second table clamps the K/V block
index of skipped steps to the next block that is computed (or the last one),
so the pipeline issues no DMA for a skipped block: Pallas only copies a block
when its index changes between consecutive grid steps.

Axis glossary: B batch, T query length, S key length, D head dim,
nq / nk number of query / key blocks, bq / bk their sizes.
"""

import dataclasses
import math
import numbers

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.attention import base, masks

NUM_LANES = 128
NUM_SUBLANES = 8
SKIP, PARTIAL, FULL = 0, 1, 2  # block states


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class PallasTPUBlockSizes:
    """Tile sizes of the Pallas TPU flash attention kernels.

    Attributes:
      block_q: query rows per tile of the forward kernel.
      block_kv: key rows per tile of the forward kernel.
      block_q_bwd: query rows per tile of the dQ and dK/dV kernels.
      block_kv_bwd: key rows per tile of the dQ and dK/dV kernels.

    Every size must be a positive multiple of 128 (the TPU lane width): see
    the module docstring. The sizes are upper bounds: a sequence shorter than
    a block gets one block, rounded up to 128.

    Example:
      >>> PallasTPUBlockSizes.get_default(jnp.bfloat16, head_dim=128)
      PallasTPUBlockSizes(block_q=512, block_kv=512, block_q_bwd=256, block_kv_bwd=512)
    """

    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(
                    f"PallasTPUBlockSizes.{field.name}={value!r} must be a positive int"
                )
            if value % NUM_LANES:
                raise ValueError(
                    f"PallasTPUBlockSizes.{field.name}={value} must be a multiple of "
                    f"{NUM_LANES}: the TPU tiling rule wants the last two block dims to be "
                    "multiples of "
                    f"({NUM_SUBLANES}, {NUM_LANES}), and this size is a lane dim of the "
                    "lse, position and transposed score tiles"
                )

    @classmethod
    def get_default(cls, dtype, head_dim: int) -> "PallasTPUBlockSizes":
        """Defaults by bytes per row: 512 rows for up to 256 bytes, 256 up to 512, else 128.

        A bfloat16 row of D = 128 is 256 bytes: 512 x 512 tiles keep the
        forward's working set (double-buffered q, k, v and out tiles, the
        float32 accumulator, `[bq, bk]` float32 scores and probabilities)
        near 4 MiB, a quarter of the default 16 MiB scoped VMEM, while each
        grid step does enough MXU work (2 x 512 x 512 x 128 x 2 flops) to hide
        its ~0.35 us step overhead and the next tiles' DMA. float32 or wider
        heads halve the rows to stay within the same budget. The backward
        holds four `[bk, bq]` float32 temporaries and two accumulators, so
        its query tile is halved again (at least 128).
        """
        row_bytes = int(head_dim) * jnp.dtype(dtype).itemsize
        rows = 512 if row_bytes <= 256 else 256 if row_bytes <= 512 else 128
        return cls(rows, rows, max(rows // 2, NUM_LANES), rows)

    @classmethod
    def from_config(cls, requested: base.BlockSizes, dtype, head_dim: int) -> "PallasTPUBlockSizes":
        """The defaults, overridden (forward and backward) by the user's `base.BlockSizes`.

        Raises:
          NotImplementedError: a requested size is not a multiple of 128.
        """
        default = cls.get_default(dtype, head_dim)
        block_q = requested.block_q or default.block_q
        block_kv = requested.block_kv or default.block_kv
        if block_q % NUM_LANES or block_kv % NUM_LANES:
            raise NotImplementedError(
                f"pallas_tpu tiles with multiples of {NUM_LANES} rows; got "
                f"block_q={requested.block_q}, block_kv={requested.block_kv}"
            )
        return cls(
            block_q,
            block_kv,
            requested.block_q or default.block_q_bwd,
            requested.block_kv or default.block_kv_bwd,
        )


def fit_block(length: int, block: int) -> int:
    """Even tiles of at most `block` rows covering `length`, each a multiple of 128.

    Example:
      >>> fit_block(600, 512)  # two tiles of 384, not 512 + 88
      384
    """
    num_blocks = max(1, math.ceil(length / block))
    return min(block, _round_up(math.ceil(length / num_blocks), NUM_LANES))


def check_tiling(name: str, block_shape, array_shape) -> None:
    """Raises NotImplementedError unless `block_shape` obeys the TPU tiling rule.

    The last two dims must be multiples of (8, 128) or equal the array's
    dims; leading dims (`None` = squeezed) are free.

    Example:
      >>> check_tiling("q", (None, None, 128, 64), (1, 2, 256, 64))  # 64 = the full dim
      >>> check_tiling("q", (None, None, 100, 64), (1, 2, 256, 64))
      Traceback (most recent call last):
      NotImplementedError: q: block (None, None, 100, 64) of array (1, 2, 256, 64) breaks ...
    """
    if len(block_shape) != len(array_shape):
        raise NotImplementedError(
            f"{name}: block {block_shape} has the wrong rank for {array_shape}"
        )
    for block_dim, array_dim, multiple in zip(
        block_shape[-2:], array_shape[-2:], (NUM_SUBLANES, NUM_LANES), strict=True
    ):
        if block_dim is None or (block_dim % multiple and block_dim != array_dim):
            raise NotImplementedError(
                f"{name}: block {tuple(block_shape)} of array {tuple(array_shape)} breaks the "
                f"TPU tiling rule (last two block dims multiples of ({NUM_SUBLANES}, "
                f"{NUM_LANES}) or the full dims)"
            )


def block_states(config, q_pos, kv_pos, q_seg, kv_seg, *, length_q, length_kv, block_q, block_kv):
    """int32 `[B or 1, nq, nk]` of SKIP / PARTIAL / FULL for padded, blocked inputs.

    Args:
      q_pos, kv_pos: int32 `[Tp]`, `[Sp]` positions, padded to block multiples.
      q_seg, kv_seg: None or int32 `[B, Tp]`, `[B, Sp]`.
      length_q, length_kv: the unpadded T and S (rows beyond are padding).
      block_q, block_kv: tile sizes.

    Example:
      >>> config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0)
      >>> pos = jnp.arange(256, dtype=jnp.int32)
      >>> block_states(config, pos, pos, None, None, length_q=256, length_kv=256,
      ...              block_q=128, block_kv=128).tolist()  # 0 skip, 1 partial, 2 full
      [[[1, 0], [2, 1]]]
    """
    nq, nk = q_pos.shape[0] // block_q, kv_pos.shape[0] // block_kv
    q_valid = (jnp.arange(nq * block_q) < length_q).reshape(nq, block_q)
    kv_valid = (jnp.arange(nk * block_kv) < length_kv).reshape(nk, block_kv)
    # Ranges as [1, nq, 1] against [1, 1, nk]; segment-id ranges [B, nq, 1] against [B, 1, nk].
    q_range = [x[None, :, None] for x in masks.value_range(q_pos.reshape(nq, block_q), q_valid)]
    kv_range = [x[None, None] for x in masks.value_range(kv_pos.reshape(nk, block_kv), kv_valid)]
    seg_ranges = ()
    if q_seg is not None:
        B = q_seg.shape[0]
        qs = [x[:, :, None] for x in masks.value_range(q_seg.reshape(B, nq, block_q), q_valid)]
        ks = [x[:, None] for x in masks.value_range(kv_seg.reshape(B, nk, block_kv), kv_valid)]
        seg_ranges = (qs, ks)
    some, every = masks.block_visibility(config, q_range, kv_range, *seg_ranges)
    some &= (jnp.any(q_valid, -1)[:, None] & jnp.any(kv_valid, -1)[None, :])[None]
    every &= (jnp.all(q_valid, -1)[:, None] & jnp.all(kv_valid, -1)[None, :])[None]
    return jnp.where(every, FULL, jnp.where(some, PARTIAL, SKIP)).astype(jnp.int32)


def fetch_indices(states):
    """int32 like `states [.., n]`: the block to hold at each step along the last axis.

    A computed step holds its own block; a skipped step holds the next
    computed block (prefetching it early), or the last computed one when none
    follows, or 0 when the row computes nothing: consecutive equal indices
    mean no DMA.

    Example:
      >>> fetch_indices(jnp.array([[0, 0, 1, 2, 0]])).tolist()
      [[2, 2, 2, 3, 3]]
    """
    n = states.shape[-1]
    steps = jnp.arange(n, dtype=jnp.int32)
    computed = states != SKIP
    prev_index = _cumulative(jnp.where(computed, steps, -1), jnp.maximum, reverse=False)
    next_index = _cumulative(jnp.where(computed, steps, n), jnp.minimum, reverse=True)
    fallback = jnp.where(next_index < n, next_index, jnp.maximum(prev_index, 0))
    return jnp.where(computed, steps, fallback).astype(jnp.int32)


def _cumulative(x, op, *, reverse):
    return lax.associative_scan(op, x, axis=x.ndim - 1, reverse=reverse)
