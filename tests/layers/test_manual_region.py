"""Layers inside a `jax.shard_map` over every mesh axis (how `sf.parallel` runs models).

There a layer runs its per-shard function on the local shards it is given;
the result, gathered, must equal the same layer called normally, forward and
gradients; a partially manual region is refused with a clear error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import _sharding


def _block(mesh, **kwargs):
    return sf.layers.ParallelTransformerBlock(
        16, 4, 32, num_kv_heads=2, mesh=mesh, rngs=nnx.Rngs(0), **kwargs
    )


def _per_shard(block, mesh, x):
    """`block(x)` run inside one shard_map over all of `mesh`'s axes."""
    graphdef, state = nnx.split(block)
    state_specs = nnx.get_partition_spec(state)
    spec = block.io_spec()

    def local(state, x):
        return nnx.merge(graphdef, state)(x)

    x = _sharding.place(x, mesh, spec)
    return jax.shard_map(local, mesh=mesh, in_specs=(state_specs, spec), out_specs=spec)(state, x)


_DSM = ((2, 2, 2), ("data", "sequence", "model"), dict(sequence_parallel=True))
_PM = ((2, 4), ("pipeline", "model"), {})


@pytest.mark.parametrize(
    "explicit, shape, names, kwargs",
    [
        pytest.param(True, *_DSM, id="data-sequence-model-explicit"),
        pytest.param(False, *_PM, id="pipeline-model-auto", marks=pytest.mark.slow),
        pytest.param(False, *_DSM, id="data-sequence-model-auto", marks=pytest.mark.slow),
        pytest.param(True, *_PM, id="pipeline-model-explicit", marks=pytest.mark.slow),
    ],
)
def test_block_in_full_manual_region_matches_normal_call(explicit, shape, names, kwargs):
    types = None if explicit else (AxisType.Auto,) * len(shape)
    mesh = jax.make_mesh(shape, names, axis_types=types)
    block = _block(mesh, **kwargs)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16), jnp.float32)
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

    def normal(block, x):
        return jnp.sum(block(x) * cotangent)

    def manual(block, x):
        return jnp.sum(_per_shard(block, mesh, x) * cotangent)

    want, (want_block, want_x) = jax.jit(nnx.value_and_grad(normal, argnums=(0, 1)))(block, x)
    got, (got_block, got_x) = jax.jit(nnx.value_and_grad(manual, argnums=(0, 1)))(block, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_x, want_x, rtol=2e-5, atol=2e-5)
    for (path, g), (_, w) in zip(
        jax.tree.leaves_with_path(nnx.state(got_block)),
        jax.tree.leaves_with_path(nnx.state(want_block)),
        strict=True,
    ):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=str(path))
        assert g.sharding.spec == w.sharding.spec, path


def test_partially_manual_region_is_refused():
    mesh = jax.make_mesh((2, 4), ("pipeline", "model"))
    block = _block(mesh)
    # Placed as in_specs says: newer JAX no longer reshards a shard_map's inputs implicitly.
    x = jax.device_put(jnp.ones((4, 8, 16)), NamedSharding(mesh, P("pipeline")))

    def body(x):
        return block(x)

    partial = jax.shard_map(
        body, mesh=mesh, in_specs=P("pipeline"), out_specs=P("pipeline"), axis_names={"pipeline"}
    )
    with pytest.raises(NotImplementedError, match="every axis of its mesh"):
        jax.jit(partial)(x)
