"""The benchmark scales, throughput against the device's peak, and which implementations run."""

import pytest

from shardfuse import models
from shardfuse.bench import harness, scales


def test_throughput_info_on_cpu_and_h100():
    case = harness.BenchCase("op", "impl", "fwd", {"M": 1}, "bfloat16", flops=2e12, bytes=4e9)
    cpu = harness.throughput_info(case, 0.5, "cpu")
    assert cpu["tflops_per_s"] == 4.0 and cpu["gb_per_s"] == 8.0
    assert cpu["pct_peak_flops"] == cpu["pct_peak_bandwidth"] == "n/a"
    h100 = harness.throughput_info(case, 0.5, "NVIDIA H100 80GB HBM3")
    assert h100["peak_device"] == "H100 SXM"
    assert h100["pct_peak_flops"] == pytest.approx(100 * 4.0 / 989.4)
    assert h100["pct_peak_bandwidth"] == pytest.approx(100 * 8.0 / 3350.0)
    untimed = harness.throughput_info(case, None, "NVIDIA H100 80GB HBM3")
    assert untimed["tflops_per_s"] is None and untimed["pct_peak_flops"] == "n/a"


def test_percent_of_peak():
    assert harness.percent_of_peak(1.0, None) == "n/a"
    assert harness.percent_of_peak(None, 10.0) == "n/a"
    assert harness.percent_of_peak(2.5, 10.0) == 25.0


def test_scales_keep_gqa_ratio_and_head_dim():
    for scale in scales.SCALES.values():
        assert scale.min_rounds <= scale.max_rounds
        for model in scale.models_scaled():
            real = models.get(model.name)
            assert model.head_dim == real.head_dim
            assert model.heads // model.kv_heads == real.heads // real.kv_heads
            assert model.heads % model.kv_heads == 0
    cpu = scales.SCALES["cpu"]
    assert cpu.scaled(models.get("llama3-8b")).heads == 4
    assert cpu.batch(512) == 1
    assert scales.SCALES["device"].batch(4096) == 4


def test_pick_scale():
    assert scales.pick_scale("cpu", quick=False).name == "cpu"
    assert scales.pick_scale("tpu", quick=True).name == "device-quick"
    assert scales.pick_scale("gpu", quick=True, override="cpu").name == "cpu"
    with pytest.raises(ValueError, match="scale='huge'"):
        scales.pick_scale("cpu", quick=False, override="huge")


def test_rounds_for():
    assert harness.rounds_for(0.1, 1.0, 3, 20) == 10
    assert harness.rounds_for(10.0, 1.0, 3, 20) == 3
    assert harness.rounds_for(1e-6, 1.0, 3, 20) == 20
    assert harness.rounds_for(0.0, 1.0, 3, 20) == 20


@pytest.mark.parametrize(
    "implementation, backend, interpret, timed",
    [
        ("shardfuse.xla", "cpu", False, True),
        ("shardfuse.triton", "cpu", False, True),  # it says why not itself
        ("shardfuse.pallas_tpu", "cpu", False, False),
        ("shardfuse.pallas_tpu", "cpu", True, True),
        ("shardfuse.pallas_tpu", "tpu", False, True),
        ("shardfuse.pallas_tpu", "gpu", True, False),
        ("jax.pallas", "cpu", False, False),
        ("jax.pallas", "gpu", False, True),
        ("jax.nn.cudnn", "cpu", True, False),
        ("jax.nn.cudnn", "cuda", False, True),
    ],
)
def test_not_timed_reason(implementation, backend, interpret, timed):
    reason = harness.not_timed_reason(implementation, backend, interpret)
    assert (reason is None) == timed
    if reason:
        assert reason.startswith(implementation) and backend in reason


@pytest.mark.parametrize("name", sorted(scales.SCALES))
def test_grid_is_the_suites_nested_loops(name):
    """`Scale.grid` against the loops every suite spelled out before it existed."""
    scale = scales.SCALES[name]
    cases = [("op_a", "impl_1"), ("op_a", "impl_2"), ("op_b", "impl_1")]
    params, ids = scale.grid(cases)
    expected, expected_ids = [], []
    for model in scale.models:
        for seq_len in scale.seq_lens:
            modes = ("fwd", "fwd+bwd") if seq_len == max(scale.seq_lens) else ("fwd",)
            for mode in modes:
                for op, impl in cases:
                    expected.append((model, seq_len, mode, op, impl))
                    expected_ids.append(f"{model}-T{seq_len}-{mode}-{op}-{impl}")
    assert (params, ids) == (expected, expected_ids)
    params, ids = scale.grid(["x", "y"], models=["m"], modes="all")
    assert params == [("m", t, mode, c) for t in scale.seq_lens for mode in ("fwd", "fwd+bwd")
                      for c in "xy"]  # fmt: skip
    params, ids = scale.grid(["x"], models=["m"], modes=None)
    assert params == [("m", t, "x") for t in scale.seq_lens]
    assert ids == [f"m-T{t}-x" for t in scale.seq_lens]
    assert len(set(scale.grid(cases)[1])) == len(scale.grid(cases)[1])  # ids unique


def test_grid_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="modes='fwd' must be one of"):
        scales.SCALES["cpu"].grid(["x"], modes="fwd")
