"""Running a `shard_map` program on a given mesh, whatever the mesh context.

A global wrapper (`sf.ring_attention`, the layers) gets a mesh and must work
eagerly and under `jax.jit` / `jax.grad` / `jax.vjp`, with or without
`jax.set_mesh(mesh)`, on meshes whose axes are `AxisType.Explicit` (the
default of `jax.make_mesh`) or `Auto`. Two facts shape the helpers:

- `jax.shard_map(mesh=<concrete Mesh>)` needs no mesh context: the concrete
  mesh carries the devices. A traced `AbstractMesh` does not (under `jit`,
  inputs without a device then fail with "Length of device assignment").
- On Explicit axes every op types its output sharding, and reshapes, pads and
  slices of a sharded dimension are refused; `jax.sharding.auto_axes` runs a
  function with those axes made Auto. It needs a mesh: the context one, or
  the mesh of its `out_sharding` when that is a `NamedSharding` on a concrete
  mesh (which is how `run_on_mesh` calls it, so no context is needed).

`run_on_mesh(fn, mesh, out_specs)` combines the two: `fn(auto_mesh, *args)`
runs with every axis Auto (`auto_mesh` is the concrete mesh to hand to
`jax.shard_map`), and the outputs come back sharded as `out_specs` on `mesh`:
typed Explicit shardings when the inputs are typed on an Explicit mesh (or a
mesh context is set), a sharding constraint otherwise.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def explicit_axes(mesh) -> tuple:
    """Names of the mesh axes of type `AxisType.Explicit`."""
    return tuple(
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    )


def auto_mesh(mesh):
    """`mesh` with every Explicit axis made Auto (same devices and names; Manual axes kept)."""
    if not explicit_axes(mesh):
        return mesh
    types = tuple(AxisType.Auto if t == AxisType.Explicit else t for t in mesh.axis_types)
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=types)
    return mesh.update_axis_types(dict(zip(mesh.axis_names, types, strict=True)))


def check_mesh_axes(mesh, **axes) -> dict:
    """Each keyword's value (an axis name, a tuple of names, or None) as a tuple of names or None.

    Raises ValueError naming the keyword, its value and the mesh's axes when
    a name is not a mesh axis, or when two keywords use the same axis.
    """
    out, used = {}, {}
    for keyword, value in axes.items():
        if value is None:
            out[keyword] = None
            continue
        names = (value,) if isinstance(value, str) else tuple(value)
        for name in names:
            if name not in mesh.axis_names:
                raise ValueError(
                    f"{keyword}={value!r}: axis {name!r} is not in the mesh, whose axes are "
                    f"{list(mesh.axis_names)}"
                )
            if name in used:
                raise ValueError(
                    f"{used[name]} and {keyword}={value!r} both use mesh axis {name!r}: "
                    "each axis may shard one dimension only"
                )
            used[name] = f"{keyword}={value!r}"
        out[keyword] = names or None
    return out


def is_spec(x) -> bool:
    """True for a PartitionSpec or None (a pytree leaf of a tree of specs)."""
    return isinstance(x, P) or x is None


def entry_axes(entry) -> tuple:
    """Mesh axes of one PartitionSpec entry: None -> (), "a" -> ("a",), ("a", "b") -> itself."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec) -> tuple:
    """Every mesh axis a PartitionSpec names, in order."""
    return tuple(name for entry in spec for name in entry_axes(entry))


def axes_size(mesh, names) -> int:
    """Product of the sizes of mesh axes `names` (a tuple, or None: 1)."""
    return math.prod(mesh.shape[a] for a in names or ())


