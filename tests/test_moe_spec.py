"""Mixture-of-experts shapes (`ModelSpec`) and their FLOPs (`shardfuse.flops`): issue 44.

The oracles are numbers worked by hand from the models' `config.json` (the
module docstring of `shardfuse.model_spec`) and the published totals: Mixtral
8x7B 46.7B weights, 12.9B active; Qwen1.5-MoE-A2.7B 14.3B / 2.7B; Qwen2-57B-A14B
57.4B / 14.2B; Qwen3-30B-A3B 30.5B / 3.3B; Qwen3-235B-A22B 235B / 22B.
"""

import doctest

import pytest

from shardfuse import flops, model_spec, models
from shardfuse.models import ModelSpec

# name: (total, active) in billions, as the model cards state them
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),
    "qwen1.5-moe-a2.7b": (14.3, 2.7),
    "qwen2-57b-a14b": (57.4, 14.2),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235.1, 22.2),
}


def tiny_moe(**fields):
    """hidden 8, 2 heads of 4 (1 kv head), ffn 16, 4 layers, vocab 10; 4 experts of 6, top 2."""
    base = dict(hidden=8, heads=2, kv_heads=1, ffn_hidden=16, num_layers=4, vocab_size=10,
                experts=4, top_k=2, expert_hidden=6)  # fmt: skip
    return ModelSpec.tiny(**{**base, **fields})


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_moe_counts(name):
    total, active = PUBLISHED[name]
    spec = models.get(name)
    # the cards round (Qwen3-30B-A3B: 3.35B counted, "3.3B" stated)
    assert spec.num_params() / 1e9 == pytest.approx(total, rel=0.02)
    assert spec.active_params() / 1e9 == pytest.approx(active, rel=0.02)
    assert spec.moe_layers == tuple(range(spec.num_layers))


def test_mixtral_counts_by_hand():
    spec = models.get("mixtral-8x7b")
    h, f, L, V = 4096, 14336, 32, 32000
    attention = h * (4096 + 2 * 1024) + 4096 * h
    expert = 3 * h * f
    router = h * 8
    norms = 2 * h
    total = L * (attention + 8 * expert + router + norms) + 2 * V * h + h
    active = L * (attention + 2 * expert + router + norms) + 2 * V * h + h
    assert spec.num_params() == total == 46_702_792_704
    assert spec.active_params() == active == 12_879_925_248
    # FLOPs: 6 x active matmul weights (logits included) + attention, no causal halving
    s = 4096
    per_token = 6 * (L * (attention + 2 * expert + router) + V * h) + 12 * L * 32 * 128 * s
    assert flops.model_flops_per_token(spec, s) == per_token
    assert flops.expert_matmul_flops(spec) == 2 * 2 * expert


def test_tiny_spec_counts_and_flops_by_hand():
    # dense first block, then every second block from block 1: blocks 1 and 3 are MoE
    spec = tiny_moe(moe_first_dense=1, moe_every=2, shared_experts=1, shared_expert_hidden=5,
                    shared_expert_gate=True)  # fmt: skip
    assert spec.moe_layers == (1, 3)
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    attention = 8 * (8 + 2 * 4) + 8 * 8  # q, k, v (one kv head of 4), o = 192
    dense_mlp = 3 * 8 * 16  # 384
    expert = 3 * 8 * 6  # 144
    shared = 3 * 8 * 5  # 120
    router = 8 * 4 + 8  # router and the shared expert's gate
    moe_active = 2 * expert + shared + router  # 448
    moe_total = 4 * expert + shared + router  # 736
    norms = 2 * 8
    assert spec.layer_matmul_params(1) == attention + moe_active
    assert spec.layer_matmul_params(1, active=False) == attention + moe_total
    assert spec.layer_matmul_params(0) == attention + dense_mlp
    mean_active = attention + (2 * dense_mlp + 2 * moe_active) / 4
    assert spec.layer_matmul_params() == mean_active
    assert spec.num_params() == 2 * (attention + dense_mlp) + 2 * (attention + moe_total) + (
        4 * norms + 2 * 10 * 8 + 8
    )
    assert spec.active_params() == 2 * (attention + dense_mlp) + 2 * (attention + moe_active) + (
        4 * norms + 2 * 10 * 8 + 8
    )
    s = 6
    forward = 4 * (2 * mean_active + 4 * 2 * 4 * s) + 2 * 8 * 10
    assert flops.model_flops_per_token(spec, s) == 3 * forward
    assert flops.expert_matmul_flops(spec) == 2 * (2 * 2 * expert) / 4
    assert spec.mlp_width() == (2 * 16 + 2 * (2 * 6 + 5)) / 4
    # remat "full" reruns the active forward of every block
    full = flops.hardware_flops(spec, seq_len=s, remat="full", causal_skip=False)
    assert full == s * (3 * forward + 4 * (2 * mean_active + 4 * 2 * 4 * s))


