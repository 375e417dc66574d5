"""ZeRO on the optimizer's side: which training state is sharded over the `fsdp` mesh axis.

ZeRO (Rajbhandari et al. 2020) over an `fsdp` axis, whose devices split the
batch like data-parallel devices:

| zero | parameters | gradients | optimizer state |
|---|---|---|---|
| 0 | replicated | replicated (all-reduced) | replicated |
| 1 | replicated | replicated (all-reduced) | sharded |
| 2 | replicated | sharded (reduce-scattered) | sharded |
| 3 | sharded, gathered just in time per layer | sharded (reduce-scattered) | sharded |

The optimizer state is `ZeroOptimizer`'s, the gradients `accumulate(zero=...)`'s
(`shardfuse.parallel.accumulate`), the parameters the layers' (`zero=3`). The
stages, their check and a stage resolved on a mesh (`ZeroOptions`), and what
ZeRO does inside the forward and backward passes, live on the model's side of
the optimizer boundary, `shardfuse.layers.fsdp`; this module is the other side:
the shardings of the state and of the gradients, the optimizer, `init`. Each
entry point resolves its `zero=` once (`fsdp.zero_options`), and takes a
`ZeroOptions` resolved already as it is (`parallelize` resolves the run's once).

"Sharded" adds the fsdp axis to an array's PartitionSpec on its first
dimension that it divides (`shard_spec`); an array with no such dimension
(a scalar step count, a dimension too small) stays replicated. ZeRO-3
parameters are the layers' business (`zero=3` on `shardfuse.layers`,
`shardfuse.layers.fsdp`); a plain `nnx.Param` (an embedding) is sharded by
giving it that spec (`nnx.Param(value, out_sharding=P("fsdp", None), mesh=mesh)`),
and `accumulate` gathers it on entry.

`ZeroOptimizer` is an `nnx.Optimizer` whose state is born sharded (its
`tx.init` runs under `jax.jit` with `out_shardings`) and whose `update`
computes the update on the shards (ZeRO-1/2/3), then puts each parameter
back on its own sharding (for replicated parameters: the all-gather of
ZeRO-1/2). `init` creates a model (and optimizer) in one jitted program
with `out_shardings`, so no device ever holds more than its shards.
"""

import warnings

import jax
import optax
from flax import nnx
from flax.nnx.training.optimizer import OptState, to_opt_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.sharding import entry_axes, is_spec, place
from shardfuse.layers.fsdp import ZeroOptions, fsdp_axis_on, zero_options
from shardfuse.layers.stack import STACKED


def fsdp_axis_of(mesh, fsdp_axis):
    """Deprecated: `shardfuse.layers.fsdp.fsdp_axis_on`, the one rule of the fsdp axis."""
    warnings.warn(
        "sf.parallel.zero.fsdp_axis_of is deprecated and will be removed in the next release: "
        "use sf.layers.fsdp.fsdp_axis_on",
        DeprecationWarning,
        stacklevel=2,
    )
    return fsdp_axis_on(mesh, fsdp_axis)


def shard_spec(spec, shape, mesh, axis, *, first_dim: int = 0) -> P:
    """`spec` with mesh axis `axis` added on the first dimension of `shape` it divides.

    Dimensions from `first_dim` on are tried first, then those before it (a
    `Stack`'s parameters pass 1: a layer's slice of their gradient is then
    reduce-scattered on its own, inside the layer scan's backward). Unchanged
    when `axis` is None, of size 1, already in `spec`, or divides no
    dimension (after the axes already on it).
    """
    spec = P() if spec is None else spec
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if axis is None or mesh.shape[axis] == 1 or any(axis in entry_axes(e) for e in entries):
        return P(*entries)
    order = list(range(first_dim, len(shape))) + list(range(min(first_dim, len(shape))))
    for dim in order:
        size, entry = shape[dim], entries[dim]
        shards = 1
        for name in entry_axes(entry):
            shards *= mesh.shape[name]
        if size % (shards * mesh.shape[axis]) == 0:
            entries[dim] = axis if entry is None else (*entry_axes(entry), axis)
            return P(*entries)
    return P(*entries)


def param_specs(state):
    """PartitionSpecs of a state's arrays: their `out_sharding` metadata, else `P()`.

    Returns a pure pytree (the `nnx.as_pure` structure of `state`) of PartitionSpecs.
    """
    specs = nnx.as_pure(nnx.get_partition_spec(state))
    return jax.tree.map(lambda s: P() if s is None else s, specs, is_leaf=is_spec)


