"""Shared pieces of the grouped matmul op: validation, the static config, the group layout, the VJP.

Every backend receives inputs that `validate` has already checked, a
`GroupedMatmulConfig` of static options, and the routing in one normal form
(`local_groups`): the sizes of the groups this call computes, `sizes [G]`, and
`start`, the first row of the first of them. Local group `j` owns rows
`[start + sizes[:j].sum(), start + sizes[:j + 1].sum())`; every other row of
the output is zero. A backend only ever raises `NotImplementedError` (valid
input it cannot handle), never `ValueError`.

Axis glossary: M rows of `lhs` (tokens times top-k, sorted by group), K the
contracted dim, N the output width, G the groups (experts) of `rhs`, G_all
the groups of `group_sizes` (G_all > G under expert parallelism).
"""

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardfuse.kernels import vma
from shardfuse.kernels.matmul.base import check_array, check_out_dtype, check_precision


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """Static (hashable) options of one call, after validation and defaulting.

    Attributes:
      out_dtype: the result's dtype (`preferred_element_type`, default lhs's).
      transpose_rhs: rhs is `[G, N, K]` (True) rather than `[G, K, N]`.
      precision: None (HIGHEST for float32 inputs, DEFAULT for 16-bit), or a
        `lax.Precision` for the products.
    """

    out_dtype: jnp.dtype
    transpose_rhs: bool = False
    precision: lax.Precision | None = None


