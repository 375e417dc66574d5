"""Varying-manual-axes (vma) helpers: kernels that run inside `jax.shard_map`.

Inside `jax.shard_map` (with `check_vma`), each value carries the set of mesh
axes over which it varies. Loop carries and `lax.cond` branches must agree on
it, so a kernel whose inputs vary over different axes (q sharded over heads,
a replicated kv head) first casts them to one common set. The cast's
transpose sums the cotangent over the added axes, which is the gradient of
an input replicated over them. Outside `shard_map` every set is empty and
these are no-ops.
"""

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes over which `x` varies (empty outside shard_map)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # jax 0.11
    if vma is None:  # jax 0.10: ShapedArray.manual_axis_type.varying
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma) if vma is not None else frozenset()


def partitioned_axes(x) -> tuple[str, ...]:
    """The mesh axes (size > 1) of `x`'s mesh that XLA partitions, not `shard_map` (Auto or
    Explicit, not Manual): where a custom call without a partitioning rule would have its
    operands gathered onto every device. Empty for a value on one device or inside a
    `shard_map` over all of its mesh's axes.

    Example:
      >>> partitioned_axes(jax.numpy.ones(4))
      ()
    """
    mesh = jax.typeof(x).sharding.mesh
    return tuple(a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1)


def to_varying(x, axes: frozenset):
    """`x` cast to vary over `axes` as well (no-op when it already does)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    if not missing:
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, missing, to="varying")
    return lax.pvary(x, missing)  # older name of the same cast


def common_axes(*arrays) -> frozenset:
    """Union of the vma of every non-None array."""
    axes = frozenset()
    for x in arrays:
        if x is not None:
            axes |= varying_axes(x)
    return axes


def match_varying(*arrays):
    """Every non-None array cast to the union of their vma; None stays None."""
    axes = common_axes(*arrays)
    return tuple(None if x is None else to_varying(x, axes) for x in arrays)


def shape_dtype_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """`ShapeDtypeStruct` varying over the same manual mesh axes as `like` (a pallas_call's
    `out_shape` inside shard_map)."""
    aval = jax.typeof(like)
    axes = getattr(aval, "vma", None)  # jax 0.11
    if axes is not None:
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)
    return jax.ShapeDtypeStruct(shape, dtype)


def ffi_result(shape, dtype, like):
    """The result type of a `jax.ffi.ffi_call`: inside `shard_map`, varying over `like`'s axes.

    `ffi_call` builds its result types with `shaped_abstractify`, which refuses a
    `ShapeDtypeStruct` carrying manual axes without a mesh: `like`'s own type, reshaped,
    carries both.

    Example:
      >>> ffi_result((2, 3), "float32", jax.numpy.ones(4))
      ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """
    if not varying_axes(like):
        return jax.ShapeDtypeStruct(shape, dtype)
    aval = jax.typeof(like)
    spec = jax.sharding.PartitionSpec(*([None] * len(shape)))
    return aval.update(
        shape=shape,
        dtype=jax.numpy.dtype(dtype),
        sharding=jax.sharding.NamedSharding(aval.sharding.mesh, spec),
    )
