"""Grouped matmul as Pallas TPU (Mosaic) kernels: the grouped GEMM and its transpose.

The megablox scheme (Gale et al., MegaBlocks, arXiv:2211.15841; JAX's
`pallas/ops/tpu/megablox`), written for this op's normal form: the grid walks
the row-tile visits of `tiles.visits` (computed on the device from the traced
sizes and scalar-prefetched into SMEM, so one compiled kernel serves every
routing), visiting at most one partial tile per group boundary.

- forward, `(tiles_n, visits, tiles_k)`: each visit multiplies its row tile of
  lhs by its group's weight tile into a float32 VMEM accumulator over the
  contracted dim, then writes the rows of its group into the output tile
  (a select: the tile's other rows keep what the neighbouring group's visit
  wrote, zeros on a tile's first visit). Visits of group -1 (other shards'
  groups, rows past the sizes' sum) write zeros without a product. The inputs'
  gradient is the same kernel with rhs's layout flipped.
- transposed, `(tiles_k, tiles_n, visits)`: the weights' gradient of each group
  accumulates `x[rows]^T y[rows]` over its visits (rows outside the group
  selected to 0 on both sides) and is written on the group's last visit; an
  empty group's single visit writes zeros.

Edges are partial blocks: the contracted dim's remainder is masked to 0 on
both operands, rows and columns past the array are never written back. Off
TPU the kernels run in TPU interpret mode (`pallas_interpret`); tests choose
small tiles with `tiles.block_sizes`.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.kernels import vma
from shardfuse.kernels.grouped_matmul import base, tiles
from shardfuse.kernels.pallas_interpret import current_interpret_params
from shardfuse.kernels.precision import dot_precision

DEFAULT = tiles.BlockSizes(block_m=256, block_k=512, block_n=512)
LANE = 128  # last-dim tiles are multiples of 128 lanes (or the whole dim)
SUBLANE = 16  # second-to-last: 8 rows of 32-bit, 16 of 16-bit values; 16 fits both


def _tile(size: int, requested: int, multiple: int, name: str) -> int:
    """`requested`, or the whole dim when that is smaller (a block may equal the array's dim)."""
    if requested % multiple:
        raise NotImplementedError(
            f"pallas_tpu grouped matmul needs {name} to be a multiple of {multiple}, "
            f"got {requested}"
        )
    return size if size <= requested else requested


def block_shape(M: int, K: int, N: int) -> tiles.BlockSizes:
    """The tiles of a call: `tiles.block_sizes`'s or the defaults, clipped to the problem."""
    sizes = tiles.current_block_sizes().resolve(DEFAULT)
    block_m = -(-min(sizes.block_m, M) // SUBLANE) * SUBLANE
    if sizes.block_m % SUBLANE:
        raise NotImplementedError(
            f"pallas_tpu grouped matmul needs block_m to be a multiple of {SUBLANE}, "
            f"got {sizes.block_m}"
        )
    return tiles.BlockSizes(
        block_m=block_m,
        block_k=_tile(K, sizes.block_k, LANE, "block_k"),
        block_n=_tile(N, sizes.block_n, LANE, "block_n"),
    )


def _mask_depth(x, k, block_k: int, depth: int, axis: int):
    """`x` with the contracted elements past `depth` (a partial last block) set to 0."""
    if depth % block_k == 0:
        return x
    index = k * block_k + lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(index < depth, x, 0)


def _rows_mask(visits, v, block_m: int, shape):
    rows = visits.tile[v] * block_m + lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= visits.begin[v]) & (rows < visits.end[v])


def _forward_kernel(visits, lhs_ref, rhs_ref, out_ref, acc_ref, *, shape, transpose_rhs, precision):
    block_m, block_k, K = shape
    v, k = pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(visits.group[v] >= 0)
    def _product():
        lhs = _mask_depth(lhs_ref[...], k, block_k, K, axis=1)  # [block_m, block_k]
        rhs = _mask_depth(rhs_ref[...], k, block_k, K, axis=1 if transpose_rhs else 0)
        contract = 1 if transpose_rhs else 0
        acc_ref[...] += lax.dot_general(
            lhs,
            rhs,
            (((1,), (contract,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )

    @pl.when(k == pl.num_programs(2) - 1)
    def _store():
        mask = _rows_mask(visits, v, block_m, acc_ref.shape)
        kept = jnp.where(visits.first[v] == 1, jnp.zeros_like(acc_ref), out_ref[...])
        out_ref[...] = jnp.where(mask, acc_ref[...], kept.astype(jnp.float32)).astype(out_ref.dtype)


def forward(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start):
    """`out [M, N]`: the grouped GEMM (rhs `[G, K, N]`, or `[G, N, K]` transposed)."""
    M, K = lhs.shape
    N = base.output_shape(lhs, rhs, config)[1]
    t = block_shape(M, K, N)
    visits = tiles.visits(sizes, start, M, t.block_m, forward=True)
    V = visits.tile.shape[0]
    if config.transpose_rhs:
        rhs_spec = pl.BlockSpec(
            (None, t.block_n, t.block_k), lambda n, v, k, s: (jnp.maximum(s.group[v], 0), n, k)
        )
    else:
        rhs_spec = pl.BlockSpec(
            (None, t.block_k, t.block_n), lambda n, v, k, s: (jnp.maximum(s.group[v], 0), k, n)
        )
    kernel = functools.partial(
        _forward_kernel,
        shape=(t.block_m, t.block_k, K),
        transpose_rhs=config.transpose_rhs,
        precision=dot_precision(lhs.dtype, config.precision),
    )
    return pl.pallas_call(
        kernel,
        out_shape=vma.shape_dtype_struct((M, N), config.out_dtype, lhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(N, t.block_n), V, pl.cdiv(K, t.block_k)),
            in_specs=[
                pl.BlockSpec((t.block_m, t.block_k), lambda n, v, k, s: (s.tile[v], k)),
                rhs_spec,
            ],
            out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda n, v, k, s: (s.tile[v], n)),
            scratch_shapes=[pltpu.VMEM((t.block_m, t.block_n), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * M * K * N,
            transcendentals=0,
            bytes_accessed=lhs.nbytes * pl.cdiv(N, t.block_n)
            + rhs.nbytes
            + M * N * config.out_dtype.itemsize,
        ),
        interpret=current_interpret_params(),
        name="shardfuse_grouped_matmul",
    )(visits, lhs, rhs)


def _transposed_kernel(visits, x_ref, y_ref, out_ref, acc_ref, *, block_m, precision):
    v = pl.program_id(2)

    @pl.when(visits.first[v] == 1)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((visits.valid[v] == 1) & (visits.end[v] > visits.begin[v]))
    def _product():
        # Rows outside the group are 0 on both sides (a select: NaN there stays out).
        x = jnp.where(_rows_mask(visits, v, block_m, x_ref.shape), x_ref[...], 0)
        y = jnp.where(_rows_mask(visits, v, block_m, y_ref.shape), y_ref[...], 0)
        acc_ref[...] += lax.dot_general(
            x, y, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [block_a, block_b]

    @pl.when(visits.last[v] == 1)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def transposed(config: base.GroupedMatmulConfig, x, y, sizes, start, out_dtype):
    """`[G, A, B]`: `x [M, A]^T @ y [M, B]` over each local group's rows (0 for empty groups)."""
    (M, A), B = x.shape, y.shape[1]
    G = sizes.shape[0]
    t = block_shape(M, A, B)  # tiles of rows, of x's columns (A), of y's (B)
    visits = tiles.visits(sizes, start, M, t.block_m, forward=False)
    V = visits.tile.shape[0]
    kernel = functools.partial(
        _transposed_kernel, block_m=t.block_m, precision=dot_precision(x.dtype, config.precision)
    )
    return pl.pallas_call(
        kernel,
        out_shape=vma.shape_dtype_struct((G, A, B), out_dtype, x),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(pl.cdiv(A, t.block_k), pl.cdiv(B, t.block_n), V),
            in_specs=[
                pl.BlockSpec((t.block_m, t.block_k), lambda a, b, v, s: (s.tile[v], a)),
                pl.BlockSpec((t.block_m, t.block_n), lambda a, b, v, s: (s.tile[v], b)),
            ],
            out_specs=pl.BlockSpec(
                (None, t.block_k, t.block_n), lambda a, b, v, s: (s.group[v], a, b)
            ),
            scratch_shapes=[pltpu.VMEM((t.block_k, t.block_n), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * M * A * B,
            transcendentals=0,
            bytes_accessed=x.nbytes * pl.cdiv(B, t.block_n)
            + y.nbytes * pl.cdiv(A, t.block_k)
            + G * A * B * jnp.dtype(out_dtype).itemsize,
        ),
        interpret=current_interpret_params(),
        name="shardfuse_grouped_matmul_transposed",
    )(visits, x, y)


_grouped_matmul = base.differentiable(forward, transposed)


def grouped_matmul(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start):
    """The Pallas TPU kernels on validated inputs; differentiable (`base.differentiable`)."""
    # Refuse now, before tracing, so that dispatch can fall back.
    if current_interpret_params() is False and jnp.float16 in (
        jnp.dtype(lhs.dtype),
        config.out_dtype,
    ):
        raise NotImplementedError("pallas_tpu grouped matmul on TPU supports float32 and bfloat16")
    M, K = lhs.shape
    block_shape(M, K, base.output_shape(lhs, rhs, config)[1])
    return _grouped_matmul(config, lhs, rhs, sizes, start)
