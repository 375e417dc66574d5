"""Bad inputs to ring attention: clear ValueError / TypeError naming argument and value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.collectives.ring_attention.api import ring_attention as ring_attention_shard
from tests.collectives.ring_attention.ring_cases import mesh_3d, ring_mesh

pytestmark = pytest.mark.timeout(120)

Q = jnp.zeros((2, 16, 4, 8))
KV = jnp.zeros((2, 16, 2, 8))


def _global(q=Q, k=KV, v=KV, **kwargs):
    kwargs.setdefault("mesh", ring_mesh(4))
    return sf.ring_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(sequence_axis="seq"),
            ValueError,
            r"sequence_axis='seq': axis 'seq' is not in the mesh.*\['sequence'\]",
        ),
        (dict(layout="spiral"), ValueError, "layout='spiral' is not one of"),
        (dict(strategy="tree"), ValueError, "strategy='tree' is not one of"),
        (dict(implementation="cuda"), ValueError, "implementation='cuda' is not one of"),
        (dict(data_axis="data"), ValueError, r"data_axis='data': axis 'data' is not in the mesh"),
        (dict(mesh="sequence"), TypeError, "mesh must be a jax.sharding.Mesh"),
        (dict(k=jnp.zeros((2, 16, 3, 8)), v=jnp.zeros((2, 16, 3, 8))), ValueError, "H=4.*K=3"),
        (dict(k=KV.astype(jnp.bfloat16)), TypeError, "share one dtype"),
        (dict(q=Q.astype(jnp.int32)), TypeError, "q has dtype int32"),
        (dict(q=Q[0]), ValueError, "q has rank 3"),
        (dict(window=(-1, 0)), ValueError, "window left=-1"),
        (dict(logit_softcap=0.0), ValueError, "logit_softcap=0.0"),
        (dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32)), ValueError, "pass both"),
    ],
)
def test_global_wrapper_bad_inputs(kwargs, error, match):
    with pytest.raises(error, match=match):
        _global(**kwargs)


def test_global_wrapper_bad_mesh_splits():
    mesh = mesh_3d()  # data 2, sequence 2, model 2
    with pytest.raises(ValueError, match=r"batch size B=3 must be a multiple of .*data.* 2"):
        _global(q=jnp.zeros((3, 16, 4, 8)), k=jnp.zeros((3, 16, 2, 8)), v=jnp.zeros((3, 16, 2, 8)),
                mesh=mesh, data_axis="data")  # fmt: skip
    with pytest.raises(ValueError, match=r"num heads H=3 must be a multiple of .*model.* 2"):
        _global(q=jnp.zeros((2, 16, 3, 8)), k=jnp.zeros((2, 16, 1, 8)), v=jnp.zeros((2, 16, 1, 8)),
                mesh=mesh, model_axis="model")  # fmt: skip
    with pytest.raises(ValueError, match=r"num kv heads K=3 must be a multiple"):
        _global(q=jnp.zeros((2, 16, 6, 8)), k=jnp.zeros((2, 16, 3, 8)), v=jnp.zeros((2, 16, 3, 8)),
                mesh=mesh, model_axis="model")  # fmt: skip
    with pytest.raises(ValueError, match="both use mesh axis 'sequence'"):
        _global(mesh=mesh, data_axis="sequence")


def test_float64_rejected_not_downcast():
    q = np.zeros((1, 8, 2, 4), np.float64)
    with pytest.raises(TypeError, match="q has dtype float64"):
        _global(q=q, k=q, v=q)


def test_empty_batch_returns_empty():
    q, kv = jnp.zeros((0, 16, 4, 8)), jnp.zeros((0, 16, 2, 8))
    out, lse = _global(q=q, k=kv, v=kv, return_lse=True, causal=True)
    assert out.shape == (0, 16, 4, 8) and lse.shape == (0, 4, 16)


def _in_shard_map(fn, n=4, local=4):
    mesh = ring_mesh(n)
    mapped = jax.shard_map(
        fn, mesh=mesh, in_specs=P(None, "sequence"), out_specs=P(None, "sequence"), check_vma=False
    )
    return mapped(jnp.zeros((1, n * local, 2, 8)), jnp.zeros((1, n * local, 2, 8)))


def test_per_shard_zigzag_needs_even_local_length():
    with pytest.raises(ValueError, match=r"layout='zigzag' needs even local lengths.*T=3"):
        _in_shard_map(
            lambda q, k: ring_attention_shard(q, k, k, "sequence", layout="zigzag"), local=3
        )


def test_per_shard_unbound_axis_names_the_bound_axes():
    with pytest.raises(ValueError, match=r"axis_name='context' is not a mesh axis.*\['sequence'\]"):
        _in_shard_map(lambda q, k: ring_attention_shard(q, k, k, "context"))


def test_per_shard_outside_shard_map():
    with pytest.raises(ValueError, match=r"axis_name='sequence' is not a mesh axis"):
        ring_attention_shard(Q, KV, KV, "sequence")


def test_per_shard_validates_before_tracing():
    with pytest.raises(ValueError, match="layout='zig' is not one of"):
        _in_shard_map(lambda q, k: ring_attention_shard(q, k, k, "sequence", layout="zig"))
    with pytest.raises(TypeError, match="causal=1 must be a bool"):
        _in_shard_map(lambda q, k: ring_attention_shard(q, k, k, "sequence", causal=1))


def test_explicit_mesh_needs_no_mesh_context_under_jit():
    # Was a ValueError asking for `jax.set_mesh`: the mesh passed in is enough now.
    mesh = Mesh(
        np.array(jax.devices()[:4]), ("sequence",), axis_types=(jax.sharding.AxisType.Explicit,)
    )
    out = jax.jit(lambda q: sf.ring_attention(q, KV, KV, mesh=mesh))(Q)
    assert out.shape == Q.shape and out.sharding.spec[1] == "sequence"
