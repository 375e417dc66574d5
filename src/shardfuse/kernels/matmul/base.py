"""Shared pieces of the matmul op: validation, the static config, block sizes.

Every backend receives inputs that `validate` has already checked and a
`MatmulConfig` holding the static options, so a backend only ever raises
`NotImplementedError` (valid input it cannot handle), never `ValueError`.

Axis glossary: M rows of `a` (all leading dims of `a` flattened with its
second-to-last), C the contracted dim, N columns of `b`.
"""

import dataclasses
import numbers

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.precision import SUPPORTED_DTYPES, dot_precision


@dataclasses.dataclass(frozen=True)
class MatmulBlockSizes:
    """Tile sizes of the tiled matmul kernels (pallas_tpu, triton).

    Attributes:
      block_m: rows of `a` (and of the output) per tile.
      block_n: columns of `b` (and of the output) per tile.
      block_k: contracted elements per step of the float32 accumulation loop.

    `None` fields take the backend's default. A backend may refuse sizes it
    cannot tile with (NotImplementedError).
    """

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1
            ):
                raise ValueError(
                    f"MatmulBlockSizes.{name}={value!r} must be a positive int or None"
                )


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Static (hashable) matmul options after validation and defaulting."""

    out_dtype: jnp.dtype
    block_sizes: MatmulBlockSizes = MatmulBlockSizes()
    precision: lax.Precision | None = None  # None: HIGHEST for float32, DEFAULT for 16-bit


def check_precision(precision, *, name: str = "precision") -> lax.Precision | None:
    """None, a `lax.Precision` or its name ("default", "high", "highest") -> Precision | None."""
    if precision is None or isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError:
            pass
    raise ValueError(
        f"{name}={precision!r} must be None, a jax.lax.Precision or one of "
        "'default', 'high', 'highest'"
    )


def require_default_precision(config: MatmulConfig, dtype, backend: str):
    """For kernels with a fixed precision: NotImplementedError unless `precision` matches it."""
    if config.precision is None:
        return
    fixed = dot_precision(dtype)
    if config.precision != fixed:
        raise NotImplementedError(
            f"{backend} matmul computes {jnp.dtype(dtype).name} products at precision "
            f"{fixed.name}; precision={config.precision.name} needs the xla implementation"
        )


def check_array(name, x):
    """TypeError unless `x` is an array of a supported float dtype (`SUPPORTED_DTYPES`)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; supported dtypes are float32, bfloat16 and float16"
        )


def check_out_dtype(value, *, name: str = "out_dtype") -> jnp.dtype:
    """`value` as a supported float dtype; TypeError naming the argument otherwise."""
    try:
        out_dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} is not a dtype") from e
    if out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}={out_dtype} is not supported; use float32, bfloat16 or float16")
    return out_dtype


def output_shape(a, b) -> tuple[int, ...]:
    """`[..., M, N]`: the leading dims and rows of `a`, the columns of `b`."""
    return (*a.shape[:-1], b.shape[1])


def validate(
    a, b, *, addend=None, bias=None, out_dtype=None, block_sizes=None, precision=None
) -> MatmulConfig:
    """Checks the inputs of `matmul` and returns its `MatmulConfig`.

    Raises:
      ValueError: ranks or shapes do not fit
        `a [..., M, C] @ b [C, N] + addend [..., M, N] + bias [N]`.
      TypeError: a non-array input, an unsupported dtype (integers, float64),
        `a` and `b` of different dtypes, or a bad `out_dtype` / `block_sizes`.
    """
    check_array("a", a)
    check_array("b", b)
    if a.ndim < 2:
        raise ValueError(f"a has rank {a.ndim} (shape {tuple(a.shape)}); expected [..., M, C]")
    if b.ndim != 2:
        raise ValueError(f"b has rank {b.ndim} (shape {tuple(b.shape)}); expected [C, N]")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share one dtype; got a {a.dtype} and b {b.dtype}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"contracted dims differ: a {tuple(a.shape)} has C={a.shape[-1]}, "
            f"b {tuple(b.shape)} has C={b.shape[0]}"
        )
    expected = output_shape(a, b)
    if addend is not None:
        check_array("addend", addend)
        if tuple(addend.shape) != expected:
            raise ValueError(
                f"addend has shape {tuple(addend.shape)}; expected the output shape "
                f"[..., M, N] = {expected}"
            )
    if bias is not None:
        check_array("bias", bias)
        if tuple(bias.shape) != (b.shape[1],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [N] = ({b.shape[1]},)")
    out_dtype = jnp.dtype(a.dtype) if out_dtype is None else check_out_dtype(out_dtype)
    if block_sizes is None:
        block_sizes = MatmulBlockSizes()
    elif not isinstance(block_sizes, MatmulBlockSizes):
        raise TypeError(
            f"block_sizes must be a MatmulBlockSizes or None, got {type(block_sizes).__name__}"
        )
    return MatmulConfig(
        out_dtype=out_dtype, block_sizes=block_sizes, precision=check_precision(precision)
    )


def epilogue(acc, addend, bias, out_dtype):
    """`acc (+ addend) (+ bias)` in float32, then cast: the fused add of every backend."""
    if addend is not None:
        acc = acc + addend.astype(jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    return acc.astype(out_dtype)


def backward(matmul_2d, residuals, g):
    """The VJP of `a @ b (+ addend) (+ bias)` with both products on a backend's 2-D kernel.

        da = g b^T,   db = a^T g,   daddend = g,   dbias = sum over rows of g (float32)

    Args:
      matmul_2d: `(x [M, C], y [C, N], out_dtype) -> x @ y [M, N]`, the backend's kernel.
      residuals: the forward's `(a, b, addend, bias)`.
      g: `[..., M, N]` cotangent of the output.

    Returns:
      `(da, db, daddend, dbias)`, each in its primal's dtype (None for an absent
      `addend` or `bias`).
    """
    a, b, addend, bias = residuals
    g2 = g.reshape(-1, g.shape[-1]).astype(a.dtype)  # [M', N]
    a2 = a.reshape(-1, a.shape[-1])  # [M', C]
    da = matmul_2d(g2, b.T, a.dtype)
    db = matmul_2d(a2.T, g2, b.dtype)
    daddend = None if addend is None else g.astype(addend.dtype)
    dbias = None
    if bias is not None:
        dbias = jnp.sum(g.astype(jnp.float32), axis=tuple(range(g.ndim - 1))).astype(bias.dtype)
    return da.reshape(a.shape), db, daddend, dbias