def sharded_specs(state, mesh, zero: ZeroOptions, *, stage: int = 1):
    """Specs of a state (params, gradients or optimizer moments) under ZeRO `zero`.

    Arrays are sharded over `zero.fsdp_axis` (`shard_spec`) when `zero.stage >=
    stage` (1 for the optimizer state, 2 for gradients), else they keep their
    own specs (`param_specs`). A `Stack`'s stacked parameters (metadata
    `STACKED`) are sharded on a dimension after the layer axis where one
    divides.
    """
    specs = param_specs(state)
    fsdp_axis = zero.fsdp_axis
    if zero.stage < stage or fsdp_axis is None:
        return specs
    arrays = nnx.as_pure(state)
    first_dims = nnx.as_pure(
        jax.tree.map(
            lambda v: nnx.Param(1 if v.get_metadata().get(STACKED) else 0),
            state,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    )
    return jax.tree.map(
        lambda spec, x, first: shard_spec(spec, x.shape, mesh, fsdp_axis, first_dim=first),
        specs,
        arrays,
        first_dims,
        is_leaf=is_spec,
    )


def put(tree, specs, mesh):
    """Each array of `tree` placed on its spec (`place`: reshard or constraint)."""
    return jax.tree.map(lambda x, s: place(x, mesh, s), tree, specs, is_leaf=is_spec)


class ZeroOptimizer(nnx.Optimizer):
    """An `nnx.Optimizer` whose state is sharded over `fsdp_axis` per ZeRO stage `zero`.

    `zero` 0: the state is sharded like the parameters (a plain
    `nnx.Optimizer`, but born on the mesh); 1, 2, 3: every state array
    (AdamW's moments) is sharded over `fsdp_axis` too (`shard_spec`). The
    state is created by `tx.init` under `jax.jit` with `out_shardings`, so no
    device holds it whole. `update(model, grads)` reshards the gradients and
    parameters to the state's sharding (a local slice when they are
    replicated), updates the shards, and puts each parameter back on its own
    sharding (ZeRO-1/2: an all-gather; ZeRO-3: nothing to do). Use it inside
    `nnx.jit` like an `nnx.Optimizer`.

    Args:
      model: the NNX model (its parameters carry their specs as metadata:
        `shardfuse.layers` do; `nnx.Param(..., out_sharding=spec, mesh=mesh)`).
      tx: an optax `GradientTransformation`.
      mesh: the mesh.
      zero: ZeRO stage 0 to 3, or the `shardfuse.layers.fsdp.ZeroOptions` of the
        run (a stage and its axis, resolved on the mesh: then `fsdp_axis` is
        not read).
      fsdp_axis: the axis the state is sharded over (default "fsdp";
        ignored when the mesh lacks it).
      wrt: the variables to optimize (default `nnx.Param`).

    Raises:
      ValueError: `zero` not in 0..3, or `fsdp_axis` not an axis of the mesh.

    Example usage::

      >>> import jax, optax
      >>> from flax import nnx
      >>> from shardfuse.layers import ColumnParallelLinear
      >>> from shardfuse.parallel.zero import ZeroOptimizer
      >>> mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
      >>> layer = ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
      >>> opt = ZeroOptimizer(layer, optax.adamw(1e-3), mesh=mesh, zero=1)
      >>> opt.opt_state[0].mu["kernel"][...].sharding.spec
      P('fsdp', 'model')
    """

    def __init__(self, model, tx, *, mesh, zero=1, fsdp_axis=axes.FSDP, wrt=nnx.Param):
        resolved = zero_options(mesh, zero=zero, fsdp_axis=fsdp_axis)
        self.zero, self.fsdp_axis = resolved.stage, resolved.fsdp_axis
        self.mesh = mesh
        self.graph = None
        self.tx = tx
        self.wrt = wrt
        replicated = NamedSharding(mesh, P())
        self.step = OptState(jax.device_put(jax.numpy.zeros((), jax.numpy.uint32), replicated))
        create, params = optimizer_state_program(model, tx, mesh=mesh, zero=resolved, wrt=wrt)
        self.opt_state = nnx.data(to_opt_state(create(params)))

    def update(self, model, grads, /, **kwargs):
        """Updates the state and the model's parameters from `grads` (see the class docstring)."""
        state = nnx.state(model, self.wrt)
        own_specs = param_specs(state)
        shard_specs = sharded_specs(state, self.mesh, ZeroOptions(self.zero, self.fsdp_axis))
        params = put(nnx.as_pure(state), shard_specs, self.mesh)
        grads = put(nnx.as_pure(nnx.state(grads, self.wrt)), shard_specs, self.mesh)
        updates, new_state = self.tx.update(
            grads, nnx.as_pure(self.opt_state), params, **nnx.as_pure(kwargs)
        )
        new_params = put(optax.apply_updates(params, updates), own_specs, self.mesh)
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_state))
        self.step[...] += 1
        return updates


