"""Pallas TPU kernel bodies of flash attention: forward, dQ, and dK/dV.

Forward (FlashAttention-2, Dao 2023): one grid step per (batch, head, query
block, key block); the key axis is the innermost, sequential one. A running
row maximum `m`, normaliser `l` (both `[bq, 128]` lane-replicated, as in
JAX's TPU flash attention) and a float32 accumulator live in VMEM scratch;
the last key step writes `out = acc / l` and `lse = m + log l`.

Backward recomputes the probabilities from lse, `p = exp(s - lse)`, with
`delta = rowsum(dO * O) - dlse` precomputed by the wrapper:
`dP = dO V^T`, `dS = p * (dP - delta)` (times `1 - tanh^2` under a softcap),
`dQ = scale * dS K`, `dK = scale * dS^T Q`, `dV = p^T dO`. The dQ kernel walks
key blocks per query block; the dK/dV kernel walks (query head of the group,
query block) per key block and computes the transposed scores `[bk, bq]`
(splash attention's layout), so that lse and delta are read as `[1, bq]` rows.

Masking happens only in PARTIAL blocks (see pallas_tpu_blocks): scores of
invisible pairs become -inf, and rows of V (forward, dQ: also K) or of Q and
dO (dK/dV) that no pair of the tile sees are zeroed, so NaN there never meets
a 0 in a matmul. Padding rows are masked by their index.

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


def _dot(a, b, dims, precision):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32, precision=precision)


def _scores(st: Static, rows, cols):
    """float32 `rows @ cols.T`, scaled and capped; also tanh for the cap's derivative."""
    s = _dot(rows, cols, NT_DIMS, st.precision) * st.config.scale
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


def _zero_rows(x, keep):
    """`x [n, D]` with the rows where `keep [n, 1]` is False zeroed (the select in float32,
    which every TPU generation's VPU has; bfloat16 VPU ops need v5 or later)."""
    return jnp.where(keep, x.astype(jnp.float32), 0.0).astype(x.dtype)


def _any_along_lanes(mask):
    """bool `[n, 1]`: any True in each row of `mask [n, m]` (a float32 max reduction)."""
    return jnp.max(mask.astype(jnp.float32), axis=1, keepdims=True) > 0


def _run_step(state, step):
    """Runs `step(masked)` on a PARTIAL block, `step(False)` unmasked on a FULL one, and
    nothing on a skipped one."""
    pl.when(state == PARTIAL)(lambda: step(True))
    pl.when(state == FULL)(lambda: step(False))


def _score_grads(p, dp, delta, mask, tanh):
    """`dS = p * (dP - delta) * cap'(s)` (FlashAttention-2), 0 where `mask` (if any) is False."""
    ds = p * (dp - delta)
    if mask is not None:
        ds = jnp.where(mask, ds, 0.0)
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return ds


