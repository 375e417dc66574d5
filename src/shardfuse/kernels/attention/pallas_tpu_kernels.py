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

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from shardfuse.kernels.attention.pallas_tpu_tiles import (
    NN_DIMS,
    NT_DIMS,
    MaskRefs,
    Static,
    any_along_lanes,
    dot,
    fit_lanes,
    run_step,
    score_grads,
    scores,
    zero_rows,
)


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
        s, _ = scores(st, q_ref[...], k_ref[...])  # [bq, bk]
        if masked:
            s = jnp.where(masks.queries_by_keys(st, i, j), s, -jnp.inf)
            v = zero_rows(v, any_along_lanes(masks.keys_by_queries(st, i, j)))
        m_prev, l_prev = m_ref[...], l_ref[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
        p = jnp.exp(s - fit_lanes(m_safe, st.block_kv))
        alpha = jnp.exp(m_prev - m_safe)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = dot(p.astype(v.dtype), v, NN_DIMS, st.precision)  # [bq, D]
        acc_ref[...] = acc_ref[...] * fit_lanes(alpha, head_dim) + pv

    run_step(states_ref[b, i, j], step)

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
        s, tanh = scores(st, q_ref[...], k)  # [bq, bk]
        mask = None
        if masked:
            mask = masks.queries_by_keys(st, i, j)
            s = jnp.where(mask, s, -jnp.inf)
            key_visible = any_along_lanes(masks.keys_by_queries(st, i, j))  # [bk, 1]
            k, v = zero_rows(k, key_visible), zero_rows(v, key_visible)
        p = jnp.exp(s - jnp.expand_dims(lse_ref[0], -1))
        dp = dot(do_ref[...], v, NT_DIMS, st.precision)  # [bq, bk]
        ds = score_grads(p, dp, jnp.expand_dims(delta_ref[0], -1), mask, tanh)
        acc_ref[...] += dot(ds.astype(k.dtype), k, NN_DIMS, st.precision)

    run_step(states_ref[b, i, j], step)

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
        s, tanh = scores(st, k_ref[...], q)  # [bk, bq]
        mask = None
        if masked:
            mask = masks.keys_by_queries(st, i, j)
            s = jnp.where(mask, s, -jnp.inf)
            query_visible = any_along_lanes(masks.queries_by_keys(st, i, j))  # [bq, 1]
            q, do = zero_rows(q, query_visible), zero_rows(do, query_visible)
        p = jnp.exp(s - lse_ref[:1, :])  # [bk, bq]
        dv_acc_ref[...] += dot(p.astype(do.dtype), do, NN_DIMS, st.precision)
        dp = dot(v_ref[...], do, NT_DIMS, st.precision)  # [bk, bq]
        ds = score_grads(p, dp, delta_ref[:1, :], mask, tanh)
        dk_acc_ref[...] += dot(ds.astype(q.dtype), q, NN_DIMS, st.precision)

    run_step(states_ref[b, j, i], step)

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc_ref[...] * st.config.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)
