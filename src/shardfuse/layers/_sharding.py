"""Mesh plumbing shared by the layers: axis checks, input placement, sharded parameters.

A layer holds a mesh and the names of its axes. Inputs are placed on the
`PartitionSpec` a layer's `jax.shard_map` expects (`jax.sharding.reshard` on
meshes with Explicit axes, `with_sharding_constraint` on Auto ones), and
parameters are created already sharded: the initializer runs under `jax.jit`
with `out_shardings`, so no device ever holds a full copy first.

Manual regions. `sf.parallel` (pipeline, accumulation) runs whole models
inside ONE `jax.shard_map` over every axis of the mesh. There, a layer opens
no shard_map of its own: it calls its per-shard function directly on the
local arrays it is given (inputs and parameters are already this device's
shards, in the layer's documented specs), and input checks see local sizes.
A region manual over only some of the layer's axes is refused: JAX cannot
differentiate a shard_map nested in a partially manual one (the transpose
fails to verify), so the toolkit never builds one.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.sharding import axes_size, check_mesh_axes, spec_axes

# Moved down to `shardfuse.collectives.sharding` (public there: `shardfuse.parallel` uses them
# too); the layers keep calling them `_sharding.<name>`.
from shardfuse.collectives.sharding import check_activations as check_activations
from shardfuse.collectives.sharding import check_divisible as check_divisible
from shardfuse.collectives.sharding import in_manual_region as in_manual_region
from shardfuse.collectives.sharding import manual_axes as manual_axes
from shardfuse.collectives.sharding import place as place
from shardfuse.kernels.vma import to_varying
from shardfuse.layers._init_random import fused_key

DEFAULT_DATA_AXIS = axes.DATA
DEFAULT_SEQUENCE_AXIS = axes.SEQUENCE
DEFAULT_MODEL_AXIS = axes.MODEL


def is_variable(x) -> bool:
    """Whether `x` is an `nnx.Variable` (the `is_leaf` of trees of layer state)."""
    return isinstance(x, nnx.Variable)


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


def layer_axes(mesh, *, model_axis, data_axis, sequence_axis) -> tuple:
    """A layer's `(model_axis, data_axis, sequence_axis)`, checked against `mesh`.

    Each may be None, and the defaults ("model", "data", "sequence") become
    None on a mesh that lacks them (an absent axis has size 1: no tensor
    parallelism without a model axis). Raises ValueError naming the keyword
    when an explicitly named axis is missing or two keywords name the same
    axis.
    """
    model = optional_axis(mesh, model_axis, "model_axis", DEFAULT_MODEL_AXIS)
    data = optional_axis(mesh, data_axis, "data_axis", DEFAULT_DATA_AXIS)
    sequence = optional_axis(mesh, sequence_axis, "sequence_axis", DEFAULT_SEQUENCE_AXIS)
    check_mesh_axes(mesh, model_axis=model, data_axis=data, sequence_axis=sequence)
    return model, data, sequence


def sequence_spec(sequence_axis, model_axis, parallel: bool):
    """PartitionSpec entry of the T dimension: `sequence_axis`, and `model_axis` too if `parallel`.

    None, one axis name, or the tuple `(sequence_axis, model_axis)`
    (Megatron sequence parallelism inside the context-parallel split).
    """
    axes = tuple(a for a in (sequence_axis, model_axis if parallel else None) if a)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def canonical_spec(spec) -> P:
    """`spec` with its trailing None entries stripped: `P(None)` -> `P()`, `P(m, None)` -> `P(m)`.

    The form a jitted computation gives its outputs. Every parameter of the
    layers is created with it, so that a training step handing the
    parameters back gives them the very sharding they came in with: a step
    that compiled for `P("model", None)` would otherwise compile again for
    the `P("model")` it returned (the two are equivalent but unequal). (On
    Explicit axes an array's sharding shows its type, one entry per
    dimension, whatever spec made it; the specs agree up to trailing Nones.)
    """
    spec = P() if spec is None else spec
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries, unreduced=spec.unreduced, reduced=spec.reduced)


def sharded_param(initializer, key, shape, dtype, mesh, spec: P) -> nnx.Param:
    """An `nnx.Param` created directly with sharding `spec` and carrying it as metadata.

    `nnx.get_partition_spec` reports `spec`; the value is made by a jitted
    initializer with `out_shardings`, so it never exists unsharded. A
    threefry `key` reaches the initializer as `_init_random.fused_key(key)`:
    the same values (they depend on the key only, not on the mesh), generated
    by one fused loop into each device's shard, so creating a parameter (or a
    whole model, `sf.parallel.zero.init`) needs almost no memory beyond the
    parameter's shards.

    Args:
      initializer: `initializer(key, shape, dtype) -> array`, e.g. an
        `nnx.initializers` function.
      key: a PRNG key.
      shape, dtype: the parameter's global shape and dtype.
      mesh, spec: where it lives: `NamedSharding(mesh, spec)`, stored in its
        canonical form (`canonical_spec`: trailing Nones stripped).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from jax.sharding import PartitionSpec as P
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
      >>> w = sf.layers.sharded_param(nnx.initializers.lecun_normal(), jax.random.key(0),
      ...                             (16, 8), jnp.float32, mesh, P("fsdp", "model"))
      >>> w[...].sharding.spec, w[...].addressable_shards[0].data.shape
      (P('fsdp', 'model'), (4, 4))
    """
    spec = canonical_spec(spec)
    make = jax.jit(
        lambda key: initializer(fused_key(key), shape, dtype),
        out_shardings=NamedSharding(mesh, spec),
    )
    return nnx.Param(make(key), out_sharding=spec, mesh=mesh)


def param_maker(rngs: nnx.Rngs, dtype, mesh):
    """`make(initializer, shape, spec)`: a `sharded_param` in `dtype` on `mesh`, keyed by `rngs`."""

    def make(initializer, shape, spec: P) -> nnx.Param:
        return sharded_param(initializer, rngs.params(), shape, dtype, mesh, spec)

    return make


def shard_map_call(local, mesh, args, in_specs, out_specs):
    """`jax.shard_map(local)` over `mesh` on `args`, each placed on its entry of `in_specs`.

    `args` and `in_specs` match entry by entry; an entry may be a list of
    arrays with a list of specs, and None arguments stay None (absent biases).
    In a manual region (`in_manual_region`) `args` are already the local
    shards and `local(*args)` runs directly.
    """
    if in_manual_region(mesh):
        # As shard_map would type them: each input varies over the axes its spec names
        # (an axis of size 1 included, e.g. a "sequence" axis the caller did not split).
        return local(*(_as_sharded(a, s) for a, s in zip(args, in_specs, strict=True)))

    def put(value, spec):
        if value is None:
            return None
        if isinstance(spec, P):
            return place(value, mesh, spec)
        return [put(v, s) for v, s in zip(value, spec, strict=True)]

    fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)
    return fn(*(put(a, s) for a, s in zip(args, in_specs, strict=True)))


def _as_sharded(value, spec):
    """`value` (an array, None, or a list matching a list of specs) varying over `spec`'s axes."""
    if value is None:
        return None
    if not isinstance(spec, P):
        return [_as_sharded(v, s) for v, s in zip(value, spec, strict=True)]
    return to_varying(value, frozenset(spec_axes(spec)))


