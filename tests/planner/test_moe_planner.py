"""The planner knows experts (issue 44, item 3): the expert axis, its costs and its memory.

Oracles: the issue's all-to-all volume (dispatch + combine move `2 x routed tokens
x h x bytes x (EP - 1) / EP` per device per MoE block forward), the expert weights
divided by hand, the active-parameter FLOPs of `shardfuse.flops`, and the
Megatron-Core Qwen3-235B run (tests/planner/test_validation.py holds its
published-run check with the others).
"""

import argparse
import dataclasses
import json
import re
import time

import pytest

from shardfuse import flops, hardware, models
from shardfuse.planner import (
    Assumptions,
    Parallelism,
    PlanningError,
    cli,
    cost,
    estimate,
    parallelism_constraints,
    plan,
)
from shardfuse.planner.comm import all_to_all_s, expert_parallel_term, remote_node_copies
from shardfuse.planner.cost import axis_in_node
from shardfuse.planner.memory import params_per_device, state_bytes
from shardfuse.planner.published import RUNS, parallelism_of
from shardfuse.planner.step import Step

MIXTRAL = models.get("mixtral-8x7b")
QWEN3 = models.get("qwen3-30b-a3b")
NODE = hardware.cluster("h100")  # 8 H100s
TERMS = lambda e: {t.name: t for t in e.time}  # noqa: E731


def _mixtral_ep8(**options):
    base = dict(expert=8, zero=0, remat="full", num_microbatches=8, microbatch_size=1)
    return Parallelism.of(**{**base, **options})


def test_search_returns_expert_parallel_layouts():
    """A fine-grained MoE (128 experts of 768) on 16 H100s: expert parallelism is among the
    best plans, and no plan cuts the experts below the roofline's ridge with tensor
    parallelism (96 columns over model=8). Expert parallelism is not the best one: its
    static receive buffers (`memory.receive_factor`, 8 x the routed rows) need full remat
    here, which a pipeline with the experts over model=2 does not."""
    start = time.process_time()
    plans = plan(QWEN3, hardware.cluster("h100", nodes=2), global_batch=128, seq_len=4096,
                 top_k=5)  # fmt: skip
    assert time.process_time() - start < 60
    expert = [p for p in plans if p.parallelism.expert > 1]
    assert expert and all(p.parallelism.options.remat == "full" for p in expert)
    for p in plans:
        assert QWEN3.experts % p.parallelism.expert == 0
        assert p.parallelism.model <= 2
        assert not parallelism_constraints(QWEN3, p.parallelism, global_batch=128, seq_len=4096)
    assert {"expert_parallel", "expert_imbalance"} <= set(TERMS(expert[0].estimate))


def test_dense_models_get_no_expert_axis():
    plans = plan(models.get("llama3-8b"), NODE, global_batch=16, seq_len=2048, top_k=3)
    assert all(p.parallelism.expert == 1 for p in plans)
    with pytest.raises(PlanningError, match="expert=2: llama3-8b has no mixture-of-experts"):
        plan(models.get("llama3-8b"), NODE, global_batch=16, seq_len=2048, mesh={"expert": 2})


def test_constraints_name_the_expert_rules():
    spec = models.ModelSpec.tiny(experts=6, top_k=2, expert_hidden=30)
    broken = parallelism_constraints(spec, Parallelism.of(expert=4, model=2), global_batch=8,
                                     seq_len=64)  # fmt: skip
    assert "experts=6 % expert=4 != 0" in broken
    assert "expert_hidden=30 % model=2 != 0" not in broken  # 30 % 2 == 0
    broken = parallelism_constraints(spec, Parallelism.of(model=4), global_batch=8, seq_len=64)
    assert "expert_hidden=30 % model=4 != 0" in broken
    broken = parallelism_constraints(spec, Parallelism.of(expert=2), global_batch=3, seq_len=64)
    assert any("data x fsdp x expert" in rule for rule in broken)


