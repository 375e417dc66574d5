"""The one FLOPs/MFU definition: its conventions, and every reader agreeing on it."""

import doctest

import pytest

from shardfuse import flops, models
from shardfuse.bench import flops as bench_flops
from shardfuse.models import ModelSpec
from shardfuse.planner import MESH_AXES as planner_axes
from shardfuse.planner import Assumptions
from shardfuse.train import (
    AXES,
    COMPUTE_DTYPE,
    TrainConfig,
    Trainer,
    estimate_for,
    parallelism_of,
)


def test_model_flops_is_megatron_eq3_and_palm():
    # Narayanan et al. 2021, eq. 3 without recomputation (72 = 96 x 3 / 4), GPT shapes
    for name in ("gpt-1.7b", "gpt-145b"):
        spec = models.get(name)
        h, L, V, s = spec.hidden, spec.num_layers, spec.vocab_size, 2048
        megatron = 72 * 4 * s * L * h * h * (1 + s / (6 * h)) + 6 * 4 * s * h * V
        assert flops.model_flops(spec, seq_len=s, batch=4) == pytest.approx(megatron, rel=1e-12)
    # PaLM appendix B: 6 N (matmul weights, logits included) + 12 L H Q T, full attention
    spec = models.get("llama3-8b")
    s = 8192
    matmul_weights = spec.num_layers * (spec.layer_params() - 2 * spec.hidden)
    n = matmul_weights + spec.vocab_size * spec.hidden
    palm = 6 * n + 12 * spec.num_layers * spec.heads * spec.head_dim * s
    assert flops.model_flops_per_token(spec, s) == pytest.approx(palm, rel=1e-12)


def test_causal_convention_model_vs_hardware():
    spec = models.get("llama3-8b")
    s = 4096
    attention = flops.layer_attention_flops(spec, s)
    assert attention == 4 * spec.heads * spec.head_dim * s  # no causal halving
    skipped = flops.layer_attention_flops(spec, s, causal_skip=True)
    assert skipped == pytest.approx(attention * (s + 1) / (2 * s))
    model = flops.model_flops(spec, seq_len=s)
    assert flops.hardware_flops(spec, seq_len=s, causal_skip=False) == pytest.approx(model)
    assert flops.hardware_flops(spec, seq_len=s) < model
    full = flops.hardware_flops(spec, seq_len=s, remat="full", causal_skip=False)
    forward_layers = spec.num_layers * s * (flops.layer_matmul_flops(spec) + attention)
    assert full == pytest.approx(model + forward_layers)
    # a sliding window is part of the model: it limits the model FLOPs too
    mistral = models.get("mistral-7b")
    assert flops.layer_attention_flops(mistral, 16384) == flops.layer_attention_flops(mistral, 4096)


def test_one_definition_everywhere():
    assert bench_flops.attention_flops is flops.attention_flops
    assert bench_flops.matmul_flops is flops.matmul_flops
    assert bench_flops.visible_pairs is flops.visible_pairs
    spec = ModelSpec.tiny(num_layers=3)
    # the spec's counts are the model's: one layer of matmul weights, FLOPs = 2 x weights
    assert flops.layer_matmul_flops(spec) == 2 * spec.layer_matmul_params()


def test_errors_name_the_value():
    spec = models.get("llama3-8b")
    with pytest.raises(ValueError, match="seq_len=0"):
        flops.model_flops(spec, seq_len=0)
    with pytest.raises(ValueError, match="remat='some'"):
        flops.hardware_flops(spec, seq_len=8, remat="some")
    with pytest.raises(ValueError, match="step_time_s=0"):
        flops.mfu(1.0, step_time_s=0, devices=1, peak_flops_per_s=1.0)


def test_trainer_mfu_equals_planner_mfu():
    """The trainer's printed MFU and the planner's, same model, tokens, step time and peak."""
    config = TrainConfig(
        mesh={"data": 2, "model": 4},
        model=ModelSpec.tiny(num_layers=1),
        steps=1,
        global_batch=8,
        seq_len=32,
        device="h100",
    )
    lines = []
    trainer = Trainer(config, log=lines.append)
    trainer.run()
    record = trainer.history[-1]
    assert f"mfu {record['mfu']:.2%}" in lines[-1]
    e = estimate_for(config, 8)  # the planner's cost function, same parallelism, model, tokens
    assert e.model_flops == flops.model_flops(
        config.model, seq_len=config.seq_len, batch=config.global_batch
    )
    # the planner's axes: the trainer's and the expert axis (size 1)
    expected = {**dict.fromkeys(planner_axes, 1), "data": 2, "model": 4}
    assert parallelism_of(config, 8).mesh_shape == expected and set(AXES) <= set(planner_axes)
    # same peak: the planner's compute dtype is the trainer's
    assert Assumptions.float32().compute_dtype == COMPUTE_DTYPE
    # the planner's MFU had its step taken as long as the measured one
    planner_mfu = e.mfu * e.step_time_s / record["step_time_s"]
    assert record["mfu"] == pytest.approx(planner_mfu, rel=1e-12)


def test_docstring_examples():
    for module in (flops, bench_flops):
        assert doctest.testmod(module).failed == 0, module.__name__
