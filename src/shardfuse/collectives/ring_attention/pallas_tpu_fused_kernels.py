"""Fused ring attention kernels for TPU: K/V (and dK/dV) move by remote DMA inside the kernel.

One Pallas TPU kernel per direction runs the whole ring (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"; the remote-DMA ring of the
Pallas TPU distributed guide, https://docs.jax.dev/en/latest/pallas/tpu/distributed.html):

- forward: in step s each device starts `pltpu.make_async_remote_copy` of
  the K/V block it holds (its own in step 0, else the one received in step
  s - 1) into its right neighbour's receive buffer, and meanwhile runs the
  flash-attention block of its queries against that K/V block (online
  softmax; running max, normaliser and float32 accumulator in VMEM for the
  whole shard). After N steps it writes `out = acc / l` and `lse = m + log l`.
- backward: the same K/V ring; each step adds the block's dQ share to a local
  float32 dQ and computes the block's dK/dV share, which is added to the
  float32 dK/dV accumulator of that K/V block arriving from the left
  neighbour (it travels one step behind its K/V) and sent on; after N steps
  every accumulator is home. p is recomputed from the global lse
  (FlashAttention-2 backward), so no block forward runs.

Each K/V block travels with its keys' positions and segment ids (lane- and
sublane-broadcast int32 copies, as the attention kernels mask with), so every
layout (contiguous, zigzag, striped) and every mask works without a table of
the whole sequence. A per-step table of (query block, key block) states
(SKIP / PARTIAL / FULL, `kernels/attention/pallas_tpu_blocks.py`) skips the
compute of blocks no query can see: under a causal mask the invisible steps
of a ring only pass K/V on (causal step skipping).

Double buffering and handshake are those of the fused collective matmuls
(`collectives/collective_matmul/pallas_tpu_kernels.py`, whose DMA, neighbour
and barrier helpers these kernels call): receive buffers alternate between
two slots, and before the DMA of step s >= 2 the sender waits for a credit
(a REGULAR semaphore) that the receiver signals once it has finished reading
that slot. `handshake=False` drops the credits: the planted race the race
detector must catch.

The block math is that of the Pallas TPU flash attention
(its tile helpers, `kernels/attention/pallas_tpu_tiles.py`: scores, masks, the dS
rule, PARTIAL/FULL dispatch), applied to VMEM slices of the resident operands.

Axis glossary: B batch, T / S local query / key length, H query heads, K kv
heads, G = H // K, D head dim, N ring size; BH = B H and BK = B K flattened;
bq / bk block rows, nq / nk blocks per shard; R = 1 (+ B with segment ids)
rows of travelling int32 metadata (positions, then each batch row's segment ids).
"""

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.collectives.collective_matmul.pallas_tpu_kernels import (
    barrier_with_neighbours,
    neighbour,
    send_to_neighbour,
)
from shardfuse.kernels.attention import pallas_tpu_tiles as tiles

TN_DIMS = (((0,), (0,)), ((), ()))  # a.T @ b


@dataclasses.dataclass(frozen=True)
class FusedStatic:
    """Static facts of one fused ring kernel (hashable, bound with functools.partial).

    Attributes:
      block: the attention kernels' `Static` (config, local lengths T and S,
        block sizes, matmul precision).
      ring_size: N.
      num_axes: mesh axes (remote DMAs address devices by mesh coordinates).
      batch: B; num_heads: H; group: G = H // K.
      segments: whether segment ids are masked (metadata rows 1 .. B).
      handshake: the credit handshake (False only for the planted-race test).
    """

    block: tiles.Static
    ring_size: int
    num_axes: int
    batch: int
    num_heads: int
    group: int
    segments: bool
    handshake: bool

    @property
    def num_q_blocks(self) -> int:
        return self.block.length_q // self.block.block_q

    @property
    def num_kv_blocks(self) -> int:
        return self.block.length_kv // self.block.block_kv