def _concrete(x):
    """`x` as a numpy array when its value is known before tracing, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_group_sizes(group_sizes, M: int, num_local: int, has_offset: bool):
    if isinstance(group_sizes, (list, tuple)):
        group_sizes = np.asarray(group_sizes)
    if not hasattr(group_sizes, "shape") or not hasattr(group_sizes, "dtype"):
        raise TypeError(f"group_sizes must be an integer array, got {type(group_sizes).__name__}")
    dtype = np.dtype(group_sizes.dtype)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"group_sizes has dtype {dtype}; it must be an integer array (int32)")
    if group_sizes.ndim != 1:
        raise ValueError(
            f"group_sizes has shape {tuple(group_sizes.shape)}; expected [G], one size per group"
        )
    if has_offset:
        if group_sizes.shape[0] < num_local:
            raise ValueError(
                f"group_sizes has {group_sizes.shape[0]} groups, fewer than rhs's {num_local}"
            )
    elif group_sizes.shape[0] != num_local:
        raise ValueError(
            f"group_sizes has {group_sizes.shape[0]} groups and rhs {num_local}; without "
            "group_offset they must be equal"
        )
    value = _concrete(group_sizes)
    if value is not None:
        if (value < 0).any():
            raise ValueError(
                f"group_sizes={value.tolist()} has negative sizes at {np.flatnonzero(value < 0)}"
            )
        total = int(value.astype(np.int64).sum())
        if total > M:
            raise ValueError(
                f"group_sizes sums to {total}, more rows than lhs has (M={M}); sizes must sum "
                "to at most M (rows past the sum give zeros)"
            )
    return group_sizes


def _check_group_offset(group_offset, num_all: int, num_local: int):
    if group_offset is None:
        return None
    if isinstance(group_offset, bool) or (
        not isinstance(group_offset, numbers.Integral)
        and not (
            hasattr(group_offset, "dtype")
            and np.issubdtype(np.dtype(group_offset.dtype), np.integer)
            and np.dtype(group_offset.dtype) != np.bool_
        )
    ):
        raise TypeError(
            f"group_offset={group_offset!r} must be None, an int or an integer scalar array"
        )
    if hasattr(group_offset, "shape") and tuple(group_offset.shape) not in ((), (1,)):
        raise ValueError(
            f"group_offset has shape {tuple(group_offset.shape)}; expected a scalar (or shape (1,))"
        )
    value = _concrete(group_offset)
    if value is not None:
        value = int(np.asarray(value).reshape(()))
        if not 0 <= value <= num_all - num_local:
            raise ValueError(
                f"group_offset={value} is out of range: rhs holds {num_local} of the "
                f"{num_all} groups of group_sizes, so the offset must be in "
                f"[0, {num_all - num_local}]"
            )
    return group_offset


def validate(
    lhs,
    rhs,
    group_sizes,
    *,
    group_offset=None,
    transpose_rhs=False,
    preferred_element_type=None,
    precision=None,
):
    """Checks the inputs of `grouped_matmul`; returns `(config, group_sizes, group_offset)`.

    Runs before anything is traced: concrete `group_sizes` and `group_offset`
    are checked by value, traced ones by shape and dtype only.

    Raises:
      ValueError: ranks or shapes that do not fit `lhs [M, K]`, `rhs [G, K, N]`
        (`[G, N, K]` with `transpose_rhs`), `group_sizes [G]` (`[G_all]` with an
        offset); negative sizes or sizes summing to more than M; an offset outside
        `[0, G_all - G]`; a bad `precision`.
      TypeError: non-array inputs, unsupported or different dtypes of lhs and rhs,
        non-integer `group_sizes` or `group_offset`, a bad `preferred_element_type`,
        a non-bool `transpose_rhs`.
    """
    check_array("lhs", lhs)
    check_array("rhs", rhs)
    if lhs.ndim != 2:
        raise ValueError(f"lhs has rank {lhs.ndim} (shape {tuple(lhs.shape)}); expected [M, K]")
    if not isinstance(transpose_rhs, bool):
        raise TypeError(f"transpose_rhs={transpose_rhs!r} must be a bool")
    layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
    if rhs.ndim != 3:
        raise ValueError(f"rhs has rank {rhs.ndim} (shape {tuple(rhs.shape)}); expected {layout}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(
            f"lhs and rhs must share one dtype; got lhs {lhs.dtype} and rhs {rhs.dtype}"
        )
    K = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if lhs.shape[1] != K:
        raise ValueError(
            f"contracted dims differ: lhs {tuple(lhs.shape)} has K={lhs.shape[1]}, rhs "
            f"{tuple(rhs.shape)} ({layout}) has K={K}"
        )
    group_sizes = _check_group_sizes(
        group_sizes, lhs.shape[0], rhs.shape[0], has_offset=group_offset is not None
    )
    group_offset = _check_group_offset(group_offset, group_sizes.shape[0], rhs.shape[0])
    out_dtype = (
        jnp.dtype(lhs.dtype)
        if preferred_element_type is None
        else check_out_dtype(preferred_element_type, name="preferred_element_type")
    )
    config = GroupedMatmulConfig(
        out_dtype=out_dtype, transpose_rhs=transpose_rhs, precision=check_precision(precision)
    )
    return config, group_sizes, group_offset


def output_shape(lhs, rhs, config: GroupedMatmulConfig) -> tuple[int, int]:
    """`(M, N)`: lhs's rows, rhs's output width."""
    return lhs.shape[0], rhs.shape[1] if config.transpose_rhs else rhs.shape[2]


def local_groups(group_sizes, group_offset, num_local: int, M: int):
    """The routing in the backends' normal form: `(sizes int32 [G], start int32 [] or None)`.

    Group `g` of `group_sizes` owns rows `[ends[g] - sizes[g], ends[g])` with
    `ends = cumsum(sizes)`; this call computes groups `[o, o + G)` (`o` =
    `group_offset`, default 0, G = rhs's groups), which are contiguous in row
    order, starting at `start = ends[o] - sizes[o]` (None without an offset: row
    0, known before tracing). Traced sizes are made valid the way concrete ones
    are required to be: negative sizes count as 0 and rows past M are dropped
    (the last groups shrink); groups of a traced offset outside `[0, G_all)` are
    empty.

    Example:
      >>> sizes, start = local_groups(jnp.array([3, 0, 4, 2]), 1, 2, M=10)
      >>> sizes.tolist(), int(start)
      ([0, 4], 3)
    """
    sizes = jnp.maximum(jnp.asarray(group_sizes).astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), M)  # [G_all]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    if group_offset is None:
        return ends - starts, None
    offset = jnp.asarray(group_offset).astype(jnp.int32).reshape(())
    index = offset + jnp.arange(num_local, dtype=jnp.int32)  # [G]
    inside = (index >= 0) & (index < sizes.shape[0])
    index = jnp.clip(index, 0, sizes.shape[0] - 1)
    local = jnp.where(inside, ends[index] - starts[index], 0)
    # A traced offset past the end still gets a start in [0, M]: after every row.
    start = jnp.where(inside[0], starts[index[0]], jnp.where(offset < 0, 0, ends[-1]))
    return local, start.astype(jnp.int32)


def row_groups(sizes, start, M: int):
    """`[M]` int32: the local group of each row, or -1 for rows no local group owns."""
    start = jnp.zeros((), jnp.int32) if start is None else start
    ends = start + jnp.cumsum(sizes)  # [G]
    rows = jnp.arange(M, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    owned = (rows >= start) & (group < sizes.shape[0])
    return jnp.where(owned, group, -1)


def differentiable(forward, transposed):
    """The op with its custom VJP, from a backend's two kernels.

        out = gmm(lhs, rhs)             out[m] = lhs[m] @ rhs[g(m)] (0 for rows no group owns)
        d lhs = gmm(d_out, rhs^T)       the same kernel with rhs's layout flipped
        d rhs = tgmm(lhs, d_out)        d rhs[j] = lhs[rows of j]^T @ d_out[rows of j]

    (with `transpose_rhs`, d rhs = tgmm(d_out, lhs), `[G, N, K]`). Empty groups
    get zero gradients; `sizes` and `start` get none.

    Args:
      forward: `(config, lhs, rhs, sizes, start) -> out [M, N]` in `config.out_dtype`,
        reading rhs as `config.transpose_rhs` says.
      transposed: `(config, x [M, A], y [M, B], sizes, start, out_dtype) -> [G, A, B]`,
        `out[j] = x[rows of j]^T @ y[rows of j]` (zero for empty groups).

    Returns:
      `(config, lhs, rhs, sizes, start) -> out`, differentiable in lhs and rhs.

    Example:
      >>> from shardfuse.kernels.grouped_matmul import xla
      >>> gmm = differentiable(xla.forward, xla.transposed)
      >>> config = GroupedMatmulConfig(out_dtype=jnp.dtype(jnp.float32))
      >>> lhs, rhs = jnp.ones((5, 3)), jnp.ones((2, 3, 4))
      >>> sizes = jnp.array([2, 3], jnp.int32)
      >>> jax.grad(lambda r: gmm(config, lhs, r, sizes, None).sum())(rhs)[:, 0, 0].tolist()
      [2.0, 3.0]
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def grouped(config, lhs, rhs, sizes, start):
        return forward(config, lhs, rhs, sizes, start)

    def grouped_fwd(config, lhs, rhs, sizes, start):
        return forward(config, lhs, rhs, sizes, start), (lhs, rhs, sizes, start)

    def grouped_bwd(config, residuals, d_out):
        lhs, rhs, sizes, start = residuals
        d_out = d_out.astype(lhs.dtype)  # the products run in the inputs' dtype
        flipped = dataclasses.replace(
            config, out_dtype=jnp.dtype(lhs.dtype), transpose_rhs=not config.transpose_rhs
        )
        d_lhs = forward(flipped, d_out, rhs, sizes, start)
        if config.transpose_rhs:
            d_rhs = transposed(config, d_out, lhs, sizes, start, jnp.dtype(rhs.dtype))
        else:
            d_rhs = transposed(config, lhs, d_out, sizes, start, jnp.dtype(rhs.dtype))
        return d_lhs, d_rhs, None, None

    grouped.defvjp(grouped_fwd, grouped_bwd)

    def grouped_matmul(config, lhs, rhs, sizes, start):
        lhs, rhs, sizes, start = vma.match_varying(lhs, rhs, sizes, start)
        return grouped(config, lhs, rhs, sizes, start)

    return grouped_matmul
