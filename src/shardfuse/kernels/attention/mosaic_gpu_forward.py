"""The Pallas Mosaic GPU flash-attention forward kernel for Hopper (sm_90+).

FlashAttention-3's structure (Shah et al. 2024, arXiv:2407.08608), written
with Pallas Mosaic GPU primitives:

- one CTA per (kv-head group member h, query tile of `2 * block_q` rows,
  batch); three warpgroups: two consumers of `block_q` rows each and one
  producer;
- the producer (its registers given to the consumers) streams the K and V
  blocks the tile sees into a ring of `stages` shared-memory slots with TMA,
  each slot's arrival signalled on an mbarrier; consumers release a slot
  when their matmul on it is done;
- consumers run `S = Q K^T` and `O += P V` on the tensor cores (`wgmma`) in
  ping-pong: a schedule barrier alternates them, so that one warpgroup's
  softmax (exp2, row max and sum) overlaps the other's matmuls;
- the online softmax runs in base 2 (`exp2`, the scale folded in); only key
  blocks the block table marks partial evaluate the mask, on absolute
  positions and segment ids (`mosaic_gpu_tiles.tile_mask`).

Which key blocks a tile visits comes from the wrapper's block table
(`ranges [B, n_tiles, 4] = (lo, full_lo, full_hi, hi)`, see `masks.visit_ranges`):
blocks outside `[lo, hi)` are never loaded, blocks in `[full_lo, full_hi)`
need no mask.

Axis glossary: B batch, T query length, S key length, H query heads,
K kv heads, G = H // K, D head dim (padded to a multiple of 64), bq, bk tile rows.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from shardfuse.kernels.attention import mosaic_gpu_tiles as tiles

CONSUMERS = 2  # consumer warpgroups per CTA


def _kernel(
    q_ref, k_ref, v_ref, q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref, ranges_ref,
    out_ref, lse_ref,
    q_smem, k_smem, v_smem, lse_smem, q_ready, k_ready, v_ready, k_free, v_free, schedule,
    *, config, block_q, block_kv, stages, group, length_kv, segments, interpret,
):  # fmt: skip
    head, kv_head, tile, batch, wg, bounds = tiles.query_cta(ranges_ref, config, group)
    lo, _, _, hi = bounds
    D = q_smem.shape[-1]

    def schedule_sync():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @tiles.consumer(wg, CONSUMERS)
    def consumer():
        q_start = tile * (CONSUMERS * block_q) + wg * block_q
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(
            q_ref.at[batch, pl.ds(q_start, block_q), head], q_tile, q_ready.at[wg]
        )
        mask_refs = tiles.mask_refs(
            q_pos_ref, kv_pos_ref, q_seg_ref, kv_seg_ref,
            segments=segments, length_kv=length_kv, interpret=interpret,
        )  # fmt: skip
        layout = functools.partial(tiles.in_layout, interpret=interpret)
        row_max = layout(jnp.full((block_q,), -jnp.inf, jnp.float32), tiles.ROW)
        row_sum = layout(jnp.zeros((block_q,), jnp.float32), tiles.ROW)
        acc = layout(jnp.zeros((block_q, D), jnp.float32), tiles.WGMMA)
        plgpu.barrier_wait(q_ready.at[wg])
        pl.when(wg == 1)(schedule_sync)  # consumer 1 starts half a step behind

        def step(j, carry, *, masked):
            acc, row_max, row_sum = carry
            slot = lax.rem(j - lo, stages)
            plgpu.barrier_wait(k_ready.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                schedule_sync()  # the other consumer's softmax runs beside this matmul
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((block_q, block_kv), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            x, c, _ = tiles.logits_log2(config, s)  # base-2 logits x * c, c > 0
            if masked:
                visible = tiles.tile_mask(
                    config, mask_refs, batch, q_start, j * block_kv, (block_q, block_kv)
                )
                x = jnp.where(visible, x, -jnp.inf)
            m_new = jnp.maximum(row_max, x.max(axis=1) * c)
            m_use = tiles.safe_max(m_new) if masked else m_new
            alpha = jnp.exp2(row_max - m_use)
            p = jnp.exp2(x * c - lax.broadcast_in_dim(m_use, x.shape, [0]))  # one FMA each
            row_sum = row_sum * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p = p.astype(v_smem.dtype)
            acc, row_sum, m_new, p = lax.optimization_barrier((acc, row_sum, m_new, p))
            plgpu.barrier_arrive(schedule)  # softmax done: the other consumer may multiply
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(schedule)
            acc = tiles.mma(p, v_smem.at[slot], acc.shape, acc=acc, interpret=interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, row_sum

        acc, row_max, row_sum = tiles.walk(step, bounds, (acc, row_max, row_sum))
        pl.when(wg == 0)(schedule_sync)

        sees = row_sum > 0.0  # rows that saw no key: out 0, lse -inf
        row_sum = jnp.where(sees, row_sum, 1.0)
        out = acc * lax.broadcast_in_dim(1.0 / row_sum, acc.shape, [0])
        lse = jnp.where(sees, (row_max + jnp.log2(row_sum)) * tiles.LN2, -jnp.inf)
        q_tile[...] = out.astype(q_tile.dtype)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            q_tile, out_ref.at[batch, pl.ds(q_start, block_q), head], commit_group=False
        )
        plgpu.copy_smem_to_gmem(
            lse_smem.at[wg], lse_ref.at[batch, head, pl.ds(q_start, block_q)], commit_group=False
        )
        plgpu.commit_smem_to_gmem_group()
        plgpu.wait_smem_to_gmem(0)

    @tiles.producer(wg, CONSUMERS)
    def producer():

        def load(s, slot, reuse):
            rows = (batch, pl.ds((lo + s) * block_kv, block_kv), kv_head)
            tiles.wait_when(reuse, k_free.at[slot])  # K first: the next QK^T needs it first
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_ready.at[slot])
            tiles.wait_when(reuse, v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_ready.at[slot])

        tiles.stream(load, hi - lo, stages, (k_free, v_free))


def forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, ranges, *, config, block_q, block_kv, stages,
            length_kv, interpret=None):  # fmt: skip
    """`(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])` on padded inputs.

    `T` is a multiple of `2 * block_q`, `S` of `block_kv`, `D` of 64; `ranges`
    `[B, T // (2 * block_q), 4]` is the block table; `length_kv` the true S (keys
    past it are padding). `interpret`: None (compile for the GPU) or an
    `InterpretGPUParams` (Mosaic GPU interpret mode on CPU).
    """
    B, T, H, D = q.shape
    tiles_q = ranges.shape[1]  # query tiles holding real queries (padding may add more)
    kernel, q_seg, kv_seg = tiles.bind(
        _kernel, q, k, q_seg, kv_seg, interpret=interpret, config=config, block_q=block_q,
        block_kv=block_kv, stages=stages, length_kv=length_kv,
    )  # fmt: skip
    scratch = (
        tiles.swizzled((CONSUMERS, block_q, D), q.dtype),
        tiles.swizzled((stages, block_kv, D), k.dtype),
        tiles.swizzled((stages, block_kv, D), v.dtype),
        plgpu.SMEM((CONSUMERS, block_q), jnp.float32),
        plgpu.Barrier(num_barriers=CONSUMERS),  # q_ready
        plgpu.Barrier(num_barriers=stages),  # k_ready
        plgpu.Barrier(num_barriers=stages),  # v_ready
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # k_free
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),  # v_free
        plgpu.Barrier(num_arrivals=CONSUMERS),  # schedule
    )
    out_type = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((B, H, T), jnp.float32),
    )
    return tiles.launch(
        kernel, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, ranges), grid=(H, tiles_q, B),
        names=("heads", "q_tiles", "batch"), out_type=out_type, scratch=scratch,
        consumers=CONSUMERS, interpret=interpret,
    )  # fmt: skip