@dataclasses.dataclass(frozen=True)
class _Travel:
    """One array that rotates around the ring: the local copy, a `[2, ...]` receive buffer,
    DMA send and receive semaphores `[2]` (one per slot)."""

    local: object
    buffer: object
    send_sem: object
    recv_sem: object


def _signal_upstream(table_ref, credit, st: FusedStatic):
    upstream = neighbour(table_ref, -1, st.num_axes)
    pl.semaphore_signal(credit, 1, device_id=upstream)


def _when(condition, body):
    """`body()` under `condition`: a Python bool decides now, a traced one in the kernel."""
    if isinstance(condition, bool):
        if condition:
            body()
    else:
        pl.when(condition)(body)


def _copy(src, dst, send_sem, recv_sem, slot, table_ref, st: FusedStatic):
    """The descriptor of the DMA of `src` into the right neighbour's `dst[slot]`; waiting on
    it waits for this device's own send, or for the same-shaped arrival in its `dst[slot]`."""
    return pltpu.make_async_remote_copy(
        src, dst.at[slot], send_sem.at[slot], recv_sem.at[slot],
        device_id=neighbour(table_ref, +1, st.num_axes),
    )  # fmt: skip


def _kv_ring(table_ref, travels, credit, consume, st: FusedStatic):
    """The K/V ring (the collective matmuls' gather ring, steps in a loop).

    In step s every travelling array held (its local copy in step 0, else the
    one received in step s - 1, in slot (s - 1) % 2) is forwarded to the right
    neighbour's slot s % 2 (after a credit, from step 2 on) while
    `consume(s, *held_refs)` computes; then this device waits for its sends
    and hands slot (s - 1) % 2 back upstream. Step 0 is unrolled (it reads the
    local arrays); steps 1 .. N-1 run in a `lax.fori_loop` with the slot and
    every condition traced, so the kernel's size does not grow with the ring.
    """
    n = st.ring_size
    barrier_with_neighbours(table_ref, st.num_axes)

    def step(s, held, slot_in):
        slot_out = lax.rem(s, 2) if slot_in is not None else 0
        if slot_in is not None:
            for t in travels:  # this step's arrays have arrived
                _copy(
                    t.buffer.at[slot_in], t.buffer, t.send_sem, t.recv_sem, slot_in, table_ref, st
                ).wait_recv()

        def send():
            _when(st.handshake and (s >= 2), lambda: pl.semaphore_wait(credit, 1))
            for src, t in zip(held, travels, strict=True):
                send_to_neighbour(
                    src, t.buffer, t.send_sem, t.recv_sem, slot=slot_out, table_ref=table_ref,
                    direction=+1, num_axes=st.num_axes,
                )  # fmt: skip

        def wait_sends():
            for src, t in zip(held, travels, strict=True):
                _copy(src, t.buffer, t.send_sem, t.recv_sem, slot_out, table_ref, st).wait_send()

        forwards = s <= n - 2
        _when(forwards, send)
        consume(s, *held)
        _when(forwards, wait_sends)
        if st.handshake:  # slot (s - 1) % 2 is free again
            _when((s >= 1) & (s <= n - 3), lambda: _signal_upstream(table_ref, credit, st))

    with jax.named_scope("ring_attention_step_0"):
        step(0, [t.local for t in travels], None)
    if n == 1:
        return

    def loop_step(s, carry):
        slot_in = lax.rem(s + 1, 2)  # (s - 1) % 2
        step(s, [t.buffer.at[slot_in] for t in travels], slot_in)
        return carry

    with jax.named_scope("ring_attention_steps"):
        lax.fori_loop(1, n, loop_step, 0)