def test_dense_counts_are_unchanged():
    spec = models.get("llama3-8b")
    assert spec.num_params() == spec.active_params() == 8_030_261_248
    assert spec.layer_matmul_params() == spec.layer_matmul_params(5) == 218_103_808
    assert spec.moe_layers == () and not spec.is_moe and flops.expert_matmul_flops(spec) == 0.0


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(experts=-1), "ModelSpec.experts=-1"),
        (dict(experts=4, top_k=0), "ModelSpec.top_k=0"),
        (dict(experts=4, top_k=5), "ModelSpec.top_k=5 must be an int in \\[1, experts=4\\]"),
        (dict(experts=0, top_k=2, expert_hidden=None), "ModelSpec.top_k=2 needs a mixture"),
        (dict(experts=0, shared_experts=1, expert_hidden=None, top_k=1), "shared_experts=1"),
        (dict(expert_hidden=0), "ModelSpec.expert_hidden=0"),
        (dict(routing="relu"), "ModelSpec.routing='relu' must be one of"),
        (dict(routed_scaling=0.0), "ModelSpec.routed_scaling=0.0"),
        (dict(moe_every=0), "ModelSpec.moe_every=0"),
        (dict(moe_first_dense=4), "ModelSpec.moe_first_dense=4 .* leaves no mixture"),
        (dict(moe_every=5), "leaves no mixture-of-experts block"),
        (dict(expert_groups=3), "ModelSpec.expert_groups=3 must divide experts=4"),
        (dict(expert_groups=2, topk_groups=3), "ModelSpec.topk_groups=3 must be <="),
        (dict(expert_groups=4, topk_groups=1), "ModelSpec.topk_groups=1: 1 groups of 1"),
        (dict(shared_expert_gate=True), "ModelSpec.shared_experts=0 with shared_expert_gate"),
        (dict(normalize_top_k=1), "ModelSpec.normalize_top_k=1 must be a bool"),
        (dict(shared_experts=1, shared_expert_hidden=-2), "shared_expert_hidden=-2"),
    ],
)
def test_bad_moe_fields_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        tiny_moe(**fields)


def test_is_moe_layer_checks_its_argument():
    with pytest.raises(ValueError, match="layer=4 must be an int in \\[0, num_layers=4\\)"):
        tiny_moe().is_moe_layer(4)


def test_deepseek_style_routing_fields_are_accepted():
    spec = tiny_moe(experts=8, top_k=4, expert_groups=4, topk_groups=2, routing="sigmoid",
                    routed_scaling=2.5, moe_first_dense=1, shared_experts=1)  # fmt: skip
    assert spec.moe_layers == (1, 2, 3) and spec.shared_expert_ffn_hidden == 6


def test_doctests():
    assert doctest.testmod(model_spec).failed == 0
    assert doctest.testmod(flops).failed == 0


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(experts=4, top_k=2, dense_layers=(2, 1)), "dense_layers=.* sorted tuple"),
        (dict(experts=4, top_k=2, dense_layers=(4,)), r"dense_layers=\(4,\)"),
        (dict(experts=4, top_k=2, dense_layers=(0, 1, 2, 3)), "leaves no mixture-of-experts"),
        (dict(dense_layers=(1,)), "dense_layers=.* needs a mixture of experts"),
        (dict(qk_norm="per_head"), "qk_norm='per_head' must be one of"),
        (dict(clip_qkv=0.0), "clip_qkv=0.0 must be None or a positive number"),
    ],
)
def test_dense_layers_qk_norm_and_clip_fields_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.tiny(num_layers=4, **fields)


def test_dense_layers_and_qk_norm_counts():
    spec = ModelSpec.tiny(num_layers=4, experts=4, top_k=2, moe_every=2, dense_layers=(3,))
    assert spec.moe_layers == (1,) and [spec.is_moe_layer(i) for i in range(4)] == [0, 1, 0, 0]
    dense = ModelSpec.tiny(num_layers=2)
    D, H, K = dense.head_dim, dense.heads, dense.kv_heads
    assert dense.replace(qk_norm="head").num_params() - dense.num_params() == 2 * 2 * D
    assert dense.replace(qk_norm="flat").num_params() - dense.num_params() == 2 * (H + K) * D


def test_gpt_oss_fields_counts_by_hand():
    """Sinks, q/k/v/o biases and expert biases (router `[E]`, each expert's gate/up `[2I]`
    and down `[F]`; `top_k` of them active), counted once each."""
    base = ModelSpec.tiny(num_layers=2, hidden=64, heads=4, kv_heads=2, experts=4, top_k=2,
                          expert_hidden=32, activation="swiglu_clamped")  # fmt: skip
    spec = base.replace(attention_bias=True, attention_sinks=True, expert_bias=True)
    D, H, K, F, E, hidden = 16, 4, 2, 64, 4, 32
    attention = (H + 2 * K) * D + F + H  # q, k, v, o biases and the sinks
    experts = E + E * (2 * hidden + F)
    assert spec.num_params() - base.num_params() == 2 * (attention + experts)
    active = E + 2 * (2 * hidden + F)
    assert spec.active_params() - base.active_params() == 2 * (attention + active)
    assert spec.layer_params(1) - base.layer_params(1) == attention + experts
    assert base.mlp_matrices == 3  # gated, as swiglu


def test_attention_flops_with_a_window_on_some_blocks():
    spec = ModelSpec.tiny(num_layers=4, window=8, window_layers=(0, 2))
    full, every = spec.replace(window=None, window_layers=None), spec.replace(window_layers=None)
    for skip in (False, True):
        got = flops.layer_attention_flops(spec, 64, causal_skip=skip)
        halves = [flops.layer_attention_flops(s, 64, causal_skip=skip) for s in (full, every)]
        assert got == pytest.approx(sum(halves) / 2)
        assert halves[0] > halves[1]