def divisible_spec(mesh, spec, shape) -> P:
    """`spec` with the axes dropped from each dimension they do not divide evenly."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    kept = []
    for entry, size in zip(entries, shape, strict=True):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept.append(entry if names and size % axes_size(mesh, names) == 0 else None)
    return P(*kept)


def typed_on_explicit_mesh(tree) -> bool:
    """Whether any array in `tree` is typed on a mesh with Explicit axes."""
    for x in jax.tree.leaves(tree):
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and explicit_axes(mesh):
            return True
    return False


def run_on_mesh(fn, mesh, out_specs):
    """`fn(auto_mesh, *args)` with `mesh`'s axes Auto; outputs sharded as `out_specs` on `mesh`.

    Works eagerly and under any transformation, with or without a mesh
    context (a context mesh, if set, must be `mesh`). Call it inside `jax.jit`
    when `fn` reshapes sharded arrays. `out_specs` is a pytree of
    PartitionSpecs matching `fn`'s outputs; on an Explicit mesh each must
    divide its dimensions evenly (Explicit types cannot express an uneven
    split: see `divisible_spec`).

    The outputs' sharding type follows the inputs: on an Explicit mesh they are
    typed Explicit when an input is already typed on an Explicit mesh or a mesh
    context is set; plain inputs (on no mesh) with no context get outputs
    sharded as `out_specs` by a constraint on the Auto version of the mesh, so
    that the caller's later ops (`jax.grad`'s scalar cotangent included) need no
    `jax.set_mesh`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2,), ("sequence",))  # Explicit axes
      >>> def fn(m, x):
      ...     return jax.shard_map(
      ...         lambda a: 2 * a, mesh=m, in_specs=P("sequence"), out_specs=P("sequence")
      ...     )(x)
      >>> y = jax.jit(run_on_mesh(fn, mesh, P("sequence")))(jnp.ones(4))
      >>> y.sharding.spec
      P('sequence',)
    """
    explicit = explicit_axes(mesh)
    concrete = auto_mesh(mesh)
    is_spec = lambda s: isinstance(s, P)  # noqa: E731

    @functools.wraps(fn)
    def run(*args):
        context = jax.sharding.get_abstract_mesh()
        if not explicit or (context.empty and not typed_on_explicit_mesh(args)):
            # Auto mesh, or plain inputs (on no mesh) with no mesh context: the outputs are
            # placed by a constraint, sharded as `out_specs` but not typed Explicit. Typing
            # them would make the caller's own ops on them need `jax.set_mesh` (e.g. the
            # scalar cotangent `jax.grad` creates), although the caller never chose the
            # Explicit mesh for its arrays: the output type follows the inputs.
            return jax.tree.map(
                lambda spec, x: jax.lax.with_sharding_constraint(x, NamedSharding(concrete, spec)),
                out_specs,
                fn(concrete, *args),
                is_leaf=is_spec,
            )
        if not context.empty and (context.axis_names, context.axis_sizes) != (
            mesh.axis_names,
            mesh.axis_sizes,
        ):
            raise ValueError(
                f"the mesh context (jax.set_mesh) has axes {dict(context.shape)}, but the mesh "
                f"passed in has {dict(mesh.shape)}: set that mesh, or none (none is needed)"
            )
        # A NamedSharding on the concrete mesh lets auto_axes run with no mesh context.
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs, is_leaf=is_spec)
        return jax.sharding.auto_axes(
            lambda *a: fn(concrete, *a), axes=explicit, out_sharding=shardings
        )(*args)

    return run


# ---- placing arrays for a layer, manual regions, input checks ------------------------------
# (used by `shardfuse.layers` and by `shardfuse.parallel`, which runs whole models of layers
# inside one shard_map over every mesh axis: a "manual region", see `shardfuse.layers`)


def manual_axes() -> frozenset:
    """Mesh axes that are manual in the current context (inside `jax.shard_map`)."""
    context = jax.sharding.get_abstract_mesh()
    return frozenset(getattr(context, "manual_axes", ()) or ())


def in_manual_region(mesh) -> bool:
    """True when every axis of `mesh` is manual here (the caller runs per shard).

    Raises:
      NotImplementedError: only some of the axes of `mesh` are manual.
    """
    manual = manual_axes() & set(mesh.axis_names)
    if not manual:
        return False
    missing = [name for name in mesh.axis_names if name not in manual]
    if missing:
        raise NotImplementedError(
            f"a shardfuse layer was called inside a jax.shard_map that is manual over "
            f"{sorted(manual)} but not over {missing}; call it inside a shard_map over "
            f"every axis of its mesh {tuple(mesh.axis_names)} (as sf.parallel does), or outside "
            "any shard_map: JAX cannot differentiate a shard_map nested in a partially manual one"
        )
    return True


def branches_may_hold_collectives(axis: str) -> bool:
    """Whether, inside a shard_map, a `lax.cond` on the index along `axis` may hold collectives.

    Every device with one index along `axis` takes the same branch, so a
    collective over the other axes inside a branch has all of its group. GPU
    (NCCL) and TPU runtimes meet per group; XLA:CPU's in-process runtime meets
    all devices of a collective op, whichever group they belong to (the
    rendezvous key's `global_devices` are every group's), so a group that skips
    the branch leaves the others waiting until its 40 s timeout aborts the
    process. So on CPU only when no other axis of the mesh has more than one
    device (no collective inside the branch can then reach another device).

    Example usage::

      >>> import jax
      >>> from shardfuse.collectives.sharding import branches_may_hold_collectives
      >>> branches_may_hold_collectives("pipeline")  # outside shard_map: no other axes
      True
    """
    context = jax.sharding.get_abstract_mesh()
    names = getattr(context, "axis_names", ()) or ()
    others = [n for n in names if n != axis and context.shape[n] > 1]
    return not others or jax.default_backend() != "cpu"


def check_divisible(argument: str, value: int, mesh, axes):
    """ValueError unless `value` divides evenly over mesh axes `axes` (a name, a tuple or None).

    In a manual region (`in_manual_region`) values are local sizes: no check.
    """
    if in_manual_region(mesh):
        return
    size = axes_size(mesh, (axes,) if isinstance(axes, str) else axes)
    if size > 1 and value % size != 0:
        raise ValueError(
            f"{argument}={value} must be divisible by the size {size} of mesh axis {axes!r}"
        )


def place(x, mesh, spec: P):
    """Puts `x` on `NamedSharding(mesh, spec)` (a no-op when it is already there).

    In a manual region `x` is already this device's shard and is returned as is.
    """
    if in_manual_region(mesh):
        return x
    sharding = NamedSharding(mesh, spec)
    if explicit_axes(mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def check_activations(x, argument: str = "x"):
    """TypeError unless `x` is a floating-point array (activations, not token ids)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{argument} has dtype {dtype}; expected floating-point activations "
            "(float32, bfloat16 or float16). Integer token ids go through an embedding first."
        )