def test_all_to_all_bytes_are_the_issues_formula():
    """Forward: 2 x routed tokens x h x bytes x (EP - 1) / EP per device per MoE block; the
    term: 4 all-to-alls (6 with the rerun forward of remat "full") per block and microbatch."""
    a = Assumptions()
    parallelism = _mixtral_ep8()
    e = estimate(MIXTRAL, NODE, parallelism, global_batch=64, seq_len=4096)
    tokens = 4096  # one sequence per microbatch, no sequence parallelism without `model`
    routed = tokens * MIXTRAL.top_k
    bw = 450e9  # NVLink 4 through the switch: one direction's bandwidth
    link = (bw, 1e-6 * hardware.cluster("h100").intra_link.latency_us, "NVLink")
    _, forward_bytes = expert_parallel_term(
        E=8, in_node=8, tokens=tokens, model=MIXTRAL, act=2, moe_layer_microbatches=1,
        reruns_forward=False, links=(link, link), expert_s=0.0, a=a, overlap=0.85,
    )  # fmt: skip
    assert forward_bytes == 2 * routed * 4096 * 2 * 7 / 8
    one = all_to_all_s(8, routed * 4096 * 2, *link[:2])
    term = TERMS(e)["expert_parallel"]
    assert term.total == pytest.approx(32 * 8 * 6 * one, rel=1e-9)  # L x m x 6 ("full")
    assert term.value == term.total  # exposed (Assumptions.ep_overlap=False)
    hidden = estimate(MIXTRAL, NODE, parallelism, global_batch=64, seq_len=4096,
                      assumptions=Assumptions(ep_overlap=True))  # fmt: skip
    assert TERMS(hidden)["expert_parallel"].value < term.value


def test_the_priced_dispatch_is_the_compiled_layers():
    """Over expert x model with sequence parallelism, shardfuse's ParallelMoE gathers the
    sequence over `model` before routing, so each model rank dispatches all of its data
    shard's tokens: the compiled dispatch's rows per destination are the planner's tokens x k
    (Megatron's preset, dispatching from the sequence shards, prices half of them)."""
    import jax
    from flax import nnx

    import shardfuse as sf
    from tests.layers.test_moe_structure import _compiled

    D, E, T, k, F, s = 2, 2, 2, 2, 16, 8
    mesh = jax.make_mesh((D, E, T), ("data", "expert", "model"))
    moe = sf.layers.ParallelMoE(F, 8, num_experts=4, top_k=k, sequence_parallel=True,
                                mesh=mesh, rngs=nnx.Rngs(0))  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (D * E, s, F))  # one sequence per replica
    text = _compiled(moe, x, grad=False).as_text()
    dispatch = [line for line in text.splitlines() if " all-to-all(" in line]
    rows = {int(m) for line in dispatch for m in re.findall(r"f32\[1,(\d+),\d+\]", line)}
    cluster = hardware.cluster("h100", nodes=1)
    parallelism = Parallelism.of(data=D, expert=E, model=T, microbatch_size=1)
    step = Step.of(models.ModelSpec.tiny(experts=4, top_k=k), cluster, parallelism,
                   global_batch=D * E, seq_len=s)  # fmt: skip
    assert rows == {cost.moe_tokens(step) * k} == {s * k}
    megatron = Step.of(step.model, cluster, parallelism, global_batch=D * E, seq_len=s,
                       assumptions=Assumptions.preset("megatron-moe"))  # fmt: skip
    assert cost.moe_tokens(megatron) == s / T


