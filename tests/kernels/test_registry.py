"""The one registry of implementations: `implementation=` sequences, errors, info, lazy imports."""

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse import _info
from shardfuse.collectives.ring_attention import blocks
from shardfuse.kernels import registry
from shardfuse.kernels.attention import api as attention_api
from shardfuse.kernels.matmul import api as matmul_api

Q = jnp.ones((1, 8, 2, 8), jnp.float32)
KV = jnp.ones((1, 8, 1, 8), jnp.float32)
A = jnp.ones((4, 8), jnp.float32)
B = jnp.ones((8, 2), jnp.float32)
OPS = ("attention", "matmul", "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def _refusing(reason):
    def refuse(*args):
        raise NotImplementedError(reason)

    return refuse


def _patch_loads(monkeypatch, module, refuse):
    """`module.load_implementation` refusing the names in `refuse`, recording every call."""
    calls, real = [], module.load_implementation

    def load(name):
        calls.append(name)
        return _refusing(f"{name} cannot") if name in refuse else real(name)

    monkeypatch.setattr(module, "load_implementation", load)
    return calls


def _collective(op, implementation):
    """Calls collective matmul `op` inside a 1-device shard_map (x [4, 8] @ w [8, 2])."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    fn = getattr(sf.collectives, op)
    f = jax.shard_map(
        lambda x, w: fn(x, w, "model", implementation=implementation),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P() if op == "matmul_all_reduce" else P("model"),  # the ring's outputs vary
    )
    return f(A, B)


def test_every_op_is_registered():
    assert set(OPS) <= set(registry.ops())
    assert registry.get("attention") is attention_api.ATTENTION
    assert registry.get("matmul") is matmul_api.MATMUL
    with pytest.raises(ValueError, match=r"op='conv' is not one of the registered ops"):
        registry.get("conv")


@pytest.mark.parametrize("implementation", [("pallas_tpu", "xla"), ["pallas_tpu", "xla"]])
def test_sequence_first_refuses_then_second_runs(monkeypatch, implementation):
    calls = _patch_loads(monkeypatch, attention_api, {"pallas_tpu"})
    out = sf.flash_attention(Q, KV, KV, implementation=implementation)
    assert calls == ["pallas_tpu", "xla"]
    np.testing.assert_allclose(out, sf.flash_attention(Q, KV, KV, implementation="xla"))

    calls = _patch_loads(monkeypatch, matmul_api, {"triton"})
    np.testing.assert_allclose(sf.matmul(A, B, implementation=("triton", "xla")), A @ B)
    assert calls == ["triton", "xla"]


def test_sequence_stops_at_the_first_that_runs(monkeypatch):
    calls = _patch_loads(monkeypatch, attention_api, set())
    sf.flash_attention(Q, KV, KV, implementation=["reference", "xla"])
    assert calls == ["reference"]


def test_explicit_single_name_propagates_its_error(monkeypatch):
    _patch_loads(monkeypatch, attention_api, {"pallas_tpu"})
    with pytest.raises(NotImplementedError) as error:
        sf.flash_attention(Q, KV, KV, implementation="pallas_tpu")
    assert str(error.value) == "pallas_tpu cannot"  # its own error, not a summary


def test_all_refuse_lists_every_reason(monkeypatch):
    _patch_loads(monkeypatch, attention_api, {"triton", "pallas_tpu", "xla"})
    with pytest.raises(NotImplementedError) as error:
        sf.flash_attention(Q, KV, KV, implementation=("triton", "pallas_tpu", "xla"))
    message = str(error.value)
    assert message.startswith("no attention implementation can run here")
    for reason in ("triton: triton cannot", "pallas_tpu: pallas_tpu cannot", "xla: xla cannot"):
        assert reason in message


def test_preference_falls_back_and_lists_reasons(monkeypatch):
    monkeypatch.setitem(attention_api.PREFERENCE, jax.default_backend(), ("triton", "xla"))
    calls = _patch_loads(monkeypatch, attention_api, {"triton"})
    sf.flash_attention(Q, KV, KV)
    assert calls == ["triton", "xla"]
    _patch_loads(monkeypatch, attention_api, {"triton", "xla"})
    with pytest.raises(NotImplementedError, match="triton: triton cannot; xla: xla cannot"):
        sf.flash_attention(Q, KV, KV)


def _call_op(op, implementation):
    if op == "attention":
        return sf.flash_attention(Q, KV, KV, implementation=implementation)
    if op == "matmul":
        return sf.matmul(A, B, implementation=implementation)
    return _collective(op, implementation)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("implementation", ["cuda", ("xla", "cuda")])
def test_unknown_name_is_a_value_error_naming_the_valid_ones(op, implementation):
    with pytest.raises(ValueError, match=r"is not one of \[None, 'reference', 'xla'") as error:
        _call_op(op, implementation)
    assert "'cuda'" in str(error.value)
    for name in registry.get(op).names:
        assert repr(name) in str(error.value)


@pytest.mark.parametrize("op", OPS)
def test_empty_or_odd_sequences_are_refused(op):
    with pytest.raises(ValueError, match=r"implementation=\(\) is empty"):
        _call_op(op, ())
    with pytest.raises(TypeError, match=r"implementation=3 must be None"):
        _call_op(op, 3)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_collective_matmuls_take_sequences(op):
    expected = _collective(op, "reference")
    np.testing.assert_allclose(_collective(op, ["reference", "xla"]), expected)
    np.testing.assert_allclose(_collective(op, ("xla",)), expected)


def test_collective_sequence_falls_through_a_refusing_backend():
    with pytest.raises(NotImplementedError, match="no fused matmul_all_reduce"):
        _collective("matmul_all_reduce", "pallas_tpu")  # named alone: its own error
    out = _collective("matmul_all_reduce", ("pallas_tpu", "xla"))
    np.testing.assert_allclose(out, A @ B)


@pytest.mark.slow
def test_ring_attention_takes_sequences(monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:2]), ("sequence",))
    q = jax.random.normal(jax.random.key(0), (1, 16, 2, 8))
    k = v = jax.random.normal(jax.random.key(1), (1, 16, 1, 8))
    expected = sf.flash_attention(q, k, v, causal=True, implementation="xla")
    real, tried = blocks.load, []

    def load(name):
        tried.append(name)
        if name == "reference":
            raise NotImplementedError("reference refuses")
        return real(name)

    monkeypatch.setattr(blocks, "load", load)

    def per_shard(implementation):
        return jax.shard_map(
            lambda q, k, v: sf.collectives.ring_attention(
                q, k, v, "sequence", layout="contiguous", causal=True, implementation=implementation
            ),
            mesh=mesh,
            in_specs=P(None, "sequence"),
            out_specs=P(None, "sequence"),
        )(q, k, v)

    np.testing.assert_allclose(per_shard(("reference", "xla")), expected, rtol=1e-5, atol=1e-5)
    assert tried[0] == "reference" and "xla" in tried
    with pytest.raises(NotImplementedError, match="reference: reference refuses"):
        per_shard(["reference"])
    with pytest.raises(ValueError, match=r"has 'cuda', which is not one of"):
        per_shard(("xla", "cuda"))
    # A list as well as a tuple: the global wrapper's plan must stay hashable.
    out = sf.ring_attention(q, k, v, mesh=mesh, causal=True, implementation=["reference", "xla"])
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_matmul_c_is_deprecated_for_addend():
    addend = jnp.full((4, 2), 2.0)
    with pytest.warns(DeprecationWarning, match=r"sf.matmul\(c=...\) is deprecated; use addend="):
        old = sf.matmul(A, B, c=addend)
    np.testing.assert_allclose(old, sf.matmul(A, B, addend=addend))
    np.testing.assert_allclose(old, A @ B + 2.0)
    with pytest.raises(TypeError, match="both addend= and its deprecated name c="):
        sf.matmul(A, B, addend=addend, c=addend)


def test_addend_does_not_warn(recwarn):
    sf.matmul(A, B, addend=jnp.zeros((4, 2)))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_info_lists_every_registered_op_and_backend():
    report = sf.info(print_report=False)
    assert list(report["implementations"]) == list(registry.ops())
    for op in OPS:
        assert set(report["implementations"][op]) == set(registry.get(op).names)
    for op in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        assert report["implementations"][op]["xla"][0]
    assert report["preference"]["matmul_all_reduce"] == ("xla",)
    assert report["shardfuse"] == sf.__version__


def test_info_descriptions_are_each_backends_own():
    descriptions = sf.info(print_report=False)["descriptions"]
    assert "O(T*S)" in descriptions["attention"]["reference"]
    assert "T*S" not in descriptions["matmul"]["reference"]  # issue 13 item 8
    for op in OPS:
        texts = [descriptions[op][name] for name in registry.get(op).names]
        assert all(texts) and descriptions[op][""] == registry.get(op).description


def test_info_rows_come_from_the_registry(capsys):
    registry.register(
        "example_op",
        description="a throwaway op",
        backends=[
            registry.Backend("xla", "jax.numpy", "matmul", "jnp.matmul, for the test"),
            registry.Backend(
                "pallas_tpu",
                "shardfuse.kernels.no_such_module",
                "matmul",
                "a backend not shipped",
            ),
        ],
        preference={},
    )
    try:
        report = _info.info()
    finally:
        registry.unregister("example_op")
    assert report["implementations"]["example_op"] == {
        "xla": (True, "pure JAX: runs on every backend"),
        "pallas_tpu": (False, "not part of this version of shardfuse"),
    }
    printed = capsys.readouterr().out
    for text in ("example_op", "a throwaway op", "jnp.matmul, for the test", "all_gather_matmul"):
        assert text in printed


def test_backend_status_and_load():
    assert registry.pallas_tpu_status("tpu") == (True, "TPU: Mosaic kernels")
    assert registry.pallas_tpu_status("cpu") == (
        True,
        "no TPU: runs in TPU interpret mode on cpu (slow)",
    )
    assert not registry.pallas_tpu_status("gpu")[0]
    if jax.default_backend() == "cpu":
        usable, why = registry.get("attention").backends["triton"].available()
        assert not usable and "NVIDIA GPU" in why
    missing = registry.Backend("xla", "shardfuse.kernels.no_such_module", "f", "absent")
    with pytest.raises(NotImplementedError, match="not part of this version of shardfuse"):
        missing.load()
    assert missing.available() == (False, "not part of this version of shardfuse")


def test_register_checks_its_preference():
    backend = registry.Backend("xla", "jax.numpy", "matmul", "jnp.matmul")
    with pytest.raises(ValueError, match=r"preference for 'tpu' names \['pallas_tpu'\]"):
        registry.register(
            "bad_op", description="", backends=[backend], preference={"tpu": ("pallas_tpu",)}
        )
    assert "bad_op" not in registry.ops()


def test_normalize_makes_sequences_hashable():
    assert registry.normalize("attention", ["pallas_tpu", "xla"]) == ("pallas_tpu", "xla")
    assert registry.normalize("attention", None) is None
    assert registry.normalize("matmul", "xla") == "xla"


def test_import_does_not_import_optional_dependencies():
    code = (
        "import sys, shardfuse\n"
        "shardfuse.info(print_report=False)\n"
        "bad = [m for m in ('triton', 'jax_triton', 'torch') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_info_module_does_not_import_the_package_root():
    source = pathlib.Path(_info.__file__).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            assert all(alias.name != "shardfuse" for alias in node.names)
        if isinstance(node, ast.ImportFrom):
            assert node.module != "shardfuse", ast.unparse(node)
