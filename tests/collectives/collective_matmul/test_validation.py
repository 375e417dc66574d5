"""Bad input to the collective matmuls: a clear error naming argument and value, before tracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from tests.collectives.collective_matmul.common import ring_mesh

OPS = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]


def _trace(per_shard, x, w, mesh=None):
    mesh = mesh or ring_mesh(2, data=2)
    f = jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    return jax.eval_shape(f, x, w)


@pytest.mark.parametrize("op", OPS)
def test_axis_absent_from_mesh_lists_the_axes(op):
    fn = getattr(sf.collectives, op)
    with pytest.raises(ValueError, match=r"axis_name='tensor' .* its axes are \('data', 'model'\)"):
        _trace(lambda x, w: fn(x, w, "tensor"), jnp.ones((4, 8)), jnp.ones((8, 4)))


@pytest.mark.parametrize("op", OPS)
def test_outside_shard_map(op):
    fn = getattr(sf.collectives, op)
    with pytest.raises(ValueError, match="call it inside jax.shard_map"):
        fn(jnp.ones((4, 8)), jnp.ones((8, 4)), "model")


def test_axis_not_manual():
    mesh = ring_mesh(2, data=2)
    f = jax.shard_map(
        lambda x, w: sf.collectives.all_gather_matmul(x, w, "data"),
        mesh=mesh,
        in_specs=(P("model"), P()),
        out_specs=P("model"),
        axis_names={"model"},
    )
    with pytest.raises(ValueError, match="mesh axis 'data' is not manual here"):
        jax.eval_shape(f, jnp.ones((4, 8)), jnp.ones((8, 4)))


def test_scatter_size_not_divisible():
    mesh = ring_mesh(4)
    with pytest.raises(ValueError, match=r"x.shape\[0\]=6 .* not divisible by the size 4 of mesh"):
        _trace(
            lambda x, w: sf.collectives.matmul_reduce_scatter(x, w, "model"),
            jnp.ones((6, 8)),
            jnp.ones((8, 4)),
            mesh=mesh,
        )


@pytest.mark.parametrize(
    "kwargs, x, w, error, match",
    [
        (dict(gather_axis=-1), (4, 8), (8, 4), ValueError, "gather_axis=-1 is not valid"),
        (dict(gather_axis=2), (4, 8), (8, 4), ValueError, r"gather_axis=2 .* \[-2, 0\]"),
        (dict(gather_axis=0.0), (4, 8), (8, 4), TypeError, "gather_axis=0.0 must be an int"),
        (dict(bidirectional=1), (4, 8), (8, 4), TypeError, "bidirectional=1 must be a bool"),
        (dict(implementation="nccl"), (4, 8), (8, 4), ValueError, "implementation='nccl'"),
        ({}, (8,), (8, 4), ValueError, r"x has rank 1"),
        ({}, (4, 8), (8, 4, 1), ValueError, r"w has rank 3"),
        ({}, (4, 8), (6, 4), ValueError, "x .* has C=8, w .* has C=6"),
    ],
)
def test_bad_arguments(kwargs, x, w, error, match):
    with pytest.raises(error, match=match):
        _trace(
            lambda x, w: sf.collectives.all_gather_matmul(x, w, "model", **kwargs),
            jnp.ones(x),
            jnp.ones(w),
        )


@pytest.mark.parametrize(
    "x, w, match",
    [
        (np.ones((4, 8), np.int32), np.ones((8, 4), np.int32), "x has dtype int32"),
        (jnp.ones((4, 8)), jnp.ones((8, 4), jnp.bfloat16), "x and w must share one dtype"),
    ],
)
@pytest.mark.parametrize("op", OPS)
def test_bad_dtypes(op, x, w, match):
    fn = getattr(sf.collectives, op)
    with pytest.raises(TypeError, match=match):
        _trace(lambda x, w: fn(x, w, "model"), x, w)


def test_axis_name_must_be_a_string():
    with pytest.raises(TypeError, match=r"axis_name=\('model',\) must be the name"):
        _trace(
            lambda x, w: sf.collectives.matmul_all_reduce(x, w, ("model",)),
            jnp.ones((4, 8)),
            jnp.ones((8, 4)),
        )


def test_docstring_examples():
    """The examples of the public collective matmuls run and say what they claim."""
    import doctest

    from shardfuse.collectives.collective_matmul import api

    result = doctest.testmod(api, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0, result