def _for_each_block(st: FusedStatic, states_ref, step: int, body):
    """`body(bh, kv_head, b, i, j, masked)` on every computed (head, query block i, key
    block j) of ring step `step`: PARTIAL blocks masked, FULL ones not, SKIP ones not at all."""
    nq, nk = st.num_q_blocks, st.num_kv_blocks

    def per_head(bh, carry):
        kv_head = lax.div(bh, st.group)  # (b H + h) // G = b K + h // G
        b = lax.div(bh, st.num_heads)

        def per_query_block(i, carry):
            def per_key_block(j, carry):
                state = states_ref[(step * nq + i) * nk + j]
                tiles.run_step(state, lambda masked: body(bh, kv_head, b, i, j, masked))
                return carry

            return lax.fori_loop(0, nk, per_key_block, carry)

        return lax.fori_loop(0, nq, per_query_block, carry)

    lax.fori_loop(0, st.batch * st.num_heads, per_head, 0)


def _mask_refs(st: FusedStatic, q_lanes, q_rows, kv_lanes, kv_rows, b, i, j):
    """The attention kernels' `MaskRefs` on the (query block i, key block j) slices of the
    metadata (row 0 positions, row 1 + b batch row b's segment ids)."""
    bq, bk = st.block.block_q, st.block.block_kv
    qs, ks = pl.ds(i * bq, bq), pl.ds(j * bk, bk)
    refs = [q_lanes.at[0, qs], q_rows.at[0, :, qs], kv_lanes.at[0, ks], kv_rows.at[0, :, ks]]
    if st.segments:
        seg = 1 + b
        refs += [q_lanes.at[seg, qs], q_rows.at[seg, :, qs], kv_lanes.at[seg, ks]]
        refs += [kv_rows.at[seg, :, ks]]
    else:
        refs += [None] * 4
    return tiles.MaskRefs(*refs)


def _block_inputs(st: FusedStatic, q_ref, kv_ref, bh, kv_head, i, j):
    """`(query rows, key rows, q [bq, D], k [bk, D], v [bk, D])` of one block."""
    bq, bk = st.block.block_q, st.block.block_kv
    rows_q = pl.ds(pl.multiple_of(i * bq, bq), bq)
    rows_k = pl.ds(pl.multiple_of(j * bk, bk), bk)
    q = q_ref[bh, rows_q, :]
    k = kv_ref[0, kv_head, rows_k, :]
    v = kv_ref[1, kv_head, rows_k, :]
    return rows_q, rows_k, q, k, v


def forward_kernel(
    table_ref,  # SMEM int32 [2 A + N]: ring neighbours (collective_matmul ring_table)
    states_ref,  # SMEM int32 [N nq nk]: block states per ring step
    q_ref,  # [BH, T, D]
    q_lanes_ref,  # int32 [R, T, 128]
    q_rows_ref,  # int32 [R, 8, T]
    kv_ref,  # [2, BK, S, D]: this device's K and V
    kv_lanes_ref,  # int32 [R, S, 128]: their positions (and segment ids)
    kv_rows_ref,  # int32 [R, 8, S]
    out_ref,  # [BH, T, D]
    lse_ref,  # float32 [BH, T, 128]
    *scratch,  # 3 receive buffers, 6 DMA semaphores, credit, m, l [BH, T, 128], acc [BH, T, D]
    st: FusedStatic,
):
    """The forward ring: online softmax over the N K/V blocks as they arrive."""
    kv_buf, lanes_buf, rows_buf, *sems, credit, m_ref, l_ref, acc_ref = scratch
    travels = [
        _Travel(kv_ref, kv_buf, sems[0], sems[1]),
        _Travel(kv_lanes_ref, lanes_buf, sems[2], sems[3]),
        _Travel(kv_rows_ref, rows_buf, sems[4], sems[5]),
    ]
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    bk, head_dim, precision = st.block.block_kv, q_ref.shape[-1], st.block.precision

    def consume(step, kv, kv_lanes, kv_rows):
        def block(bh, kv_head, b, i, j, masked):
            rows_q, _, q, k, v = _block_inputs(st, q_ref, kv, bh, kv_head, i, j)
            s, _ = tiles.scores(st.block, q, k)  # [bq, bk]
            if masked:
                masks = _mask_refs(st, q_lanes_ref, q_rows_ref, kv_lanes, kv_rows, b, i, j)
                s = jnp.where(masks.queries_by_keys(st.block, i, j), s, -jnp.inf)
                keys_seen = tiles.any_along_lanes(masks.keys_by_queries(st.block, i, j))
                v = tiles.zero_rows(v, keys_seen)
            m_prev, l_prev = m_ref[bh, rows_q, :], l_ref[bh, rows_q, :]  # [bq, 128]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows with nothing visible yet
            p = jnp.exp(s - tiles.fit_lanes(m_safe, bk))
            alpha = jnp.exp(m_prev - m_safe)
            m_ref[bh, rows_q, :] = m_next
            l_ref[bh, rows_q, :] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = tiles.dot(p.astype(v.dtype), v, tiles.NN_DIMS, precision)  # [bq, D]
            acc = acc_ref[bh, rows_q, :]
            acc_ref[bh, rows_q, :] = acc * tiles.fit_lanes(alpha, head_dim) + pv

        _for_each_block(st, states_ref, step, block)

    _kv_ring(table_ref, travels, credit, consume, st)

    def finish(bh, carry):
        denom = l_ref[bh]
        has_key = denom > 0
        safe = jnp.where(has_key, denom, 1.0)
        out = acc_ref[bh] / tiles.fit_lanes(safe, head_dim)
        out_ref[bh] = out.astype(out_ref.dtype)
        lse_ref[bh] = jnp.where(has_key, m_ref[bh] + jnp.log(safe), -jnp.inf)
        return carry

    lax.fori_loop(0, st.batch * st.num_heads, finish, 0)


