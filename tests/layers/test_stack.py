"""`Stack`: stacked, sharded parameters; applying it equals looping over the blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers.stack import Stack


def _block(mesh):
    return lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=mesh, rngs=rngs)


@pytest.mark.parametrize(
    "explicit, layer_axis, remat",
    [(True, "pipeline", "none"), pytest.param(False, None, "full", marks=pytest.mark.slow)],
)
def test_stack_equals_loop_over_blocks(explicit, layer_axis, remat):
    types = None if explicit else (AxisType.Auto, AxisType.Auto)
    mesh = jax.make_mesh((2, 2), ("pipeline", "model"), axis_types=types)
    stack = Stack(_block(mesh), 4, mesh=mesh, layer_axis=layer_axis, remat=remat, rngs=nnx.Rngs(0))
    kernel = stack.blocks.up.kernel
    assert kernel.shape == (4, 16, 32)
    assert kernel[...].sharding.spec == P(layer_axis, None, "model")
    assert nnx.get_partition_spec(nnx.state(stack.blocks)).up.kernel.get_value() == P(
        layer_axis, None, "model"
    )
    # layers differ (each from its own key)
    values = np.asarray(kernel[...])
    assert not np.allclose(values[0], values[1])
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)

    def stacked(stack, x):
        return jnp.sum(stack(x) * cotangent)

    graphdef, state = nnx.split(stack.blocks)
    host = jax.tree.map(np.asarray, state)

    def looped(layers, x):
        for layer in layers:
            x = nnx.merge(graphdef, layer)(x)
        return jnp.sum(x * cotangent)

    layers = [jax.tree.map(lambda a, i=i: jnp.asarray(a[i]), host) for i in range(4)]
    out, (grad_stack, grad_x) = nnx.jit(nnx.value_and_grad(stacked, argnums=(0, 1)))(stack, x)
    expected, (grad_layers, grad_x_ref) = jax.jit(jax.value_and_grad(looped, argnums=(0, 1)))(
        layers, x
    )
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad_x, grad_x_ref, rtol=2e-5, atol=2e-5)
    got = nnx.to_pure_dict(grad_stack)["blocks"]
    for i, layer in enumerate(grad_layers):
        for a, b in zip(
            jax.tree.leaves(jax.tree.map(lambda g, i=i: np.asarray(g)[i], got)),
            jax.tree.leaves(nnx.to_pure_dict(layer) if isinstance(layer, nnx.State) else layer),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_bad_arguments():
    mesh = jax.make_mesh((2, 2), ("pipeline", "model"))
    with pytest.raises(ValueError, match="num_layers=0 must be a positive integer"):
        Stack(_block(mesh), 0, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_layers=3 must be divisible by the size 2"):
        Stack(_block(mesh), 3, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="layer_axis='stage' is not an axis of the mesh"):
        Stack(_block(mesh), 2, mesh=mesh, layer_axis="stage", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="remat='most' is not a remat policy"):
        Stack(_block(mesh), 2, mesh=mesh, remat="most", rngs=nnx.Rngs(0))