def optimizer_state_program(model, tx, *, mesh, zero=1, fsdp_axis=axes.FSDP, wrt=nnx.Param):
    """`(create, params)`: `create(params)` is the jitted `tx.init` that `ZeroOptimizer` runs.

    Its `out_shardings` put every state array that mirrors a parameter on
    that parameter's ZeRO-`zero` spec (`sharded_specs`), and the rest (step
    counts) replicated, so the state is born sharded:
    `create.lower(params).compile().memory_analysis()` is its memory per device.

    Args:
      model, tx, mesh, zero, fsdp_axis, wrt: as `ZeroOptimizer`.

    Returns:
      The jitted initializer and the pure pytree of the model's `wrt` arrays.

    Example usage::

      >>> import jax, optax
      >>> from flax import nnx
      >>> from shardfuse.layers import ColumnParallelLinear
      >>> from shardfuse.parallel.zero import optimizer_state_program
      >>> mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
      >>> layer = ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
      >>> create, params = optimizer_state_program(layer, optax.adam(1e-3), mesh=mesh, zero=1)
      >>> create(params)[0].mu["kernel"].sharding.spec
      P('fsdp', 'model')
    """
    zero = zero_options(mesh, zero=zero, fsdp_axis=fsdp_axis)
    replicated = NamedSharding(mesh, P())
    params = nnx.as_pure(nnx.state(model, wrt))
    specs = sharded_specs(nnx.state(model, wrt), mesh, zero)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
    abstract = jax.eval_shape(tx.init, params)
    out_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract,
        shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )

    def init(params):
        # Each state array placed on its spec inside the program as well, so that the
        # traced types carry the ZeRO sharding: under `nnx.eval_shape` (abstract state,
        # memory planning) an explicit mesh's output types followed the parameters'
        # shardings, not `out_shardings` (ZeRO-1 moments came out unsharded over fsdp).
        return jax.tree.map(
            lambda x, sharding: place(x, mesh, sharding.spec), tx.init(params), out_shardings
        )

    return jax.jit(init, out_shardings=out_shardings), params


def init(make_model, *, tx=None, mesh=None, zero: int = 0, fsdp_axis=axes.FSDP):
    """Creates `make_model()` in one jitted program whose outputs are its sharded parameters.

    Every array is an output of `jax.jit` with `out_shardings` taken from the
    parameters' metadata (the specs the layers give them), so no device ever
    holds more than its shards. Values depend on the seed only, not on the
    mesh (`jax_threefry_partitionable`, JAX's default), and equal those of
    the model built eagerly. Parameters made by `shardfuse.layers` (and
    `sf.layers.sharded_param`) are generated by one fused loop per shard, so
    the compiled program's peak memory per device (output + temporaries,
    `init_program`) stays within 1.1x of the sharded state (1.005x for a
    tiny LM on 8 devices, `tests/parallel/test_init.py`). With `tx`, also a
    `ZeroOptimizer(model, tx, mesh=mesh, zero=zero, fsdp_axis=fsdp_axis)`,
    whose state is born sharded too (`optimizer_state_program`: no
    temporaries).

    Args:
      make_model: `make_model() -> nnx.Module`, e.g.
        `lambda: sf.models.Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))`.
      tx: optional optax transformation for the optimizer.
      mesh: the mesh (needed with `tx`).
      zero, fsdp_axis: as `ZeroOptimizer`.

    Returns:
      The model, or `(model, optimizer)` with `tx`.

    Example usage::

      >>> import jax, optax
      >>> from flax import nnx
      >>> from shardfuse.layers import ColumnParallelLinear
      >>> from shardfuse.parallel.zero import init
      >>> mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
      >>> make = lambda: ColumnParallelLinear(16, 32, mesh=mesh, zero=3, rngs=nnx.Rngs(0))
      >>> model, opt = init(make, tx=optax.adamw(1e-3), mesh=mesh, zero=3)
      >>> model.kernel[...].sharding.spec, opt.opt_state[0].nu["kernel"][...].sharding.spec
      (P('fsdp', 'model'), P('fsdp', 'model'))
    """
    graphdef, create = init_program(make_model)
    model = nnx.merge(graphdef, create())
    if tx is None:
        return model
    if mesh is None:
        raise ValueError("init(tx=...) needs mesh= (the mesh the optimizer state is sharded on)")
    return model, ZeroOptimizer(model, tx, mesh=mesh, zero=zero, fsdp_axis=fsdp_axis)


def init_program(make_model):
    """`(graphdef, create)`: `create()` is the jitted program `init` runs (its state's arrays).

    `create.lower().compile().memory_analysis()` gives the initialization's
    memory per device; `nnx.merge(graphdef, create())` is the model.

    Example usage::

      >>> import jax
      >>> from flax import nnx
      >>> from shardfuse.layers import ColumnParallelLinear
      >>> from shardfuse.parallel.zero import init_program
      >>> mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
      >>> make = lambda: ColumnParallelLinear(64, 32, mesh=mesh, zero=3, rngs=nnx.Rngs(0))
      >>> graphdef, create = init_program(make)
      >>> memory = create.lower().compile().memory_analysis()
      >>> memory.output_size_in_bytes >= (16 * 16 + 16) * 4  # this device's kernel, bias shards
      True
    """
    abstract = nnx.eval_shape(make_model)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(abstract_state, _mesh_of(abstract_state))

    def create():
        return nnx.split(make_model())[1]

    return graphdef, jax.jit(create, out_shardings=shardings)


def _mesh_of(state):
    """The mesh of the first array in `state` that carries one (its sharding metadata)."""
    for variable in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        mesh = getattr(variable, "mesh", None) or variable.get_metadata().get("mesh")
        if mesh is not None:
            return mesh
    raise ValueError("init: no parameter of the model carries a mesh (out_sharding metadata)")
