"""A `Stack` of MoE blocks equals the same blocks looped: outputs, the aux losses that
`moe_stats` sums over the layers, tokens per expert and every gradient (aux losses in
the loss), under remat policies and on Explicit and Auto meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.testing import assert_close

MOE = dict(num_experts=4, top_k=2, shared_experts=1)
L = 3


def _stack(mesh, remat):
    block_options = dict(moe=MOE, mesh=mesh, remat="none")
    return sf.layers.Stack(
        lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 8, rngs=rngs, **block_options),
        L,
        mesh=mesh,
        remat=remat,
        rngs=nnx.Rngs(0),
    )


def _loss(x, ct):
    def loss(model, x):
        y = model(x)
        stats = sf.layers.moe_stats(model)
        aux = 0.1 * stats["load_balancing_loss"] + 0.01 * stats["router_z_loss"]
        return jnp.sum(y * ct) + aux, (stats["load_balancing_loss"], stats["router_z_loss"],
                                       jnp.stack(stats["tokens_per_expert"]))  # fmt: skip

    return loss


@pytest.mark.parametrize(
    "explicit, remat",
    [
        (True, "none"),
        (False, "full"),
        pytest.param(True, "selective", marks=pytest.mark.slow),
        pytest.param(True, "dots", marks=pytest.mark.slow),
    ],
)
def test_moe_stack_equals_the_looped_blocks(explicit, remat):
    types = None if explicit else (AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "model"), axis_types=types)
    stack = _stack(mesh, remat)
    assert stack.blocks.mlp.load_balancing_loss.shape == (L,)
    assert stack.blocks.mlp.tokens_per_expert.shape == (L, 4)
    x = jax.random.normal(jax.random.key(1), (4, 8, 16))
    ct = jax.random.normal(jax.random.key(2), x.shape)
    loss = _loss(x, ct)
    (value, aux), (grads, grad_x) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        stack, x
    )

    # the oracle: the same L blocks, unstacked, applied in a Python loop
    graphdef, state = nnx.split(stack.blocks)
    host = jax.tree.map(np.asarray, state)
    layers = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: jnp.asarray(a[i]), host))
              for i in range(L)]  # fmt: skip

    class Loop(nnx.Module):
        def __init__(self, layers):
            self.layers = nnx.List(layers)

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    loop = Loop(layers)
    (ref_value, ref_aux), (ref_grads, ref_grad_x) = nnx.jit(
        nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    )(loop, x)
    assert_close(np.asarray(value), np.asarray(ref_value), name="loss")
    assert_close(np.asarray(aux[0]), np.asarray(ref_aux[0]), name="load balancing loss")
    assert_close(np.asarray(aux[1]), np.asarray(ref_aux[1]), name="z loss")
    np.testing.assert_array_equal(aux[2], ref_aux[2])  # tokens per expert, per layer
    assert int(aux[2].sum()) == L * 4 * 8 * 2
    assert_close(np.asarray(grad_x), np.asarray(ref_grad_x), kind="grad", name="grad x")
    got = nnx.to_pure_dict(grads)["blocks"]
    for i in range(L):
        want = nnx.to_pure_dict(ref_grads)["layers"][i]
        leaves = jax.tree.leaves(jax.tree.map(lambda g, i=i: np.asarray(g)[i], got))
        ref_leaves = jax.tree.leaves(want)
        assert len(leaves) == len(ref_leaves) > 0
        for a, b in zip(leaves, ref_leaves, strict=True):
            assert_close(a, np.asarray(b), kind="grad", name=f"grad layer {i}")
    # the router's gradient holds the aux losses' part (not only the task loss's)
    router = np.asarray(got["mlp"]["router"])
    assert np.abs(router).max() > 0


def test_moe_stack_eager_call_writes_each_layers_stats():
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    stack = _stack(mesh, "none")
    stack(jax.random.normal(jax.random.key(1), (8, 8, 16)))
    stats = sf.layers.moe_stats(stack)
    assert len(stats["tokens_per_expert"]) == L
    assert [int(c.sum()) for c in stats["tokens_per_expert"]] == [8 * 8 * 2] * L
    assert float(stats["load_balancing_loss"]) >= L * 0.99  # >= 1 a layer (1: balanced)


def test_a_pipeline_of_moe_blocks_is_accepted():
    """(Issue 44: the schedules carry the aux losses; tests/parallel/test_pipeline_moe.py.)"""
    mesh = jax.make_mesh((2, 2), ("pipeline", "expert"))
    stack = sf.layers.Stack(
        lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 8, moe=MOE, mesh=mesh, rngs=rngs),
        2,
        mesh=mesh,
        layer_axis="pipeline",
        rngs=nnx.Rngs(0),
    )
    pipe = sf.parallel.Pipeline(stack, mesh=mesh, num_microbatches=2)
    assert pipe.stack.has_moe


def test_uneven_stages_plain_call_writes_the_real_layers_stats():
    """stage_layers=(2, 1): rows [0, 1, 2, -1]; a plain call writes rows 0-2, the padding
    row's statistics stay zero, and moe_stats counts the three real layers' tokens."""
    mesh = jax.make_mesh((2, 2), ("pipeline", "expert"))
    stack = sf.layers.Stack(
        lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 8, moe=MOE, mesh=mesh, rngs=rngs),
        3,
        mesh=mesh,
        layer_axis="pipeline",
        stage_layers=(2, 1),
        rngs=nnx.Rngs(0),
    )
    stack(jax.random.normal(jax.random.key(1), (4, 8, 16)))
    counts = np.asarray(stack.blocks.mlp.tokens_per_expert[...])
    assert counts.shape == (4, 4)
    assert counts.sum(1).tolist() == [4 * 8 * 2] * 3 + [0]
