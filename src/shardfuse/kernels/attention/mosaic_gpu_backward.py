"""The Pallas Mosaic GPU flash-attention backward kernels for Hopper (sm_90+).

FlashAttention-2's backward (Dao 2023) in two deterministic kernels, each
with the forward's warp specialization (one producer warpgroup streaming
tiles into a ring of shared-memory slots with TMA; two consumer warpgroups on
the tensor cores):

- dK/dV: one CTA per (kv head, key tile of `2 * block_kv` rows, batch); each
  consumer keeps its K and V rows in shared memory and walks, for every query
  head of its group (GQA without repeating K/V), the query blocks the block
  table lists, streamed with their dO, lse and delta:

      S^T = K Q^T,  P^T = exp2(S^T * c - lse2),  dV += P^T dO,
      dP^T = V dO^T,  dS^T = P^T (dP^T - delta),  dK += dS^T Q

  (`c` the scale in base-2 units, times `1 - tanh^2` under a softcap);
- dQ: one CTA per (query head, query tile, batch); each consumer keeps its Q
  and dO rows and walks the key blocks: `S = Q K^T`, `dP = dO V^T`,
  `dS = P (dP - delta)`, `dQ += dS K`.

Every partial sum is owned by one consumer, so results are bitwise
reproducible (no atomics). `lse2` is the forward's lse in base 2 with -inf
(rows that saw nothing) read as 0; `delta = rowsum(dO * O) - dlse`
(`protocol.backward_row_stats`). The dK/dV kernel can compute either half
alone (`compute=("dk",)` / `("dv",)`): at head dim 256 the two float32
accumulators do not fit a consumer's registers together.

Axis glossary: B batch, T query length, S key length, H query heads, K kv
heads, G = H // K, D head dim, bq query rows, bk key rows per consumer tile.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from shardfuse.kernels.attention import mosaic_gpu_tiles as tiles

CONSUMERS = 2


def _dkdv_kernel(
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_pos_ref, kv_pos_ref, q_seg_ref,
    kv_seg_ref, ranges_ref,
    *refs,
    config, block_q, block_kv, stages, group, length_kv, segments, compute, consumers,
    interpret,
):  # fmt: skip
    outs, refs = refs[: len(compute)], refs[len(compute) :]
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_ready, ready, free = refs
    kv_head = lax.axis_index("kv_heads")
    tile = lax.axis_index("kv_tiles")
    batch, wg, bounds = tiles.cta(ranges_ref, tile)
    lo, _, _, hi = bounds
    blocks = hi - lo  # query blocks per head; the walk is group * blocks steps
    D = k_smem.shape[-1]
    dtype = k_smem.dtype

    @tiles.consumer(wg, consumers)
    def consumer():
        kv_start = tile * (consumers * block_kv) + wg * block_kv
        rows = (batch, pl.ds(kv_start, block_kv), kv_head)
        k_tile, v_tile = k_smem.at[wg], v_smem.at[wg]
        plgpu.copy_gmem_to_smem(k_ref.at[rows], k_tile, kv_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[rows], v_tile, kv_ready.at[wg])
        mask_refs = tiles.mask_refs(
            q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref,
            segments=segments, length_kv=length_kv, interpret=interpret,
        )  # fmt: skip
        zeros = tiles.in_layout(
            jnp.zeros((block_kv, D), jnp.float32), tiles.WGMMA, interpret=interpret
        )
        plgpu.barrier_wait(kv_ready.at[wg])
        shape = (block_kv, block_q)  # S^T: keys by queries

        def step(s, grads, *, masked):
            dk, dv = grads
            slot = lax.rem(s, stages)
            i = lo + lax.rem(s, blocks)  # query block; the head is s // blocks of the group
            plgpu.barrier_wait(ready.at[slot])
            q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
            scores = tiles.mma(k_tile, q_tile.transpose((1, 0)), shape, interpret=interpret)
            x, c, tanh = tiles.logits_log2(config, scores)
            lse = tiles.vector(lse_smem.at[slot], 0, block_q, tiles.COL, interpret=interpret)
            p = jnp.exp2(x * c - lax.broadcast_in_dim(lse, shape, [1]))
            if masked:
                visible = tiles.tile_mask(
                    config, mask_refs, batch, i * block_q, kv_start, shape, transposed=True
                )
                p = jnp.where(visible, p, 0.0)
            if "dv" in compute:
                dv = tiles.mma(p.astype(dtype), do_tile, dv.shape, acc=dv, interpret=interpret)
            if "dk" in compute:
                dp = tiles.mma(v_tile, do_tile.transpose((1, 0)), shape, interpret=interpret)
                delta = tiles.vector(
                    delta_smem.at[slot], 0, block_q, tiles.COL, interpret=interpret
                )
                ds = p * (dp - lax.broadcast_in_dim(delta, shape, [1]))
                if tanh is not None:
                    ds = ds * (1.0 - tanh * tanh)
                dk = tiles.mma(ds.astype(dtype), q_tile, dk.shape, acc=dk, interpret=interpret)
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        # The walk: for each head of the group, the masked head of the range, the full run,
        # the masked tail (block indices relative to lo, steps counted over the heads).
        def head_walk(g, grads):
            return tiles.walk(step, bounds, grads, offset=g * blocks - lo)

        dk, dv = lax.fori_loop(0, group, head_walk, (zeros, zeros))
        grads = {"dk": dk * config.scale, "dv": dv}
        # K and V are read for the last time: their slots stage the results.
        for out_ref, name, stage in zip(outs, compute, (k_tile, v_tile), strict=False):
            stage = stage if out_ref.dtype == dtype else None
            tiles.store(grads[name], out_ref.at[rows], stage, interpret=interpret)
        plgpu.wait_smem_to_gmem(0)

    @tiles.producer(wg, consumers)
    def producer():

        def load(s, slot, reuse):
            tiles.wait_when(reuse, free.at[slot])
            head = kv_head * group + lax.div(s, blocks)
            i = lo + lax.rem(s, blocks)
            rows = (batch, pl.ds(i * block_q, block_q), head)
            stats = (batch, head, pl.ds(i * block_q, block_q))
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(d_out_ref.at[rows], do_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[stats], lse_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[stats], delta_smem.at[slot], ready.at[slot])

        tiles.stream(load, group * blocks, stages, (free,))


def _dq_kernel(
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_pos_ref, kv_pos_ref, q_seg_ref,
    kv_seg_ref, ranges_ref,
    dq_ref,
    q_smem, do_smem, k_smem, v_smem, q_ready, k_ready, v_ready, free,
    *, config, block_q, block_kv, stages, group, length_kv, segments, consumers, interpret,
):  # fmt: skip
    head, kv_head, tile, batch, wg, bounds = tiles.query_cta(ranges_ref, config, group)
    lo, _, _, hi = bounds
    D = q_smem.shape[-1]
    dtype = q_smem.dtype

    @tiles.consumer(wg, consumers)
    def consumer():
        q_start = tile * (consumers * block_q) + wg * block_q
        rows = (batch, pl.ds(q_start, block_q), head)
        q_tile, do_tile = q_smem.at[wg], do_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_tile, q_ready.at[wg])
        plgpu.copy_gmem_to_smem(d_out_ref.at[rows], do_tile, q_ready.at[wg])
        stats = (batch, head)
        lse = tiles.vector(lse_ref.at[stats], q_start, block_q, tiles.ROW, interpret=interpret)
        delta = tiles.vector(delta_ref.at[stats], q_start, block_q, tiles.ROW, interpret=interpret)
        mask_refs = tiles.mask_refs(
            q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref,
            segments=segments, length_kv=length_kv, interpret=interpret,
        )  # fmt: skip
        dq = tiles.in_layout(jnp.zeros((block_q, D), jnp.float32), tiles.WGMMA, interpret=interpret)
        plgpu.barrier_wait(q_ready.at[wg])
        shape = (block_q, block_kv)

        def step(j, dq, *, masked):
            slot = lax.rem(j - lo, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
            scores = tiles.mma(q_tile, k_tile.transpose((1, 0)), shape, interpret=interpret)
            x, c, tanh = tiles.logits_log2(config, scores)
            p = jnp.exp2(x * c - lax.broadcast_in_dim(lse, shape, [0]))
            if masked:
                visible = tiles.tile_mask(config, mask_refs, batch, q_start, j * block_kv, shape)
                p = jnp.where(visible, p, 0.0)
            plgpu.barrier_wait(v_ready.at[slot])
            dp = tiles.mma(do_tile, v_tile.transpose((1, 0)), shape, interpret=interpret)
            ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            dq = tiles.mma(ds.astype(dtype), k_tile, dq.shape, acc=dq, interpret=interpret)
            plgpu.barrier_arrive(free.at[slot])
            return dq

        dq = tiles.walk(step, bounds, dq)
        stage = q_tile if dq_ref.dtype == dtype else None
        tiles.store(dq * config.scale, dq_ref.at[rows], stage, interpret=interpret)
        plgpu.wait_smem_to_gmem(0)

    @tiles.producer(wg, consumers)
    def producer():

        def load(s, slot, reuse):
            tiles.wait_when(reuse, free.at[slot])
            rows = (batch, pl.ds((lo + s) * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        tiles.stream(load, hi - lo, stages, (free,))


def dkdv(
    q, k, v, d_out, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, ranges,
    *, config, block_q, block_kv, stages, length_kv, grad_dtype, compute=("dk", "dv"),
    consumers=CONSUMERS, interpret=None,
):  # fmt: skip
    """`dk, dv [B, S, K, D]` in `grad_dtype` (those of `compute`) on padded inputs.

    `ranges [B, S // (2 * block_kv), 4]` lists the query blocks of each key tile
    (`masks.visit_ranges` of the transposed block table); `lse2`, `delta`
    float32 `[B, H, T]` (lse in base 2, -inf read as 0).
    """
    B, T, H, D = q.shape
    K = k.shape[2]
    kernel, q_seg, kv_seg = tiles.bind(
        _dkdv_kernel, q, k, q_seg, kv_seg, interpret=interpret, config=config, block_q=block_q,
        block_kv=block_kv, stages=stages, length_kv=length_kv, compute=tuple(compute),
        consumers=consumers,
    )  # fmt: skip
    scratch = (
        tiles.swizzled((consumers, block_kv, D), k.dtype),
        tiles.swizzled((consumers, block_kv, D), v.dtype),
        tiles.swizzled((stages, block_q, D), q.dtype),
        tiles.swizzled((stages, block_q, D), d_out.dtype),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=consumers),  # K and V rows
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # q, dO, lse, delta
        plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # slot free
    )
    out_type = tuple(jax.ShapeDtypeStruct(k.shape, grad_dtype) for _ in compute)
    grid = (K, ranges.shape[1], B)  # key tiles holding real keys (padding may add more)
    args = (q, k, v, d_out, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, ranges)
    names = ("kv_heads", "kv_tiles", "batch")
    return tiles.launch(
        kernel, args, grid=grid, names=names, out_type=out_type, scratch=scratch,
        consumers=consumers, interpret=interpret,
    )  # fmt: skip


def dq(
    q, k, v, d_out, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, ranges,
    *, config, block_q, block_kv, stages, length_kv, grad_dtype, consumers=CONSUMERS,
    interpret=None,
):  # fmt: skip
    """`dq [B, T, H, D]` in `grad_dtype` on padded inputs; `ranges` as the forward's."""
    B, T, H, D = q.shape
    kernel, q_seg, kv_seg = tiles.bind(
        _dq_kernel, q, k, q_seg, kv_seg, interpret=interpret, config=config, block_q=block_q,
        block_kv=block_kv, stages=stages, length_kv=length_kv, consumers=consumers,
    )  # fmt: skip
    scratch = (
        tiles.swizzled((consumers, block_q, D), q.dtype),
        tiles.swizzled((consumers, block_q, D), d_out.dtype),
        tiles.swizzled((stages, block_kv, D), k.dtype),
        tiles.swizzled((stages, block_kv, D), v.dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=consumers),  # q and dO rows
        plgpu.Barrier(num_barriers=stages),  # k
        plgpu.Barrier(num_barriers=stages),  # v
        plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # slot free
    )
    out_type = jax.ShapeDtypeStruct(q.shape, grad_dtype)
    grid = (H, ranges.shape[1], B)  # query tiles holding real queries
    args = (q, k, v, d_out, lse2, delta, q_pos, kv_pos, q_seg, kv_seg, ranges)
    names = ("heads", "q_tiles", "batch")
    return tiles.launch(
        kernel, args, grid=grid, names=names, out_type=out_type, scratch=scratch,
        consumers=consumers, interpret=interpret,
    )  # fmt: skip