@pytest.mark.parametrize("ep", [2, 4])
def test_the_static_receive_buffers_are_the_layers(ep):
    """shardfuse receives into `EP x A` rows per device (static shapes, dropless) and its
    backward keeps them: the residuals of `ParallelMoE` on the GPU/TPU path (ragged
    dispatch, Pallas grouped matmul; traced, not run) over its receive buffers are what
    the memory model adds for them (`memory.receive_factor`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals

    import shardfuse as sf
    from shardfuse.planner.memory import receive_factor, saved_elements_per_token

    F, H, E, k, n = 32, 24, 8, 2, 8  # n tokens per device
    mesh = jax.make_mesh((ep, 8 // ep), ("expert", "data"))
    moe = sf.layers.ParallelMoE(F, H, num_experts=E, top_k=k, mesh=mesh, rngs=nnx.Rngs(0),
                                dispatch_implementation="ragged",
                                grouped_matmul_implementation="pallas_tpu")  # fmt: skip
    graphdef, state, rest = nnx.split(moe, nnx.Param, ...)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state, rest).forward_with_stats(x)[0] ** 2)

    x = jnp.ones((8, n, F))
    rows = ep * n * k  # a device's receive buffer
    kept = 0.0
    for aval, _ in saved_residuals(loss, state, x):
        # the receive-sized ones: `[ep x rows, ...]` split over expert alone (`f32[64@expert,32]`)
        if aval.ndim == 2 and aval.shape[0] == ep * rows and f"{ep * rows}@expert," in str(aval):
            size = np.prod(aval.shape) / ep
            kept += size / 4 if aval.dtype == jnp.bool_ else size  # in float32 elements
    # three copies of the rows, their mask (bool), six of H and one number a row
    assert kept == rows * (3 * F + F / 4 + 6 * H + 1)
    spec = models.ModelSpec.tiny(hidden=F, experts=E, top_k=k, expert_hidden=H, num_layers=1)
    parallelism = Parallelism.of(expert=ep, data=8 // ep)
    a = Assumptions(activation_bytes=4)
    assert receive_factor(parallelism, a) == ep
    static = saved_elements_per_token(spec, parallelism, a)["full_layer"]
    sized = saved_elements_per_token(
        spec, parallelism, Assumptions(activation_bytes=4, ep_static_receive=False)
    )
    routed_rows = k * (2 * F + 6 * H)  # what the routing-sized buffers keep a token
    assert static - sized["full_layer"] + routed_rows == pytest.approx(kept / n, rel=0.01)


def test_an_expert_group_across_nodes_sends_the_rest_over_the_network():
    cluster = hardware.cluster("h100", nodes=4)
    parallelism = Parallelism.of(expert=16, model=2)
    assert axis_in_node(cluster, parallelism, "expert") == 4
    assert remote_node_copies(2, 8, 1, dedup=False) == 0.0
    assert remote_node_copies(8, 128, 4, dedup=False) == 6.0
    # dedup: one copy per remote node that holds one of the 8 experts, at most 3
    assert 2.5 < remote_node_copies(8, 128, 4, dedup=True) < 3.0
    assert remote_node_copies(1, 128, 4, dedup=True) == pytest.approx(0.75)


def test_expert_weights_are_sharded_over_expert_and_model():
    h, f, L = 4096, 14336, 32
    expert = 3 * h * f
    a = Assumptions()
    whole = params_per_device(MIXTRAL, Parallelism(), a)
    assert whole == MIXTRAL.num_params()
    for E, T in ((8, 1), (4, 2), (2, 4)):
        sharded = params_per_device(MIXTRAL, Parallelism(model=T, expert=E), a)
        layer = (MIXTRAL.layer_params() - 8 * expert - 2 * h) / T + 8 * expert / (E * T) + 2 * h
        tables = 2 * 32000 * h / T
        assert sharded == pytest.approx(L * layer + tables + h, rel=1e-12)
    # ZeRO-1 over fsdp shards the optimizer state of the expert shards too
    p = Parallelism.of(fsdp=2, expert=4, zero=1)
    states = state_bytes(MIXTRAL, p, a)
    params = params_per_device(MIXTRAL, p, a)
    assert states == pytest.approx(params * (a.param_bytes + a.grad_bytes + a.optimizer_bytes / 2))


def test_the_estimate_counts_active_flops():
    e = estimate(MIXTRAL, NODE, _mixtral_ep8(), global_batch=64, seq_len=4096)
    assert e.model_flops == flops.model_flops(MIXTRAL, seq_len=4096, batch=64)
    active = 6 * MIXTRAL.active_params() * 64 * 4096
    assert e.model_flops < 1.1 * active + 12 * 32 * 32 * 128 * 4096 * 64 * 4096
    step = Step.of(MIXTRAL, NODE, _mixtral_ep8(), global_batch=64, seq_len=4096)
    # forward, backward, and the forward again under remat "full"
    assert step.expert_flops == 4 * 32 * 64 * 4096 * flops.expert_matmul_flops(MIXTRAL)


def test_expert_imbalance_and_the_capacity_factor_that_caps_it():
    step = Step.of(MIXTRAL, NODE, _mixtral_ep8(), global_batch=64, seq_len=4096)
    e = estimate(MIXTRAL, NODE, _mixtral_ep8(), global_batch=64, seq_len=4096)
    a2a = TERMS(e)["expert_parallel"].value
    excess = Assumptions().expert_imbalance - 1  # efficiency.EXPERT_IMBALANCE, measured
    assert excess == pytest.approx(0.186 / (1 - 0.186))
    assert TERMS(e)["expert_imbalance"].value == pytest.approx(excess * (step.expert_s + a2a))
    capped = estimate(MIXTRAL, NODE, _mixtral_ep8().replace(
        options=_mixtral_ep8().options.replace(capacity_factor=1.05)), global_batch=64,
        seq_len=4096)  # fmt: skip
    assert TERMS(capped)["expert_imbalance"].value == pytest.approx(0.05 * (step.expert_s + a2a))
    no_ep = estimate(MIXTRAL, NODE, Parallelism.of(model=8, remat="full", num_microbatches=8,
                                                    microbatch_size=8), global_batch=64,
                     seq_len=4096)  # fmt: skip
    assert not {"expert_parallel", "expert_imbalance"} & set(TERMS(no_ep))


def test_an_eager_moe_layer_waits_on_the_host_per_layer_and_microbatch():
    """`Assumptions.moe_host_s`: a fixed wait per MoE layer and microbatch, whatever the
    tokens (`cost.moe_host`); the Megatron MoE presets set it, no other preset does; the
    pipeline bubble charges it as stage work; dense models pay none."""
    from shardfuse.planner.efficiency import MEGATRON_MOE_HOST_S

    # the published pair it comes from: 17.6 s at 276 TFLOP/s without CUDA graphs, 320 with
    # them, over (128 + 7 / 4) microbatch slots of 12 MoE layers
    assert MEGATRON_MOE_HOST_S == pytest.approx(17.6 * (1 - 276 / 320) / (129.75 * 12))
    assert MEGATRON_MOE_HOST_S == pytest.approx(1.55e-3, abs=0.01e-3)
    for name in ("megatron-moe", "megatron-moe-overlap"):
        assert Assumptions.preset(name).moe_host_s == MEGATRON_MOE_HOST_S
    for name in ("shardfuse", "megatron-2022", "automodel", "maxtext", "llama3"):
        assert Assumptions.preset(name).moe_host_s == 0
    a = Assumptions(moe_host_s=2e-3)
    p = _mixtral_ep8()
    for seq_len in (1024, 4096):  # per microbatch and layer, not per token
        e = estimate(MIXTRAL, NODE, p, global_batch=64, seq_len=seq_len, assumptions=a)
        assert TERMS(e)["moe_host"].value == pytest.approx(8 * 32 * 2e-3)
        assert e.step_time_s == pytest.approx(sum(t.value for t in e.time))
    assert "moe_host" not in TERMS(estimate(MIXTRAL, NODE, p, global_batch=64, seq_len=4096))
    dense = models.get("llama3-8b")
    assert "moe_host" not in TERMS(estimate(dense, NODE, Parallelism.of(fsdp=8, zero=3,
                                   num_microbatches=2), global_batch=16, seq_len=4096,
                                   assumptions=a))  # fmt: skip
    # a pipelined async stage: the bubble grows with it
    run = next(r for r in RUNS if r.name == "Megatron Qwen3-235B MoE")
    parallelism = parallelism_of(run)
    cluster = hardware.cluster(run.device, nodes=run.nodes)
    kw = dict(global_batch=run.global_batch, seq_len=run.seq_len)
    with_host = estimate(run.model, cluster, parallelism, **kw, assumptions=run.assumptions())
    eager_free = dataclasses.replace(run.assumptions(), moe_host_s=0.0)
    without = estimate(run.model, cluster, parallelism, **kw, assumptions=eager_free)
    host = TERMS(with_host)["moe_host"].value
    assert host == pytest.approx(128 * 12 * MEGATRON_MOE_HOST_S)
    assert TERMS(with_host)["pipeline_bubble"].value > TERMS(without)["pipeline_bubble"].value
    assert with_host.step_time_s - without.step_time_s == pytest.approx(
        (128 + 7 / 4) * 12 * MEGATRON_MOE_HOST_S, rel=0.02
    )


def test_grouped_matmul_efficiency_prices_the_routed_experts_only():
    p = _mixtral_ep8()
    slow = Step.of(MIXTRAL, NODE, p, global_batch=64, seq_len=4096)
    fast = Step.of(MIXTRAL, NODE, p, global_batch=64, seq_len=4096,
                   assumptions=Assumptions(grouped_matmul_efficiency=1.0))  # fmt: skip
    e_slow = estimate(MIXTRAL, NODE, p, global_batch=64, seq_len=4096)
    e_fast = estimate(MIXTRAL, NODE, p, global_batch=64, seq_len=4096,
                      assumptions=Assumptions(grouped_matmul_efficiency=1.0))  # fmt: skip
    assert slow.expert_roofline == fast.expert_roofline == 1.0  # 1024 tokens an expert
    difference = TERMS(e_slow)["compute"].value - TERMS(e_fast)["compute"].value
    expected = slow.expert_flops / 8 / slow.rate * (1 / 0.85 - 1)
    assert difference == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="grouped_matmul_efficiency=0"):
        Assumptions(grouped_matmul_efficiency=0)
    with pytest.raises(ValueError, match="expert_imbalance=0.9"):
        Assumptions(expert_imbalance=0.9)


def test_small_experts_split_over_model_fall_below_the_ridge():
    wide = Step.of(QWEN3, NODE, Parallelism.of(expert=8, microbatch_size=1, num_microbatches=1),
                   global_batch=8, seq_len=4096)  # fmt: skip
    thin = Step.of(QWEN3, NODE, Parallelism.of(model=8, microbatch_size=8, num_microbatches=1),
                   global_batch=8, seq_len=4096)  # fmt: skip
    assert wide.expert_roofline > 0.9 and thin.expert_roofline < 0.5


def test_published_moe_run_layout():
    """The Megatron Qwen3-235B run as planned: EP over expert x model = 32, the all-to-all of
    its MoE blocks priced, and the forward bytes of the issue's formula."""
    run = next(r for r in RUNS if r.name == "Megatron Qwen3-235B MoE")
    p = parallelism_of(run)
    assert (p.pipeline, p.expert, p.model, p.replicas) == (8, 16, 2, 16)
    assert p.options.num_microbatches == 128
    assert run.metric == "step_s" and run.published == 19.7