def compute_dtype(dtype, *arrays):
    """The layer's compute dtype: `dtype`, else the promoted dtype of the inputs."""
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(*arrays)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compiled(graphdef, method: str, state, args):
    return getattr(nnx.merge(graphdef, state), method)(*args)


def call_compiled(module: nnx.Module, method: str, *args):
    """`module.<method>(*args)` through one `jax.jit` per layer configuration.

    The parameters are inputs of the compiled function (`nnx.split`), never
    constants baked into it, and the module's structure and static settings
    (its `GraphDef`) are the cache key: every layer with the same
    configuration shares one compiled program per input shape. Eager calls
    thus run one compiled program instead of dispatching each op of the
    shard_map body (ring loops included) one at a time; under `nnx.jit`,
    `jax.jit` or `nnx.grad` the inner jit is simply inlined into the trace.
    """
    graphdef, state = nnx.split(module)
    return _compiled(graphdef, method, state, args)


def empty_output(x, shape, mesh, spec: P):
    """Zeros of `shape` in x's dtype, sharded `spec` on `mesh` (the result for empty inputs).

    Made inside a `jax.shard_map` over the concrete mesh: with no other op
    naming the mesh, that is what tells a jit without `jax.set_mesh` which
    devices the output lives on. In a manual region `shape` is local except
    for its last dimension, which is divided over the axes `spec` gives it.
    """
    if in_manual_region(mesh):
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        last = entries[-1]
        size = axes_size(mesh, (last,) if isinstance(last, str) else last)
        return jnp.zeros((*shape[:-1], shape[-1] // size), x.dtype)
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [
        size // axes_size(mesh, (entry,) if isinstance(entry, str) else entry)
        for size, entry in zip(shape, entries, strict=True)
    ]
    make = jax.shard_map(lambda: jnp.zeros(local, x.dtype), mesh=mesh, in_specs=(), out_specs=spec)
    return make()


def place_on_mesh(node, mesh):
    """Puts every array of `node` that is not yet on `mesh` onto it, replicated; returns `node`.

    `node` is an NNX object (a model, an `nnx.Optimizer`) or a pytree of
    arrays. Arrays already sharded on `mesh` keep their sharding. Call it once
    on a freshly built `nnx.Optimizer`: optax and NNX create their step
    counters on one device, a jitted training step hands them back on the
    mesh, and that change of input sharding would make the second step
    compile again. (Building the optimizer inside `with jax.set_mesh(mesh):`
    has the same effect.)

    Example usage::

      >>> import jax, optax
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((1,), ("model",))
      >>> model = sf.layers.ColumnParallelLinear(4, 8, mesh=mesh, rngs=nnx.Rngs(0))
      >>> opt = sf.layers.place_on_mesh(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param), mesh)
      >>> opt.step[...].sharding.spec
      P()
    """
    replicated = NamedSharding(mesh, P())

    def put(x):
        if not isinstance(x, jax.Array):
            return x
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return jax.device_put(x, replicated)

    # (an NNX module or optimizer is an `nnx.Pytree`, no longer an `nnx.Object`, in flax 0.12:
    # updated in place, so that the caller's own reference is the one placed)
    if isinstance(node, (nnx.Object, nnx.Pytree)):
        nnx.update(node, jax.tree.map(put, nnx.state(node)))
        return node
    return jax.tree.map(put, node)
