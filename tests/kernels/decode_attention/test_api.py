"""Dispatch and validation of `sf.decode_attention`: bad inputs fail clearly, before tracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels import registry
from shardfuse.kernels.decode_attention import api

Q = jnp.zeros((2, 3, 4, 8), jnp.float32)
KV = jnp.zeros((2, 24, 2, 8), jnp.float32)
LENGTHS = jnp.array([24, 5], jnp.int32)


def _call(q=Q, k=KV, v=KV, lengths=LENGTHS, **kwargs):
    return sf.decode_attention(q, k, v, lengths, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(q=jnp.zeros((3, 4, 8))), ValueError, r"q has rank 3 .*\[B, T, H, D\]"),
        (dict(k=jnp.zeros((2, 24, 2, 8, 1))), ValueError, r"k has rank 5"),
        (dict(v=jnp.zeros((2, 24, 2, 16))), ValueError, r"k and v must have the same shape"),
        (dict(k=jnp.zeros((3, 24, 2, 8)), v=jnp.zeros((3, 24, 2, 8))), ValueError, r"B=2.*B=3"),
        (dict(k=jnp.zeros((2, 24, 2, 4)), v=jnp.zeros((2, 24, 2, 4))), ValueError, r"D=8.*D=4"),
        (dict(k=jnp.zeros((2, 24, 3, 8)), v=jnp.zeros((2, 24, 3, 8))), ValueError, r"H=4 .* K=3"),
        (dict(q=Q.astype(jnp.bfloat16)), TypeError, r"share one dtype.*bfloat16"),
        (dict(q=Q.astype(jnp.int32)), TypeError, r"q has dtype int32"),
        (dict(lengths=jnp.array([24, 5, 1])), ValueError, r"lengths has shape \(3,\).*\(2,\)"),
        (dict(lengths=jnp.array(24)), ValueError, r"lengths has shape \(\).*\[B\] = \(2,\)"),
        (dict(lengths=jnp.array([24.0, 5.0])), TypeError, r"lengths has dtype float32"),
        (dict(lengths=24), TypeError, r"lengths must be an integer array \[B\]"),
        (
            dict(lengths=jnp.array([25, 5])),
            ValueError,
            r"lengths=\[25, 5\] must lie in \[0, S\] = \[0, 24\]",
        ),
        (dict(lengths=[-1, 5]), ValueError, r"lengths=\[-1, 5\] must lie in"),
        (dict(window=(3,)), ValueError, r"window=\(3,\) must be None or a pair"),
        (dict(window=(-1, 0)), ValueError, r"window left=-1"),
        (dict(logit_softcap=0.0), ValueError, r"logit_softcap=0.0 must be a finite number > 0"),
        (dict(scale="big"), TypeError, r"scale='big' must be a Python float"),
        (dict(block_kv=0), ValueError, r"block_kv=0 must be a positive int or None"),
        (dict(block_kv=True), ValueError, r"block_kv=True must be a positive int"),
        (dict(implementation="cuda"), ValueError, r"implementation='cuda' is not one of"),
        (dict(implementation=()), ValueError, r"implementation=\(\) is empty"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(**kwargs)


def test_registered_with_its_backends():
    op = registry.get("decode_attention")
    assert op is api.DECODE_ATTENTION
    assert op.names == ("reference", "xla", "pallas_tpu", "triton")
    assert op.preference["tpu"] == ("pallas_tpu", "xla")
    assert op.preference["gpu"] == ("triton", "xla")
    assert op.candidates(None) == tuple(op.preference.get(jax.default_backend(), ("xla",)))
    report = sf.info(print_report=False)
    assert set(report["implementations"]["decode_attention"]) == set(op.names)


def test_preference_falls_back_with_every_reason(monkeypatch):
    """pallas_tpu refuses D=8 and float16 (NotImplementedError): dispatch hands over to xla."""
    monkeypatch.setitem(api.PREFERENCE, jax.default_backend(), ("pallas_tpu", "xla"))
    out = _call()
    np.testing.assert_array_equal(out, _call(implementation="xla"))
    with pytest.raises(NotImplementedError, match="head dim D to be a multiple of 128"):
        _call(implementation="pallas_tpu")
    with pytest.raises(NotImplementedError, match=r"pallas_tpu: .*float16.*; triton: "):
        f16 = dict(q=Q.astype(jnp.float16), k=KV.astype(jnp.float16), v=KV.astype(jnp.float16))
        _call(**f16, implementation=("pallas_tpu", "triton"))


def test_empty_batch_or_queries_or_cache():
    out, lse = _call(q=Q[:, :0], return_lse=True)
    assert out.shape == (2, 0, 4, 8) and lse.shape == (2, 4, 0)
    empty_kv = jnp.zeros((2, 0, 2, 8))
    out, lse = _call(k=empty_kv, v=empty_kv, lengths=jnp.zeros(2, jnp.int32), return_lse=True)
    assert (out == 0).all() and np.isneginf(lse).all()
    out = _call(q=Q[:0], k=KV[:0], v=KV[:0], lengths=LENGTHS[:0])
    assert out.shape == (0, 3, 4, 8)


def test_traced_lengths_compile_once_for_every_length():
    """Lengths are data: one compiled program serves every step of a decode loop."""
    q = jax.random.normal(jax.random.key(0), Q.shape)
    k = jax.random.normal(jax.random.key(1), KV.shape)
    step = jax.jit(lambda lengths: sf.decode_attention(q, k, k, lengths, implementation="xla"))
    for length in (3, 10, 24):
        lengths = jnp.array([length, 1], jnp.int32)
        expected = sf.decode_attention(q, k, k, lengths, implementation="reference")
        np.testing.assert_allclose(step(lengths), expected, atol=1e-5, rtol=1e-5)
    assert step._cache_size() == 1


@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu"])
def test_inside_shard_map_with_heads_over_model(implementation):
    """A KV cache sharded like the attention (kv heads over `model`, batch over `data`): each
    device runs the op on its shard; the result equals the unsharded reference."""
    from jax.sharding import PartitionSpec as P

    from shardfuse.kernels.pallas_interpret import interpret_mode
    from tests.kernels.decode_attention.decode_backends import STRICT

    mesh = jax.make_mesh((2, 2), ("data", "model"))
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 2, 8, 128))  # H = 8 over 2 devices: 4 per shard
    k = jax.random.normal(keys[1], (2, 160, 2, 128))  # K = 2: 1 per shard
    v = jax.random.normal(keys[2], (2, 160, 2, 128))
    lengths = jnp.array([160, 37], jnp.int32)
    spec = P("data", None, "model", None)

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(spec, spec, spec, P("data")), out_specs=spec)
    def sharded(q, k, v, lengths):
        return sf.decode_attention(q, k, v, lengths, window=(40, 0), implementation=implementation)

    on_mesh = [
        jax.device_put(x, jax.sharding.NamedSharding(mesh, s))
        for x, s in ((q, spec), (k, spec), (v, spec), (lengths, P("data")))
    ]
    with interpret_mode(STRICT):
        got = jax.block_until_ready(sharded(*on_mesh))
    expected = sf.decode_attention(q, k, v, lengths, window=(40, 0), implementation="reference")
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