def _run(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(argv))


def test_cli_plans_moe_models_and_takes_the_expert_axis(capsys):
    argv = ("--model mixtral-8x7b --device h100 --nodes 2 --seq 4096 --batch 64 --json --top 2 "
            "--mesh expert=8")  # fmt: skip
    assert _run(argv.split()) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all(p["mesh"]["expert"] == 8 for p in plans)
    with pytest.raises(argparse.ArgumentTypeError, match="expert=0"):
        cli.parse_mesh("expert=0")


@pytest.mark.parametrize(
    "spec_fields, nodes, batch, seq",
    [
        (dict(experts=16, top_k=2, expert_hidden=256), 2, 64, 2048),  # small experts: roofline
        (dict(experts=8, top_k=2, shared_experts=1, moe_first_dense=1), 1, 32, 4096),
    ],
)
def test_branch_and_bound_is_exact_for_experts(monkeypatch, spec_fields, nodes, batch, seq):
    """The bound takes the routed experts at their best roofline: pruning a mixture of experts'
    search returns exactly the exhaustive search's plans."""
    from shardfuse.planner import search

    spec = models.ModelSpec("moe", hidden=1024, heads=8, kv_heads=4, head_dim=128,
                            ffn_hidden=2048, num_layers=8, vocab_size=32000,
                            **spec_fields)  # fmt: skip
    cluster = hardware.cluster("h100", nodes=nodes)
    kwargs = dict(global_batch=batch, seq_len=seq, top_k=5)
    pruned = plan(spec, cluster, **kwargs)
    monkeypatch.setattr(search, "BOUND", False)
    exhaustive = plan(spec, cluster, **kwargs)
    assert [(p.parallelism, p.step_time_s) for p in pruned] == [
        (p.parallelism, p.step_time_s) for p in exhaustive
    ]
