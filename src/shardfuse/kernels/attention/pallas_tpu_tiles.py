"""Tile helpers of the Pallas TPU attention kernels: scores, masks, the dS rule, block steps.

Shared by the flash-attention kernels (`pallas_tpu_kernels.py`) and the fused
ring-attention kernels (`collectives/ring_attention/pallas_tpu_fused_kernels.py`),
as `triton_tiles.py` is by the Triton kernels: `scores` is the scaled, capped
`q k^T` of one tile (and tanh for the cap's derivative); `MaskRefs` builds a tile's
visibility mask (`masks.visible`, the definition) in either orientation;
`zero_rows` and `any_along_lanes` keep NaN of unseen rows out of the matmuls;
`score_grads` is FlashAttention-2's `dS = p * (dP - delta)`; `run_step` runs a
step masked on a PARTIAL block, unmasked on a FULL one, not at all on a skipped
one (`pallas_tpu_blocks`).

Axis glossary: bq query rows, bk key rows, D head dim, 128 lanes, 8 sublanes.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.pallas_tpu_blocks import FULL, NUM_LANES, PARTIAL

NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class Static:
    """Static facts every kernel needs (hashable, bound with functools.partial)."""

    config: object  # base.AttentionConfig
    length_q: int  # T before padding
    length_kv: int  # S before padding
    block_q: int
    block_kv: int
    precision: lax.Precision
    num_q_blocks: int = 1  # dK/dV kernel: query blocks per head


def fit_lanes(x, width: int):
    """`[n, 128]` lane-replicated -> `[n, width]` (tile for multiples of 128, slice below)."""
    if width % NUM_LANES == 0:
        return x if width == NUM_LANES else jnp.tile(x, (1, width // NUM_LANES))
    return x[:, :width]


def dot(a, b, dims, precision):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def scores(st: Static, rows, cols):
    """float32 `rows @ cols.T`, scaled and capped; also tanh for the cap's derivative."""
    s = dot(rows, cols, NT_DIMS, st.precision) * st.config.scale
    if st.config.logit_softcap is None:
        return s, None
    t = jnp.tanh(s / st.config.logit_softcap)
    return st.config.logit_softcap * t, t


class MaskRefs:
    """The position and segment-id tiles of one grid step, in both orientations.

    `*_lanes` refs hold a vector broadcast over 128 lanes (`[n, 128]`, one
    value per row); `*_rows` refs hold it broadcast over 8 sublanes
    (`[8, n]`, one value per column). Segment refs are None without segment ids.
    """

    def __init__(self, q_lanes, q_rows, kv_lanes, kv_rows, qs_lanes, qs_rows, ks_lanes, ks_rows):
        self.q_lanes, self.q_rows, self.kv_lanes, self.kv_rows = q_lanes, q_rows, kv_lanes, kv_rows
        self.qs_lanes, self.qs_rows, self.ks_lanes, self.ks_rows = (
            qs_lanes,
            qs_rows,
            ks_lanes,
            ks_rows,
        )

    def _mask(self, st: Static, q_pos, kv_pos, q_seg, kv_seg, q_index, kv_index):
        valid = (q_index < st.length_q) & (kv_index < st.length_kv)  # not padding
        return masks.visible(st.config, q_pos, kv_pos, q_seg, kv_seg, valid=valid)

    def queries_by_keys(self, st: Static, i, j):
        """bool `[bq, bk]`: query row r of block i sees key column c of block j."""
        shape = (st.block_q, st.block_kv)
        seg = self.qs_lanes is not None
        return self._mask(
            st,
            fit_lanes(self.q_lanes[...], st.block_kv),
            self.kv_rows[:1, :],
            fit_lanes(self.qs_lanes[...], st.block_kv) if seg else None,
            self.ks_rows[:1, :] if seg else None,
            i * st.block_q + lax.broadcasted_iota(jnp.int32, shape, 0),
            j * st.block_kv + lax.broadcasted_iota(jnp.int32, shape, 1),
        )

    def keys_by_queries(self, st: Static, i, j):
        """bool `[bk, bq]`: the transpose of `queries_by_keys`, built in this layout."""
        shape = (st.block_kv, st.block_q)
        seg = self.qs_lanes is not None
        return self._mask(
            st,
            self.q_rows[:1, :],
            fit_lanes(self.kv_lanes[...], st.block_q),
            self.qs_rows[:1, :] if seg else None,
            fit_lanes(self.ks_lanes[...], st.block_q) if seg else None,
            i * st.block_q + lax.broadcasted_iota(jnp.int32, shape, 1),
            j * st.block_kv + lax.broadcasted_iota(jnp.int32, shape, 0),
        )


def zero_rows(x, keep):
    """`x [n, D]` with the rows where `keep [n, 1]` is False zeroed (the select in float32,
    which every TPU generation's VPU has; bfloat16 VPU ops need v5 or later)."""
    return jnp.where(keep, x.astype(jnp.float32), 0.0).astype(x.dtype)


def any_along_lanes(mask):
    """bool `[n, 1]`: any True in each row of `mask [n, m]` (a float32 max reduction)."""
    return jnp.max(mask.astype(jnp.float32), axis=1, keepdims=True) > 0


def run_step(state, step):
    """Runs `step(masked)` on a PARTIAL block, `step(False)` unmasked on a FULL one, and
    nothing on a skipped one."""
    pl.when(state == PARTIAL)(lambda: step(True))
    pl.when(state == FULL)(lambda: step(False))


def score_grads(p, dp, delta, mask, tanh):
    """`dS = p * (dP - delta) * cap'(s)` (FlashAttention-2), 0 where `mask` (if any) is False."""
    ds = p * (dp - delta)
    if mask is not None:
        ds = jnp.where(mask, ds, 0.0)
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return ds
