"""Tiled matmul-plus-reduce as a Pallas TPU (Mosaic) kernel.

The classic blocked GEMM (the Pallas TPU matmul guide,
https://docs.jax.dev/en/latest/pallas/tpu/matmul.html): a grid over
`(M / block_m, N / block_n, C / block_k)` with the contracted axis innermost
("arbitrary"), a float32 VMEM accumulator per output tile, and the epilogue
fused into the last contraction step: the accumulator starts from the
addend tile (so the partial sum of a reduce-scatter ring step is read
once, straight into the accumulator), `bias` is added at the end and the tile
is cast to `out_dtype` once. Inputs whose sizes are not block multiples are
zero padded (zeros along C add nothing) and the output is sliced back.

The backward runs the same kernel: `da = g @ b^T`, `db = a^T @ g` (the
cotangent is cast to the input dtype first), `daddend = g`, `dbias = sum g`.

Off TPU the kernel runs in TPU interpret mode (`pltpu.InterpretParams`),
which is how the tests check it on CPU; `pallas_interpret.interpret_mode(False)`
forces the real Mosaic kernel so that `lower(lowering_platforms=("tpu",))` can
be checked without a TPU.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.kernels.matmul import base
from shardfuse.kernels.pallas_interpret import current_interpret_params
from shardfuse.kernels.precision import dot_precision

DEFAULT_BLOCK_M = 256
DEFAULT_BLOCK_N = 256
DEFAULT_BLOCK_K = 512
LANE = 128  # last-dim tiles are multiples of 128 lanes
SUBLANE = 16  # second-to-last: 8 rows of 32-bit, 16 of 16-bit values; 16 fits both


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Resolved block sizes and padded sizes of one call."""

    block_m: int
    block_n: int
    block_k: int
    M: int
    N: int
    C: int


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _block(size: int, requested: int | None, default: int, multiple: int, name: str) -> int:
    if requested is not None:
        if requested % multiple:
            raise NotImplementedError(
                f"pallas_tpu matmul needs {name} to be a multiple of {multiple}, got {requested}"
            )
        return requested
    return min(default, _round_up(size, multiple))


def tiling(M: int, N: int, C: int, block_sizes: base.MatmulBlockSizes) -> Tiling:
    """Block sizes (defaults clipped to the problem) and the padded problem sizes."""
    bm = _block(M, block_sizes.block_m, DEFAULT_BLOCK_M, SUBLANE, "block_m")
    bn = _block(N, block_sizes.block_n, DEFAULT_BLOCK_N, LANE, "block_n")
    bk = _block(C, block_sizes.block_k, DEFAULT_BLOCK_K, LANE, "block_k")
    return Tiling(bm, bn, bk, _round_up(M, bm), _round_up(N, bn), _round_up(C, bk))


def _matmul_kernel(*refs, has_addend: bool, has_bias: bool):
    a_ref, b_ref = refs[:2]
    addend_ref = refs[2] if has_addend else None
    bias_ref = refs[2 + has_addend] if has_bias else None
    out_ref, acc_ref = refs[-2:]
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        if addend_ref is None:
            acc_ref[...] = jnp.zeros_like(acc_ref)
        else:
            acc_ref[...] = addend_ref[...].astype(jnp.float32)

    # HIGHEST for float32 tiles: full-precision MXU passes, as the reference.
    precision = dot_precision(a_ref.dtype)
    acc_ref[...] += jnp.dot(
        a_ref[...], b_ref[...], preferred_element_type=jnp.float32, precision=precision
    )

    @pl.when(k == pl.num_programs(2) - 1)
    def _epilogue():
        acc = acc_ref[...]
        if bias_ref is not None:
            acc = acc + bias_ref[...].astype(jnp.float32)
        out_ref[...] = acc.astype(out_ref.dtype)


def _pad2(x, rows: int, cols: int):
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def matmul_2d(a, b, addend, bias, *, out_dtype, block_sizes: base.MatmulBlockSizes):
    """The kernel on 2-D operands: a `[M, C]`, b `[C, N]`, optional addend `[M, N]`, bias `[N]`."""
    M, C = a.shape
    N = b.shape[1]
    t = tiling(M, N, C, block_sizes)
    operands = [_pad2(a, t.M, t.C), _pad2(b, t.C, t.N)]
    in_specs = [
        pl.BlockSpec((t.block_m, t.block_k), lambda i, j, k: (i, k)),
        pl.BlockSpec((t.block_k, t.block_n), lambda i, j, k: (k, j)),
    ]
    if addend is not None:
        operands.append(_pad2(addend, t.M, t.N))
        in_specs.append(pl.BlockSpec((t.block_m, t.block_n), lambda i, j, k: (i, j)))
    if bias is not None:
        operands.append(_pad2(bias.reshape(1, N), 1, t.N))
        in_specs.append(pl.BlockSpec((1, t.block_n), lambda i, j, k: (0, j)))
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, has_addend=addend is not None, has_bias=bias is not None),
        out_shape=jax.ShapeDtypeStruct((t.M, t.N), out_dtype),
        grid=(t.M // t.block_m, t.N // t.block_n, t.C // t.block_k),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((t.block_m, t.block_n), lambda i, j, k: (i, j)),
        scratch_shapes=[pltpu.VMEM((t.block_m, t.block_n), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=current_interpret_params(),
        name="shardfuse_matmul_plus_reduce",
    )(*operands)
    return out[:M, :N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _matmul(a, b, addend, bias, config: base.MatmulConfig):
    out_shape = base.output_shape(a, b)
    a2 = a.reshape(-1, a.shape[-1])  # [M', C]
    addend2 = None if addend is None else addend.reshape(-1, addend.shape[-1])
    out = matmul_2d(
        a2, b, addend2, bias, out_dtype=config.out_dtype, block_sizes=config.block_sizes
    )
    return out.reshape(out_shape)


def _matmul_fwd(a, b, addend, bias, config):
    return _matmul(a, b, addend, bias, config), (a, b, addend, bias)


def _matmul_bwd(config, residuals, g):
    def product(x, y, out_dtype):
        return matmul_2d(x, y, None, None, out_dtype=out_dtype, block_sizes=config.block_sizes)

    return base.backward(product, residuals, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(config: base.MatmulConfig, a, b, addend, bias):
    """`a [..., M, C] @ b [C, N] (+ addend) (+ bias)` on validated inputs, with a custom VJP."""
    # Refuse now, before tracing, so that dispatch can fall back.
    base.require_default_precision(config, a.dtype, "pallas_tpu")
    if current_interpret_params() is False and jnp.float16 in (
        jnp.dtype(a.dtype),
        config.out_dtype,
    ):
        raise NotImplementedError("pallas_tpu matmul on TPU supports float32 and bfloat16")
    tiling(a.size // max(a.shape[-1], 1), b.shape[1], b.shape[0], config.block_sizes)
    return _matmul(a, b, addend, bias, config)
