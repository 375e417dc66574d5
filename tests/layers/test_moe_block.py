"""A transformer block whose MLP is a `ParallelMoE` (`ParallelTransformerBlock(moe=...)`),
against the unsharded reference block, aux losses included (a `Stack` of them:
tests/layers/test_moe_stack.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.layers import reference
from shardfuse.testing import assert_close
from tests.layers.common import assert_sharded_as, assert_trees_close

MOE = dict(num_experts=4, top_k=2, shared_experts=1, shared_expert_gate=True)


def _block(mesh, **kwargs):
    return sf.layers.ParallelTransformerBlock(16, 2, 8, moe=MOE, mesh=mesh, rngs=nnx.Rngs(0),
                                              **kwargs)  # fmt: skip


@pytest.mark.parametrize("sequence_parallel", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_moe_block_equals_the_reference_block(sequence_parallel):
    mesh = jax.make_mesh((2, 2, 2), ("data", "expert", "model"))
    block = _block(mesh, sequence_parallel=sequence_parallel)
    x = jax.random.normal(jax.random.key(1), (4, 8, 16))
    ct = jax.random.normal(jax.random.key(2), x.shape)

    def loss(m, x):
        y = m(x)
        stats = sf.layers.moe_stats(m)
        return jnp.sum(y * ct) + 0.1 * stats["load_balancing_loss"], (y, stats)

    (value, (y, stats)), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        block, x
    )
    p = reference.params(block)
    x0, ct0 = (jax.device_put(np.asarray(a), jax.devices()[0]) for a in (x, ct))

    def ref_loss(p, x):
        y = reference.transformer_block(block, p, x)
        attention_in = reference.norm(block.norm_1, p["norm_1"], x)
        h = x + reference.self_attention(block.attention, p["attention"], attention_in)
        _, ref_stats = reference.moe(
            block.mlp, p["mlp"], reference.norm(block.norm_2, p["norm_2"], h)
        )
        return jnp.sum(y * ct0) + 0.1 * ref_stats["load_balancing_loss"], (y, ref_stats)

    (ref_value, (ref_y, ref_stats)), ref_grads = jax.jit(
        jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True)
    )(p, x0)
    assert_sharded_as(y, mesh, block.io_spec())
    assert_close(np.asarray(y), np.asarray(ref_y), name="y")
    assert_close(np.asarray(stats["load_balancing_loss"]),
                 np.asarray(ref_stats["load_balancing_loss"]), name="aux")  # fmt: skip
    np.testing.assert_array_equal(stats["tokens_per_expert"][0], ref_stats["tokens_per_expert"])
    assert_trees_close(nnx.to_pure_dict(grads[0]), ref_grads[0], name="grad")
    assert_close(np.asarray(grads[1]), np.asarray(ref_grads[1]), kind="grad", name="grad x")


def test_a_stack_of_moe_blocks_refuses_prefetch_not_silent():
    mesh = jax.make_mesh((2, 2), ("expert", "fsdp"))
    with pytest.raises(ValueError, match="prefetch=True .* use prefetch=False"):
        sf.layers.Stack(
            lambda rngs: sf.layers.ParallelTransformerBlock(
                16, 2, 8, moe=MOE, mesh=mesh, zero=3, rngs=rngs
            ),
            2,
            mesh=mesh,
            prefetch=True,
            rngs=nnx.Rngs(0),
        )


def test_moe_block_needs_swiglu_without_bias():
    mesh = jax.make_mesh((2,), ("expert",))
    with pytest.raises(ValueError, match="activation='gelu'"):
        _block(mesh, activation="gelu")
