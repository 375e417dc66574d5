"""Shared plumbing of the Pallas TPU attention kernels: layout, BlockSpecs, pallas_call.

The wrapper side of pallas_tpu: it transposes q to `[B, H, Tp, D]` and k, v
to `[B, K, Sp, D]` (heads before the sequence, so that a block's last two
dims are `(rows, D)`), zero pads the sequences to block multiples, builds the
lane/sublane broadcast copies of positions and segment ids that the kernels
mask with, and the block tables (pallas_tpu_blocks) passed as scalar
prefetch. `checked_call` checks every BlockSpec against the TPU tiling rule
before it calls `pl.pallas_call`; shardfuse.kernels.pallas_interpret chooses
between Mosaic and TPU interpret mode.

Axis glossary: B batch, T query length, S key length, H query heads, K kv
heads, G = H // K, D head dim; Tp, Sp padded lengths; nq, nk block counts.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.kernels.attention import pallas_tpu_blocks as blocks
from shardfuse.kernels.attention import pallas_tpu_tiles as tiles
from shardfuse.kernels.attention.pallas_tpu_blocks import (
    NUM_LANES,
    NUM_SUBLANES,
    PallasTPUBlockSizes,
)
from shardfuse.kernels.precision import SUPPORTED_DTYPES, dot_precision

# TPUs have no float16 MXU path.
TPU_DTYPES = tuple(d for d in SUPPORTED_DTYPES if d != jnp.float16)


class Layout:
    """Padding, transposes, mask tiles and block tables of one call.

    Built once per call with that call's block sizes (the forward's or the
    backward's). `states` is int32 `[B, nq, nk]` (pallas_tpu_blocks), and
    `mask_arrays` the 8 lane/sublane broadcasts the kernels mask with:
    positions `[Tp, 128]`, `[8, Tp]`, `[Sp, 128]`, `[8, Sp]`, then segment
    ids `[B, Tp, 128]`, `[B, 8, Tp]`, `[B, Sp, 128]`, `[B, 8, Sp]` (or None).
    """

    def __init__(self, config, q, k, q_pos, kv_pos, q_seg, kv_seg, block_q, block_kv):
        B, T, H, D = q.shape
        S, K = k.shape[1], k.shape[2]
        self.B, self.T, self.S, self.H, self.K, self.G, self.D = B, T, S, H, K, H // K, D
        self.block_q = bq = blocks.fit_block(T, block_q)
        self.block_kv = bk = blocks.fit_block(S, block_kv)
        self.Tp, self.Sp = -(-T // bq) * bq, -(-S // bk) * bk
        self.nq, self.nk = self.Tp // bq, self.Sp // bk
        q_pos, kv_pos = pad(q_pos, 0, self.Tp), pad(kv_pos, 0, self.Sp)
        if q_seg is not None:
            q_seg = pad(q_seg.astype(jnp.int32), 1, self.Tp)
            kv_seg = pad(kv_seg.astype(jnp.int32), 1, self.Sp)
        states = blocks.block_states(
            config, q_pos, kv_pos, q_seg, kv_seg, length_q=T, length_kv=S, block_q=bq, block_kv=bk
        )
        self.states = jnp.broadcast_to(states, (B, self.nq, self.nk))
        # Lane- and sublane-broadcast copies: [Tp, 128] and [8, Tp], etc.
        self.mask_arrays = (
            broadcast_lanes(q_pos),
            broadcast_sublanes(q_pos),
            broadcast_lanes(kv_pos),
            broadcast_sublanes(kv_pos),
            None if q_seg is None else broadcast_lanes(q_seg),
            None if q_seg is None else broadcast_sublanes(q_seg),
            None if q_seg is None else broadcast_lanes(kv_seg),
            None if q_seg is None else broadcast_sublanes(kv_seg),
        )

    def heads_first(self, x, length):
        """`[B, L, N, D]` -> `[B, N, Lp, D]`, zero padded."""
        return pad(x.transpose(0, 2, 1, 3), 2, length)

    def query_major_specs(self):
        """`(q_spec, kv_spec, mask_specs)` of the kernels on grid `(B, H, nq, nk)` (forward, dQ).

        Query head h reads kv head `h // G`; the kv block index comes from the
        fetch table (scalar prefetch), so a skipped block re-uses the block
        already in VMEM instead of copying a new one.
        """
        G, D, bq, bk = self.G, self.D, self.block_q, self.block_kv

        def kv_block(b, h, i, j, states_ref, fetch_ref):
            return fetch_ref[b, i, j]

        def q_block(b, h, i, j, *_):
            return i

        q_spec = pl.BlockSpec((None, None, bq, D), lambda b, h, i, j, *_: (b, h, i, 0))
        kv_spec = pl.BlockSpec(
            (None, None, bk, D), lambda b, h, *a: (b, lax.div(h, G), kv_block(b, h, *a), 0)
        )
        return q_spec, kv_spec, self.mask_specs(q_block, kv_block)

    def mask_specs(self, q_block, kv_block):
        """BlockSpecs of the 8 mask arrays; `q_block(*idx)`, `kv_block(*idx)` give block indices."""
        bq, bk = self.block_q, self.block_kv
        specs = [
            pl.BlockSpec((bq, NUM_LANES), lambda *a: (q_block(*a), 0)),
            pl.BlockSpec((NUM_SUBLANES, bq), lambda *a: (0, q_block(*a))),
            pl.BlockSpec((bk, NUM_LANES), lambda *a: (kv_block(*a), 0)),
            pl.BlockSpec((NUM_SUBLANES, bk), lambda *a: (0, kv_block(*a))),
        ]
        if self.mask_arrays[4] is None:
            return [*specs, None, None, None, None]
        return [
            *specs,
            pl.BlockSpec((None, bq, NUM_LANES), lambda *a: (a[0], q_block(*a), 0)),
            pl.BlockSpec((None, NUM_SUBLANES, bq), lambda *a: (a[0], 0, q_block(*a))),
            pl.BlockSpec((None, bk, NUM_LANES), lambda *a: (a[0], kv_block(*a), 0)),
            pl.BlockSpec((None, NUM_SUBLANES, bk), lambda *a: (a[0], 0, kv_block(*a))),
        ]

    def static(self, config, dtype):
        """The kernels' static facts for inputs of `dtype`."""
        return tiles.Static(
            config, self.T, self.S, self.block_q, self.block_kv, dot_precision(dtype), self.nq
        )