def backward_kernel(
    table_ref,  # SMEM int32 [2 A + N]
    states_ref,  # SMEM int32 [N nq nk]
    q_ref,  # [BH, T, D]
    do_ref,  # [BH, T, D]: d_out in q's dtype
    lse_ref,  # float32 [BH, T, 128]: the global lse, -inf replaced by 0
    delta_ref,  # float32 [BH, T, 128]: rowsum(d_out * out) - d_lse
    q_lanes_ref,  # int32 [R, T, 128]
    q_rows_ref,  # int32 [R, 8, T]
    kv_ref,  # [2, BK, S, D]
    kv_lanes_ref,  # int32 [R, S, 128]
    kv_rows_ref,  # int32 [R, 8, S]
    dq_ref,  # float32 [BH, T, D]
    dkv_ref,  # float32 [2, BK, S, D]: this device's dK, dV
    *scratch,  # the K/V ring's (3 buffers, 6 DMA semaphores, credit), then the dK/dV ring's
    st: FusedStatic,
):
    """The backward ring: dQ locally, dK/dV accumulators travelling one step behind K/V.

    dK/dV scratch: `share` float32 `[2, BK, S, D]` (this step's block share),
    send and receive buffers `[2 slots, 2, BK, S, D]`, DMA send and receive
    semaphores `[2]`, a credit. In step s the accumulator of the K/V block
    held now arrives from the left neighbour (sent in its step s - 1), gets
    this step's share added, and goes on to the right neighbour (slot s % 2):
    the matmul-reduce-scatter ring's pattern. The N-th arrival, after the last
    step, is this device's own dK/dV, home.
    """
    kv_buf, lanes_buf, rows_buf, *sems, credit = scratch[:10]
    share, send_buf, recv_buf, dkv_send_sem, dkv_recv_sem, dkv_credit = scratch[10:]
    travels = [
        _Travel(kv_ref, kv_buf, sems[0], sems[1]),
        _Travel(kv_lanes_ref, lanes_buf, sems[2], sems[3]),
        _Travel(kv_rows_ref, rows_buf, sems[4], sems[5]),
    ]
    n, bk, precision = st.ring_size, st.block.block_kv, st.block.precision
    scale = st.block.config.scale
    dq_ref[...] = jnp.zeros(dq_ref.shape, jnp.float32)

    def block(kv, kv_lanes, kv_rows, bh, kv_head, b, i, j, masked):
        rows_q, rows_k, q, k, v = _block_inputs(st, q_ref, kv, bh, kv_head, i, j)
        do = do_ref[bh, rows_q, :]
        s, tanh = tiles.scores(st.block, q, k)  # [bq, bk]
        mask = None
        if masked:
            masks = _mask_refs(st, q_lanes_ref, q_rows_ref, kv_lanes, kv_rows, b, i, j)
            mask = masks.queries_by_keys(st.block, i, j)
            s = jnp.where(mask, s, -jnp.inf)
            keys_seen = tiles.any_along_lanes(masks.keys_by_queries(st.block, i, j))
            queries_seeing = tiles.any_along_lanes(mask)
            k, v = tiles.zero_rows(k, keys_seen), tiles.zero_rows(v, keys_seen)
            q = tiles.zero_rows(q, queries_seeing)
            do = tiles.zero_rows(do, queries_seeing)
        p = jnp.exp(s - tiles.fit_lanes(lse_ref[bh, rows_q, :], bk))
        dp = tiles.dot(do, v, tiles.NT_DIMS, precision)  # [bq, bk]
        delta = tiles.fit_lanes(delta_ref[bh, rows_q, :], bk)
        ds = tiles.score_grads(p, dp, delta, mask, tanh)
        dq = tiles.dot(ds.astype(k.dtype), k, tiles.NN_DIMS, precision)
        dq_ref[bh, rows_q, :] += dq
        share[1, kv_head, rows_k, :] += tiles.dot(p.astype(do.dtype), do, TN_DIMS, precision)
        share[0, kv_head, rows_k, :] += tiles.dot(ds.astype(q.dtype), q, TN_DIMS, precision)

    def dkv_copy(src, slot):
        return _copy(src, recv_buf, dkv_send_sem, dkv_recv_sem, slot, table_ref, st)

    def consume(step, kv, kv_lanes, kv_rows):
        share[...] = jnp.zeros(share.shape, jnp.float32)
        _for_each_block(st, states_ref, step, lambda *idx: block(kv, kv_lanes, kv_rows, *idx))
        if n == 1:
            return
        with jax.named_scope("ring_attention_send_dkv"):
            first = isinstance(step, int)  # step 0, unrolled: nothing received yet
            slot_out = 0 if first else lax.rem(step, 2)
            if first:
                send_buf[0] = share[...]
            else:
                slot_in = lax.rem(step + 1, 2)  # (step - 1) % 2
                dkv_copy(recv_buf.at[slot_in], slot_in).wait_recv()  # this block's accumulator
                # Send slot step % 2 was last sent from in step - 2, waited for in step - 1.
                send_buf[slot_out] = share[...] + recv_buf[slot_in]
                if st.handshake:  # receive slot (step - 1) % 2 is free again
                    _when(step <= n - 2, lambda: _signal_upstream(table_ref, dkv_credit, st))
            # Downstream added its slot step % 2 (received in its step - 1).
            _when(st.handshake and step >= 2, lambda: pl.semaphore_wait(dkv_credit, 1))
            send_to_neighbour(
                send_buf.at[slot_out], recv_buf, dkv_send_sem, dkv_recv_sem, slot=slot_out,
                table_ref=table_ref, direction=+1, num_axes=st.num_axes,
            )  # fmt: skip
            if not first:
                dkv_copy(send_buf.at[slot_in], slot_in).wait_send()  # the previous step's send

    _kv_ring(table_ref, travels, credit, consume, st)
    if n == 1:
        home = share[...]
    else:
        last = (n - 1) % 2
        dkv_copy(recv_buf.at[last], last).wait_recv()  # this device's own dK/dV, after N hops
        home = recv_buf[last]
        dkv_copy(send_buf.at[last], last).wait_send()
    dkv_ref[0] = home[0] * scale
    dkv_ref[1] = home[1]
    dq_ref[...] = dq_ref[...] * scale
