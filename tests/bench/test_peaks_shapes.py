"""The peak table and the model shapes / scales of the benchmark harness."""

import pytest

from shardfuse.bench import harness, peaks, shapes


@pytest.mark.parametrize(
    "device_kind, name, bf16, hbm",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 3350.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 2000.0),
        ("NVIDIA H100 NVL", "H100 NVL", 835.5, 3900.0),
        ("NVIDIA H200", "H200 SXM", 989.4, 4800.0),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 312.0, 2039.0),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 312.0, 1935.0),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, 1555.0),
        ("TPU v4", "TPU v4", 275.0, 1200.0),
        ("TPU v5 lite", "TPU v5e", 197.0, 819.0),
        ("TPU v5e", "TPU v5e", 197.0, 819.0),
        ("TPU v5", "TPU v5p", 459.0, 2765.0),
        ("TPU v5p", "TPU v5p", 459.0, 2765.0),
        ("TPU v6 lite", "TPU v6e", 918.0, 1640.0),
    ],
)
def test_device_kinds_map_to_their_peaks(device_kind, name, bf16, hbm):
    peak = peaks.device_peak(device_kind)
    assert peak is not None and peak.name == name
    assert peak.peak_tflops("bfloat16") == bf16
    assert peak.hbm_gb_per_s == hbm


def test_float32_peaks_and_unknown_devices():
    assert peaks.device_peak("NVIDIA H100 80GB HBM3").peak_tflops("float32") == 66.9
    assert peaks.device_peak("NVIDIA A100-SXM4-40GB").peak_tflops("float16") == 312.0
    assert peaks.device_peak("TPU v5 lite").peak_tflops("float32") is None
    for kind in ("cpu", "TFRT_CPU_0", "NVIDIA GeForce RTX 4090", "TPU v4 lite"):
        assert peaks.device_peak(kind) is None
    assert peaks.percent_of_peak(1.0, None) == "n/a"
    assert peaks.percent_of_peak(None, 10.0) == "n/a"
    assert peaks.percent_of_peak(2.5, 10.0) == 25.0


def test_throughput_info_on_cpu_and_h100():
    case = harness.BenchCase("op", "impl", "fwd", {"M": 1}, "bfloat16", flops=2e12, bytes=4e9)
    cpu = harness.throughput_info(case, 0.5, "cpu")
    assert cpu["tflops_per_s"] == 4.0 and cpu["gb_per_s"] == 8.0
    assert cpu["pct_peak_flops"] == cpu["pct_peak_bandwidth"] == "n/a"
    h100 = harness.throughput_info(case, 0.5, "NVIDIA H100 80GB HBM3")
    assert h100["pct_peak_flops"] == pytest.approx(100 * 4.0 / 989.4)
    assert h100["pct_peak_bandwidth"] == pytest.approx(100 * 8.0 / 3350.0)
    untimed = harness.throughput_info(case, None, "NVIDIA H100 80GB HBM3")
    assert untimed["tflops_per_s"] is None and untimed["pct_peak_flops"] == "n/a"


def test_models_are_the_published_configs():
    llama = shapes.MODELS["llama3-8b"]
    assert (llama.hidden, llama.heads, llama.kv_heads, llama.head_dim) == (4096, 32, 8, 128)
    assert shapes.MODELS["llama3-70b"].heads == 64
    gemma2 = shapes.MODELS["gemma2-9b"]
    assert (gemma2.head_dim, gemma2.window, gemma2.logit_softcap) == (256, 4096, 50.0)
    for model in shapes.MODELS.values():
        assert model.heads % model.kv_heads == 0


def test_scales_keep_gqa_ratio_and_head_dim():
    for scale in shapes.SCALES.values():
        assert scale.min_rounds <= scale.max_rounds
        for model in scale.models_scaled():
            real = shapes.MODELS[model.name]
            assert model.head_dim == real.head_dim
            assert model.heads // model.kv_heads == real.heads // real.kv_heads
            assert model.heads % model.kv_heads == 0
    cpu = shapes.SCALES["cpu"]
    assert cpu.scaled(shapes.MODELS["llama3-8b"]).heads == 4
    assert cpu.batch(512) == 1
    assert shapes.SCALES["device"].batch(4096) == 4


def test_pick_scale():
    assert shapes.pick_scale("cpu", quick=False).name == "cpu"
    assert shapes.pick_scale("tpu", quick=True).name == "device-quick"
    assert shapes.pick_scale("gpu", quick=True, override="cpu").name == "cpu"
    with pytest.raises(ValueError, match="scale='huge'"):
        shapes.pick_scale("cpu", quick=False, override="huge")


def test_rounds_for():
    assert harness.rounds_for(0.1, 1.0, 3, 20) == 10
    assert harness.rounds_for(10.0, 1.0, 3, 20) == 3
    assert harness.rounds_for(1e-6, 1.0, 3, 20) == 20
    assert harness.rounds_for(0.0, 1.0, 3, 20) == 20