def pad(x, axis, size):
    """Zero pads `x` along `axis` up to `size` entries.

    Example:
      >>> pad(jnp.ones((2, 3)), 1, 5).shape
      (2, 5)
    """
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def broadcast_lanes(x):
    """`[..., L]` -> `[..., L, 128]`: one value per row, replicated over the lanes.

    The form in which the kernels read per-query (or per-key) vectors along rows.

    Example:
      >>> import jax.numpy as jnp
      >>> broadcast_lanes(jnp.arange(3)).shape
      (3, 128)
    """
    return jnp.broadcast_to(x[..., None], (*x.shape, NUM_LANES))


def broadcast_sublanes(x):
    """`[..., L]` -> `[..., 8, L]`: one value per column, replicated over the sublanes.

    The form in which the kernels read per-key (or per-query) vectors along columns.

    Example:
      >>> import jax.numpy as jnp
      >>> broadcast_sublanes(jnp.arange(3)).shape
      (8, 3)
    """
    return jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], NUM_SUBLANES, x.shape[-1]))


def checked_call(
    kernel,
    lay,
    config,
    *,
    matmuls,
    name,
    grid,
    in_specs,
    out_specs,
    out_shape,
    scratch,
    args,
    interp,
):
    """pallas_call of a pallas_tpu_kernels `kernel` after checking every block against the TPU
    tiling rule.

    The kernel gets its static options `lay.static(config, q dtype)` (`args[2]` is the
    transposed q) and the call a `cost_estimate` of `matmuls` products per head.
    """
    kernel = functools.partial(kernel, st=lay.static(config, args[2].dtype))
    cost = cost_estimate(lay, config, matmuls=matmuls, arrays=args, outputs=out_shape)
    flat_specs = [*in_specs, *out_specs]
    flat_arrays = [*args[2:], *out_shape]
    for index, (spec, array) in enumerate(zip(flat_specs, flat_arrays, strict=True)):
        if spec is not None:
            blocks.check_tiling(f"{name} operand {index}", spec.block_shape, array.shape)
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        cost_estimate=cost,
        interpret=interp,
        name=name,
    )(*args)


def cost_estimate(layout, config, *, matmuls, arrays, outputs):
    """pl.CostEstimate: `matmuls` [T, S, D] products per head (half of them under causal)."""
    pairs = layout.B * layout.H * layout.Tp * layout.Sp // (2 if config.causal else 1)
    transcendentals = pairs * (2 if config.logit_softcap is not None else 1)
    nbytes = sum(x.size * x.dtype.itemsize for x in [*arrays, *outputs] if x is not None)
    return pl.CostEstimate(
        flops=int(2 * matmuls * pairs * layout.D),
        transcendentals=int(transcendentals),
        bytes_accessed=int(nbytes),
    )


def check_supported(q, block_sizes):
    """This backend's block sizes for `q`, or NotImplementedError for what it cannot run.

    Supported: float32 and bfloat16 (TPUs have no float16 MXU path), head
    dims 64 or multiples of 128, block sizes multiples of 128.

    Example:
      >>> from shardfuse.kernels.attention import base
      >>> check_supported(jnp.zeros((1, 8, 2, 128), jnp.bfloat16), base.BlockSizes())
      PallasTPUBlockSizes(block_q=512, block_kv=512, block_q_bwd=256, block_kv_bwd=512)
    """
    D = q.shape[-1]
    if jnp.dtype(q.dtype) not in TPU_DTYPES:
        raise NotImplementedError(
            f"pallas_tpu supports float32 and bfloat16 inputs, got {q.dtype} "
            "(TPUs have no float16 MXU path: use bfloat16)"
        )
    if D != 64 and D % NUM_LANES:
        raise NotImplementedError(
            f"pallas_tpu needs head dim D = 64 or a multiple of {NUM_LANES} (lane tiles); got D={D}"
        )
    return PallasTPUBlockSizes.from_config(block_sizes, q.dtype, D)
