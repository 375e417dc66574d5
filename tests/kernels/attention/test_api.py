"""Dispatch and validation of `sf.flash_attention`: bad inputs fail clearly, before tracing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels import registry
from shardfuse.kernels.attention import api

Q = jnp.zeros((2, 16, 4, 8), jnp.float32)
KV = jnp.zeros((2, 24, 2, 8), jnp.float32)


def _call(q=Q, k=KV, v=KV, **kwargs):
    return sf.flash_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(q=jnp.zeros((16, 4, 8))), ValueError, r"q has rank 3 .*\[B, T, H, D\]"),
        (dict(k=jnp.zeros((2, 24, 8))), ValueError, r"k has rank 3"),
        (dict(v=jnp.zeros((2, 24, 2, 16))), ValueError, r"k and v must have the same shape"),
        (dict(k=jnp.zeros((3, 24, 2, 8)), v=jnp.zeros((3, 24, 2, 8))), ValueError, r"B=2.*B=3"),
        (dict(k=jnp.zeros((2, 24, 2, 4)), v=jnp.zeros((2, 24, 2, 4))), ValueError, r"D=8.*D=4"),
        (dict(k=jnp.zeros((2, 24, 3, 8)), v=jnp.zeros((2, 24, 3, 8))), ValueError, r"H=4 .* K=3"),
        (dict(q=Q.astype(jnp.bfloat16)), TypeError, r"share one dtype.*bfloat16"),
        (dict(q=Q.astype(jnp.int32)), TypeError, r"q has dtype int32"),
        (dict(q_positions=jnp.arange(15)), ValueError, r"q_positions has shape \(15,\).*\(16,\)"),
        (dict(kv_positions=jnp.arange(24.0)), TypeError, r"kv_positions has dtype float32"),
        (dict(q_segment_ids=jnp.zeros((2, 16), jnp.int32)), ValueError, r"both q_segment_ids"),
        (
            dict(
                q_segment_ids=jnp.zeros((2, 16), jnp.int32),
                kv_segment_ids=jnp.zeros((2, 16), jnp.int32),
            ),
            ValueError,
            r"kv_segment_ids has shape \(2, 16\).*\(2, 24\)",
        ),
        (dict(window=5), ValueError, r"window=5 must be None or a pair"),
        (dict(window=(-1, 0)), ValueError, r"window left=-1"),
        (dict(window=(2, 1.5)), ValueError, r"window right=1.5"),
        (dict(logit_softcap=0.0), ValueError, r"logit_softcap=0.0 must be a finite number > 0"),
        (dict(logit_softcap="big"), TypeError, r"logit_softcap='big'"),
        (dict(scale=float("nan")), ValueError, r"scale=nan"),
        (dict(causal="yes"), TypeError, r"causal='yes' must be a bool"),
        (dict(implementation="cuda"), ValueError, r"implementation='cuda' is not one of"),
        (dict(block_sizes=(8, 8)), TypeError, r"block_sizes must be a BlockSizes"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(**kwargs)


def test_block_sizes_validated_on_construction():
    with pytest.raises(ValueError, match=r"BlockSizes.block_kv=-3"):
        sf.BlockSizes(8, -3)
    with pytest.raises(ValueError, match=r"BlockSizes.block_q=0"):
        sf.BlockSizes(0, 8)


def test_validation_happens_before_tracing(monkeypatch):
    traced = []
    monkeypatch.setattr(api, "load_implementation", lambda name: traced.append(name))
    with pytest.raises(ValueError):
        _call(q=jnp.zeros((2, 16, 5, 8)))
    assert traced == []


def test_float64_numpy_rejected_not_downcast():
    q = np.zeros((1, 4, 2, 8), np.float64)
    with pytest.raises(TypeError, match="q has dtype float64"):
        sf.flash_attention(q, q, q)


def test_float64_rejected():
    with jax.enable_x64(True):
        q = jnp.zeros((1, 4, 2, 8), jnp.float64)
        with pytest.raises(TypeError, match="float64.*supported dtypes are float32, bfloat16"):
            sf.flash_attention(q, q, q)


@pytest.mark.parametrize("shape", [(0, 16, 4, 8), (2, 0, 4, 8)])
def test_empty_queries_return_empty(shape):
    q = jnp.zeros(shape)
    kv = jnp.zeros((shape[0], 24, 2, 8))
    out, lse = sf.flash_attention(q, kv, kv, return_lse=True)
    assert out.shape == shape and lse.shape == (shape[0], 4, shape[1])


def test_no_keys_means_every_row_masked():
    k = jnp.zeros((2, 0, 2, 8))
    out, lse = sf.flash_attention(Q, k, k, return_lse=True)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    grad = jax.grad(lambda q: sf.flash_attention(q, k, k).sum())(Q)
    assert np.all(np.asarray(grad) == 0)


def test_default_implementation_on_cpu_is_native_then_xla(monkeypatch):
    """CPU's preference: the C++ kernels where built, else xla (docs/kernels.md)."""
    assert api.PREFERENCE["cpu"] == ("native_cpu", "xla")
    calls = []
    real = api.load_implementation
    monkeypatch.setattr(api, "load_implementation", lambda name: calls.append(name) or real(name))
    _call(causal=True)
    built = registry.native_cpu_status("cpu")[0]
    assert calls == (["native_cpu"] if built else ["native_cpu", "xla"])


