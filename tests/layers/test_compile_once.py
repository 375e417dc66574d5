"""A training step over shardfuse layers, written the natural NNX way, compiles once.

Issue 24: with `nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)` and an `nnx.jit`
step on a `Mesh(devices.reshape(2, 2, 2), ("data", "sequence", "model"))` (Auto axes), the
step compiled twice: the second call saw the parameters in the canonical specs the first
one returned (`P(None,)` -> `P()`, `P("model", None)` -> `P("model")`). The layers now
create every parameter in canonical form (`_sharding.canonical_spec`). The optimizer's
step counters, which optax and NNX create on one device, are put on the mesh as the
README says (`sf.layers.place_on_mesh`, which now updates the optimizer in place).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import shardfuse as sf
from shardfuse.layers.stack import Stack

F = 16


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "sequence", "model"))


class _Model(nnx.Module):
    """A few layers of every kind: a stack of blocks, a norm, column and row linear layers."""

    def __init__(self, mesh, rngs):
        def block(rngs):
            return sf.layers.ParallelTransformerBlock(F, 2, 2 * F, mesh=mesh, rngs=rngs)

        self.blocks = Stack(block, 2, mesh=mesh, rngs=rngs)
        self.block = block(rngs)
        self.norm = sf.layers.Norm(F, kind="layernorm", mesh=mesh, rngs=rngs)
        self.up = sf.layers.ColumnParallelLinear(F, 2 * F, mesh=mesh, rngs=rngs)
        self.down = sf.layers.RowParallelLinear(2 * F, F, mesh=mesh, rngs=rngs)

    def __call__(self, x):
        return self.down(self.up(self.norm(self.block(self.blocks(x)))))


def _is_canonical(spec):
    return not len(spec) or spec[-1] is not None


def test_parameters_are_created_with_canonical_specs():
    mesh = _mesh()
    model = _Model(mesh, nnx.Rngs(0))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for (path, spec), value in zip(
        jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, jax.P)),
        jax.tree.leaves(values),
        strict=True,
    ):
        assert _is_canonical(spec), (path, spec)
        assert value.sharding == NamedSharding(mesh, spec), (path, value.sharding, spec)
    assert model.norm.scale[...].sharding.spec == jax.P()
    assert model.down.kernel[...].sharding.spec == jax.P("model")
    assert model.blocks.blocks.mlp.down.kernel[...].sharding.spec == jax.P(None, "model")
    assert sf.layers.canonical_spec(jax.P("model", None, None)) == jax.P("model")
    assert sf.layers.canonical_spec(jax.P(None, "model")) == jax.P(None, "model")


def test_place_on_mesh_updates_the_optimizer_in_place():
    mesh = _mesh()
    model = sf.layers.ColumnParallelLinear(F, F, mesh=mesh, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    assert sf.layers.place_on_mesh(optimizer, mesh) is optimizer
    for leaf in jax.tree.leaves(nnx.state(optimizer)):
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh


def test_plain_nnx_optimizer_step_compiles_once():
    mesh = _mesh()
    model = _Model(mesh, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    sf.layers.place_on_mesh(optimizer, mesh)  # the step counters, as the README says

    @nnx.jit
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda model: jnp.mean(model(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    x = jax.random.normal(jax.random.key(1), (4, 16, F))
    losses = [float(train_step(model, optimizer, x))]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        losses += [float(train_step(model, optimizer, x)) for _ in range(2)]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
    assert compiles == [], f"{len(compiles)} compilations after the first of three steps"
    assert train_step.jitted_fn._cache_size() == 1  # one input signature over three steps
