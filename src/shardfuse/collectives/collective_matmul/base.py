"""Shared pieces of the collective matmuls: validation, the static ring plan, one vma for x and w.

Every implementation receives inputs that `validate` has already checked and
a `RingPlan`, so a backend only raises `NotImplementedError`, never `ValueError`.

Axis glossary: M the gathered / scattered axis of x (any axis but the last),
m = M / N its per-device chunk, C the contracted dim (last of x, first of w),
N the ring size (the size of mesh axis `axis_name`); the columns of w are
written `F` where N would be ambiguous.
"""

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from shardfuse.kernels import vma
from shardfuse.kernels.precision import SUPPORTED_DTYPES

IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class Lane:
    """One direction of a ring: rows `[lo, hi)` of every chunk travel to device `i + direction`."""

    direction: int  # +1: device i sends to i + 1; -1: to i - 1
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """The static schedule of one collective matmul on one mesh axis.

    Attributes:
      axis_name: the mesh axis the ring runs over.
      size: N, the number of devices on it.
      axis: the (non-negative) axis of x that is gathered or scattered.
      chunk: m, rows of that axis per device chunk.
      lanes: one `Lane` (unidirectional) or two opposite ones that split each
        chunk in halves (bidirectional).
    """

    axis_name: str
    size: int
    axis: int
    chunk: int
    lanes: tuple[Lane, ...]
    precision: lax.Precision | None = None  # of every chunk matmul (None: sf.matmul's default)


def make_plan(
    axis_name: str, size: int, axis: int, chunk: int, bidirectional: bool, precision=None
) -> RingPlan:
    """A ring plan; bidirectional needs chunks of 2 rows or more, else it runs one direction."""
    if bidirectional and chunk >= 2 and size > 1:
        half = chunk // 2
        lanes = (Lane(+1, 0, half), Lane(-1, half, chunk))
    else:
        lanes = (Lane(+1, 0, chunk),)
    return RingPlan(
        axis_name=axis_name, size=size, axis=axis, chunk=chunk, lanes=lanes, precision=precision
    )


def mesh_axis_size(axis_name, *, function: str) -> int:
    """The size of manual mesh axis `axis_name`, or a ValueError listing the axes there are."""
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{function}: axis_name={axis_name!r} must be the name (str) of one mesh axis"
        )
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()))
    if axis_name not in names:
        raise ValueError(
            f"{function}: axis_name={axis_name!r} is not an axis of the surrounding mesh; "
            f"its axes are {names}" + ("" if names else " (none: call it inside jax.shard_map)")
        )
    manual = tuple(getattr(mesh, "manual_axes", names))
    if axis_name not in manual:
        raise ValueError(
            f"{function}: mesh axis {axis_name!r} is not manual here (manual axes: {manual}); "
            "call it inside a jax.shard_map over that axis"
        )
    return int(dict(mesh.shape)[axis_name])


def check_operands(x, w, *, function: str):
    """x `[..., C]` (rank >= 2) and w `[C, F]` of one supported float dtype."""
    for name, value in (("x", x), ("w", w)):
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise TypeError(f"{function}: {name} must be an array, got {type(value).__name__}")
        if jnp.dtype(value.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{function}: {name} has dtype {value.dtype}; "
                "supported dtypes are float32, bfloat16 and float16"
            )
    if x.ndim < 2:
        raise ValueError(
            f"{function}: x has rank {x.ndim} (shape {tuple(x.shape)}); expected [..., M, C]"
        )
    if w.ndim != 2:
        raise ValueError(
            f"{function}: w has rank {w.ndim} (shape {tuple(w.shape)}); expected [C, F]"
        )
    if x.dtype != w.dtype:
        raise TypeError(f"{function}: x and w must share one dtype; got {x.dtype} and {w.dtype}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{function}: contracted dims differ: x {tuple(x.shape)} has C={x.shape[-1]}, "
            f"w {tuple(w.shape)} has C={w.shape[0]}"
        )


def normalize_axis(axis, ndim: int, *, name: str, function: str) -> int:
    """A non-negative row axis of x: any axis but the last (the contracted one)."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{function}: {name}={axis!r} must be an int")
    if not -ndim <= axis < ndim or axis % ndim == ndim - 1:
        raise ValueError(
            f"{function}: {name}={axis} is not valid for x of rank {ndim}: use an axis in "
            f"[{-ndim}, {ndim - 2}] other than the last (-1, the contracted dim C)"
        )
    return int(axis % ndim)


def check_flag(value, *, name: str, function: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{function}: {name}={value!r} must be a bool")
    return value


def check_implementation(implementation, *, function: str):
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{function}: implementation={implementation!r} is not one of "
            f"{[None, *IMPLEMENTATIONS]}"
        )


def common_varying(x, w, axis_name: str):
    """x and w cast to one vma (theirs and `axis_name`), so a custom_vjp's types line up."""
    axes = vma.common_axes(x, w) | {axis_name}
    return vma.to_varying(x, axes), vma.to_varying(w, axes)


def ring_vjp(forward, backward, *, name: str):
    """`op(x, w, plan, *static)` = `forward(x, w, plan, *static)` with the custom VJP `backward`.

    `op` first gives x and w the same varying mesh axes (`common_varying`) and
    runs under `jax.named_scope(name)`. The VJP saves `(x, w)`;
    `backward(x, w, dy, plan, *static) -> (dx, dw)` runs under
    `jax.named_scope(f"{name}_bwd")` and its results are cast to the dtypes of
    x and w. The `RingPlan` and `static` (mesh axes) are hashable and not
    differentiated.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def op(x, w, static):
        return forward(x, w, *static)

    def op_fwd(x, w, static):
        return forward(x, w, *static), (x, w)

    def op_bwd(static, residuals, dy):
        x, w = residuals
        with jax.named_scope(f"{name}_bwd"):
            dx, dw = backward(x, w, dy, *static)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    op.defvjp(op_fwd, op_bwd)

    def ring_op(x, w, plan: RingPlan, *static):
        x, w = common_varying(x, w, plan.axis_name)
        with jax.named_scope(name):
            return op(x, w, (plan, *static))

    return ring_op