def test_dispatch_falls_back_and_reports_every_reason(monkeypatch):
    def refuses(reason):
        def fn(*args):
            raise NotImplementedError(reason)

        return fn

    real = api.load_implementation

    def fake_load(name):
        return refuses("head dim 8 is too small") if name == "triton" else real(name)

    monkeypatch.setattr(api, "load_implementation", fake_load)
    monkeypatch.setitem(api.PREFERENCE, "cpu", ("triton", "xla"))
    out = _call()  # triton refuses, xla runs
    assert out.shape == Q.shape
    with pytest.raises(NotImplementedError, match="head dim 8 is too small"):
        _call(implementation="triton")  # an explicit request is not silently replaced
    monkeypatch.setattr(api, "load_implementation", lambda name: refuses(f"{name} cannot"))
    with pytest.raises(NotImplementedError, match="triton: triton cannot; xla: xla cannot"):
        _call()


def test_missing_backend_is_not_implemented():
    # The Triton path needs an NVIDIA GPU; on this CPU machine it must say why.
    with pytest.raises(NotImplementedError):
        _call(implementation="triton")


def test_numpy_inputs_accepted():
    out = sf.flash_attention(
        np.zeros((1, 4, 2, 8), np.float32),
        np.ones((1, 4, 1, 8), np.float32),
        np.ones((1, 4, 1, 8), np.float32),
    )
    np.testing.assert_allclose(np.asarray(out), 1.0)


def test_info_lists_implementations():
    report = sf.info(print_report=False)
    attention = report["implementations"]["attention"]
    assert attention["xla"][0] and attention["reference"][0]
    usable, why = attention["triton"]
    assert not usable and why
    assert report["backend"] == "cpu" and len(report["devices"]) == 8


def test_one_list_of_attention_options_for_every_entry_point():
    """flash_attention and both ring attentions take `validate`'s options, listed in help()."""
    import doctest
    import inspect

    from shardfuse.kernels.attention import base

    options = inspect.signature(base.validate).parameters
    calls = {  # each entry point with a keyword that is none of its parameters
        sf.flash_attention: lambda **kw: sf.flash_attention(Q, KV, KV, **kw),
        sf.collectives.ring_attention: lambda **kw: sf.collectives.ring_attention(
            Q, KV, KV, "sequence", **kw
        ),
        sf.ring_attention: lambda **kw: sf.ring_attention(Q, KV, KV, mesh=None, **kw),
    }
    for fn, call in calls.items():
        parameters = inspect.signature(fn).parameters
        for name in base.CONFIG_OPTIONS:
            assert parameters[name] == options[name], (fn, name)
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values()), fn
        # a keyword outside the list fails clearly, naming the function, before any work
        message = rf"{fn.__name__}\(\) got an unexpected keyword argument 'mask'; its keywords"
        with pytest.raises(TypeError, match=message):
            call(mask=None)
    with pytest.raises(TypeError, match=r"ring_attention\(\) got an unexpected .* 'q_positions'"):
        calls[sf.ring_attention](q_positions=None)  # positions come from the ring layout
    # the options still reach the computation: causal changes the result
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 8))
    full, causal = _call(q, q, q), _call(q, q, q, causal=True)
    assert np.isfinite(np.asarray(full)).all() and not np.allclose(full, causal)
    assert doctest.testmod(base, optionflags=doctest.ELLIPSIS).failed == 0


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
@pytest.mark.parametrize(
    "q_spec, lse_spec",
    [
        (("data",), ("data", None, None)),  # batch
        (("data", None, "model"), ("data", "model", None)),  # batch and heads
        ((None, "data"), (None, None, "data")),  # sequence
    ],
)
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_operands_sharded_on_a_mesh_outside_shard_map(axis_type, q_spec, lse_spec, implementation):
    """Sharded as users shard them, on Explicit and Auto meshes, outside shard_map, under
    jit and eagerly (mesh set): values and gradients as on one device, outputs sharded as q
    (lse as q's batch, heads and sequence). On an Explicit mesh the kernels run with its
    axes Auto (`jax.sharding.auto_axes`: a reshape of an Explicit-sharded dimension must
    name its output sharding); the default falls back from native_cpu, which runs per
    device only, to xla."""
    kind = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind[axis_type],) * 2)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 32, 4, 16))
    k, v = (jax.random.normal(key, (2, 32, 2, 16)) for key in keys[1:])
    P, NS = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    qs, ks, vs = (jax.device_put(x, NS(mesh, P(*q_spec))) for x in (q, k, v))

    def attend(q, k, v):
        return sf.flash_attention(
            q, k, v, causal=True, return_lse=True, implementation=implementation
        )  # fmt: skip

    def loss(attend, q, k, v):
        out, lse = attend(q, k, v)
        return (out**2).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    def reference(q, k, v):
        return sf.attention_reference(q, k, v, causal=True, return_lse=True)

    want = reference(q, k, v)
    want_grads = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2))(q, k, v)
    grad = jax.grad(functools.partial(loss, attend), argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        for run, run_grad in ((attend, grad), (jax.jit(attend), jax.jit(grad))):
            (out, lse), grads = run(qs, ks, vs), run_grad(qs, ks, vs)
            # (On Auto axes XLA's propagation places the outputs: a sequence-sharded q
            # comes back replicated; ring attention is the sequence-parallel path.)
            if axis_type == "explicit" or q_spec[1:2] != ("data",):
                for x, spec in ((out, q_spec), (lse, lse_spec), *((g, q_spec) for g in grads)):
                    assert x.sharding.is_equivalent_to(NS(mesh, P(*spec)), x.ndim), x.sharding
            np.testing.assert_allclose(out, want[0], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(lse, want[1], atol=1e-5, rtol=1e-5)
            for name, a, e in zip("qkv", grads, want_grads, strict=True):
                np.testing.assert_allclose(a, e, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
