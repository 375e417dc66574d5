"""`shardfuse.bench.harness.measure` with a stand-in for the pytest-benchmark fixture."""

import jax.numpy as jnp
import pytest

from shardfuse.bench import flops, harness, scales


class _Stats:
    def __init__(self, times):
        self.median = sorted(times)[len(times) // 2]


class FakeBenchmark:
    """Records what `measure` asks of pytest-benchmark; `enabled=False`: --benchmark-disable."""

    def __init__(self, enabled=True):
        self.enabled = enabled
        self.group = None
        self.extra_info = {}
        self.calls = []
        self.stats = None

    def pedantic(self, target, rounds=1, iterations=1, warmup_rounds=0):
        self.calls.append(dict(rounds=rounds, iterations=iterations, warmup_rounds=warmup_rounds))
        if not self.enabled:
            return target()
        for _ in range(warmup_rounds + rounds):
            target()
        self.stats = type("Metadata", (), {"stats": _Stats([0.004, 0.002, 0.003])})()


def _case(**kwargs):
    M = N = C = 32
    fields = dict(
        op="matmul",
        implementation="jnp.dot",
        mode="fwd",
        shape={"M": M, "N": N, "C": C},
        dtype="float32",
        flops=flops.matmul_flops(M, N, C),
        bytes=flops.matmul_bytes(M, N, C, 4),
        baseline="jnp.dot",
        model="tiny",
        seq_len=M,
    )
    fields.update(kwargs)
    return harness.BenchCase(**fields)


SCALE = scales.SCALES["cpu-quick"]
ARGS = (jnp.ones((32, 32), jnp.float32), jnp.ones((32, 32), jnp.float32))


def test_measure_fills_extra_info():
    bench = FakeBenchmark()
    case = _case()
    info = harness.measure(bench, jnp.dot, ARGS, case, SCALE)
    assert bench.group == case.group == "matmul | fwd | tiny | M=32 N=32 C=32 | float32"
    call = bench.calls[0]
    # the quick scale's first (checked) call is its only warm-up; the full scales add one
    assert call["iterations"] == 1 and call["warmup_rounds"] == SCALE.warmup_rounds == 0
    assert scales.SCALES["cpu"].warmup_rounds == 1
    assert SCALE.min_rounds <= call["rounds"] <= SCALE.max_rounds
    assert info["median_s"] == 0.003
    assert info["tflops_per_s"] == pytest.approx(case.flops / 0.003 / 1e12)
    assert info["gb_per_s"] == pytest.approx(case.bytes / 0.003 / 1e9)
    assert info["pct_peak_flops"] == "n/a"  # CPU
    for key in (
        "op",
        "implementation",
        "backend",
        "device_kind",
        "num_devices",
        "jax_version",
        "shape",
        "dtype",
        "flops",
        "bytes",
        "memory",
        "compile_s",
        "baseline",
    ):
        assert key in bench.extra_info, key
    assert bench.extra_info["num_devices"] == 8
    assert set(info["memory"]) >= {"temp_bytes", "argument_bytes", "output_bytes"}
    assert info["memory"]["argument_bytes"] == 2 * 32 * 32 * 4


def test_measure_under_benchmark_disable_runs_once_without_times():
    bench = FakeBenchmark(enabled=False)
    info = harness.measure(bench, jnp.dot, ARGS, _case(), SCALE)
    assert info["median_s"] is None and info["tflops_per_s"] is None and info["rounds"] == 0
    assert bench.extra_info["flops"] == _case().flops


def test_measure_rejects_non_finite_outputs():
    with pytest.raises(AssertionError, match="non-finite"):
        harness.measure(FakeBenchmark(), lambda a, b: jnp.log(a - b), ARGS, _case(), SCALE)


def test_measure_skips_what_an_implementation_cannot_run():
    def refuses(a, b):
        raise NotImplementedError("no such kernel here")

    reasons = []

    def skip(reason):
        reasons.append(reason)
        raise pytest.skip.Exception(reason)

    with pytest.raises(pytest.skip.Exception):
        harness.measure(FakeBenchmark(), refuses, ARGS, _case(), SCALE, skip=skip)
    assert reasons == ["jnp.dot cannot run this case: NotImplementedError: no such kernel here"]
    with pytest.raises(NotImplementedError):
        harness.measure(FakeBenchmark(), refuses, ARGS, _case(), SCALE)

    def fails_to_compile(a, b):
        raise ValueError("head dim too large for shared memory")

    with pytest.raises(ValueError, match="shared memory"):  # ours: a failure, not a skip
        harness.measure(FakeBenchmark(), fails_to_compile, ARGS, _case(), SCALE, skip=skip)
    with pytest.raises(pytest.skip.Exception):  # a third-party baseline: skipped
        harness.measure(
            FakeBenchmark(), fails_to_compile, ARGS, _case(), SCALE, skip=skip, skip_on=(Exception,)
        )
    assert (
        reasons[-1]
        == "jnp.dot cannot run this case: ValueError: head dim too large for shared memory"
    )


def test_with_backward_is_the_forward_and_its_vjp():
    def f(x, w):
        return jnp.tanh(x @ w)

    x = jnp.arange(6.0).reshape(2, 3) / 6
    w = jnp.arange(12.0).reshape(3, 4) / 12
    cotangent = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    out, (dx, dw) = harness.with_backward(f)(x, w, cotangent)
    y = jnp.tanh(x @ w)
    dz = cotangent * (1 - y**2)  # by hand: d tanh = 1 - tanh^2
    assert jnp.allclose(out, y)
    assert jnp.allclose(dx, dz @ w.T, atol=1e-6) and jnp.allclose(dw, x.T @ dz, atol=1e-6)