def forward_kernel(
    states_ref,  # SMEM int32 [B, nq, nk]
    fetch_ref,  # SMEM int32 [B, nq, nk]
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    *refs,  # 8 mask refs, out [bq, D], lse [bq, 128], scratch m, l [bq, 128], acc [bq, D]
    st: Static,
):
    """One (batch, head, query block i, key block j) step of the online softmax."""
    del fetch_ref  # only the index maps read it
    masks = MaskRefs(*refs[:8])
    out_ref, lse_ref, m_ref, l_ref, acc_ref = refs[8:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    head_dim = acc_ref.shape[-1]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        v = v_ref[...]
        s, _ = _scores(st, q_ref[...], k_ref[...])  # [bq, bk]
        if masked:
            s = jnp.where(masks.queries_by_keys(st, i, j), s, -jnp.inf)
            v = _zero_rows(v, _any_along_lanes(masks.keys_by_queries(st, i, j)))
        m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
        p = jnp.exp(s - fit_lanes(m_safe, st.block_kv))
        alpha = jnp.exp(m_prev - m_safe)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = _dot(p.astype(v.dtype), v, NN_DIMS, st.precision)  # [bq, D]
        acc_ref[...] = acc_ref[...] * fit_lanes(alpha, head_dim) + pv

    _run_step(states_ref[b, i, j], step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        denom = l_ref[...]
        has_key = denom > 0
        safe = jnp.where(has_key, denom, 1.0)
        out_ref[...] = (acc_ref[...] / fit_lanes(safe, head_dim)).astype(out_ref.dtype)
        lse_ref[...] = jnp.where(has_key, m_ref[...] + jnp.log(safe), -jnp.inf)


def dq_kernel(
    states_ref,  # SMEM int32 [B, nq, nk]
    fetch_ref,  # SMEM int32 [B, nq, nk]
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [bq, D]
    lse_ref,  # [1, bq], -inf replaced by 0
    delta_ref,  # [1, bq]
    *refs,  # 8 mask refs, dq [bq, D], scratch dq_acc [bq, D]
    st: Static,
):
    """One (batch, head, query block i, key block j) step of dQ = scale * dS K."""
    del fetch_ref
    masks = MaskRefs(*refs[:8])
    dq_ref, acc_ref = refs[8:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        k, v = k_ref[...], v_ref[...]
        s, tanh = _scores(st, q_ref[...], k)  # [bq, bk]
        mask = None
        if masked:
            mask = masks.queries_by_keys(st, i, j)
            s = jnp.where(mask, s, -jnp.inf)
            key_visible = _any_along_lanes(masks.keys_by_queries(st, i, j))  # [bk, 1]
            k, v = _zero_rows(k, key_visible), _zero_rows(v, key_visible)
        p = jnp.exp(s - jnp.expand_dims(lse_ref[0], -1))
        dp = _dot(do_ref[...], v, NT_DIMS, st.precision)  # [bq, bk]
        ds = _score_grads(p, dp, jnp.expand_dims(delta_ref[0], -1), mask, tanh)
        acc_ref[...] += _dot(ds.astype(k.dtype), k, NN_DIMS, st.precision)

    _run_step(states_ref[b, i, j], step)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * st.config.scale).astype(dq_ref.dtype)


def dkv_kernel(
    states_ref,  # SMEM int32 [B, nk, nq] (transposed table)
    fetch_ref,  # SMEM int32 [B, nk, nq]
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [bq, D]
    lse_ref,  # [8, bq], -inf replaced by 0
    delta_ref,  # [8, bq]
    *refs,  # 8 mask refs, dk, dv [bk, D], scratch dk_acc, dv_acc [bk, D]
    st: Static,
):
    """One (batch, kv head, key block j, (group head g, query block i)) step of dK, dV."""
    del fetch_ref
    masks = MaskRefs(*refs[:8])
    dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs[8:]
    b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    i = lax.rem(t, st.num_q_blocks)  # `%` would lower through sign

    @pl.when(t == 0)
    def _init():
        dk_acc_ref[...] = jnp.zeros(dk_acc_ref.shape, jnp.float32)
        dv_acc_ref[...] = jnp.zeros(dv_acc_ref.shape, jnp.float32)

    def step(masked: bool):
        q, do = q_ref[...], do_ref[...]
        s, tanh = _scores(st, k_ref[...], q)  # [bk, bq]
        mask = None
        if masked:
            mask = masks.keys_by_queries(st, i, j)
            s = jnp.where(mask, s, -jnp.inf)
            query_visible = _any_along_lanes(masks.queries_by_keys(st, i, j))  # [bq, 1]
            q, do = _zero_rows(q, query_visible), _zero_rows(do, query_visible)
        p = jnp.exp(s - lse_ref[:1, :])  # [bk, bq]
        dv_acc_ref[...] += _dot(p.astype(do.dtype), do, NN_DIMS, st.precision)
        dp = _dot(v_ref[...], do, NT_DIMS, st.precision)  # [bk, bq]
        ds = _score_grads(p, dp, delta_ref[:1, :], mask, tanh)
        dk_acc_ref[...] += _dot(ds.astype(q.dtype), q, NN_DIMS, st.precision)

    _run_step(states_ref[b, j, i], step)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * st.config.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)
