"""Mesh plumbing shared by the layers: axis checks, input placement, sharded parameters.

A layer holds a mesh and the names of its axes. Inputs are placed on the
`PartitionSpec` a layer's `jax.shard_map` expects (`jax.sharding.reshard` on
meshes with Explicit axes, `with_sharding_constraint` on Auto ones), and
parameters are created already sharded: the initializer runs under `jax.jit`
with `out_shardings`, so no device ever holds a full copy first.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

DEFAULT_DATA_AXIS = "data"
DEFAULT_SEQUENCE_AXIS = "sequence"


def axis_size(mesh, name) -> int:
    """Size of mesh axis `name` (1 for None)."""
    return 1 if name is None else int(mesh.shape[name])


def require_axis(mesh, name, argument: str):
    """Checks that `name` is an axis of `mesh`; returns it."""
    if not isinstance(name, str) or name not in mesh.axis_names:
        raise ValueError(
            f"{argument}={name!r} is not an axis of the mesh; its axes are {tuple(mesh.axis_names)}"
        )
    return name


def optional_axis(mesh, name, argument: str, default: str):
    """An axis that may be absent: None, or the default name when the mesh lacks it.

    An explicitly chosen name (not the default) must exist in the mesh.
    """
    if name is None:
        return None
    if name == default and name not in mesh.axis_names:
        return None
    return require_axis(mesh, name, argument)


def check_divisible(argument: str, value: int, axis: str | None, size: int):
    if size > 1 and value % size != 0:
        raise ValueError(
            f"{argument}={value} must be divisible by the size {size} of mesh axis {axis!r}"
        )


def _explicit(mesh) -> bool:
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def place(x, mesh, spec: P):
    """Puts `x` on `NamedSharding(mesh, spec)` (a no-op when it is already there)."""
    sharding = NamedSharding(mesh, spec)
    if _explicit(mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def sharded_param(initializer, key, shape, dtype, mesh, spec: P) -> nnx.Param:
    """An `nnx.Param` created directly with sharding `spec` and carrying it as metadata.

    `nnx.get_partition_spec` reports `spec`; the value is made by a jitted
    initializer with `out_shardings`, so it never exists unsharded.
    """
    make = jax.jit(
        lambda key: initializer(key, shape, dtype), out_shardings=NamedSharding(mesh, spec)
    )
    return nnx.Param(make(key), out_sharding=spec, mesh=mesh)


def replicated_param(initializer, key, shape, dtype, mesh) -> nnx.Param:
    return sharded_param(initializer, key, shape, dtype, mesh, P())


def compute_dtype(dtype, *arrays):
    """The layer's compute dtype: `dtype`, else the promoted dtype of the inputs."""
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(*arrays)
