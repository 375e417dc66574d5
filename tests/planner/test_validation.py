"""The planner against published large runs it was not fitted to (issue 27, item 3).

Each run of `shardfuse.planner.published.RUNS` (Korthikanti et al. 2022,
MegaScale 2024, Llama 3 2024, PaLM 2022, MaxText on TPU v5p/v5e, MT-NLG 2022,
and the mixtures of experts of `published.MOE_RUNS`: Megatron-Core's Qwen3-235B,
MaxText's Mixtral and Llama 4, NeMo AutoModel's Qwen3-30B; A100, H100, TPU v4,
v5p, v5e, v6e),
with its published parallelism pinned and its system's assumptions preset, must
be predicted within 15% (relative) of the published MFU, TFLOP/s per device or
step time. The efficiencies were fitted only to Narayanan et al. 2021 Table 1
(tests/planner/test_published.py), which none of these runs is part of. Runs
the model does not hold are listed as strict xfails with the reason: they fail
loudly the day they start to hold.
"""

import pytest

from shardfuse import hardware
from shardfuse.planner import plan
from shardfuse.planner.options import Assumptions
from shardfuse.planner.published import RUNS, parallelism_of, predict

TOLERANCE = 0.15
# The mixture-of-experts runs (issue 45) the model misses, measured (tests/planner/
# test_published_moe.py prints the table).
MOE_MISSES = {
    "Megatron Qwen3-235B A2A EP8 PP32": "-27.5% (step time): Megatron's all-to-all "
    "dispatcher inside a node, 32 stages of 1-layer chunks, 512 microbatches: the model "
    "prices the all-to-alls on NVLink, the head in the last stage's loss slot, the eager MoE "
    "layer's host time (moe_host, 2.4 s) and the dropless load at the measured "
    "expert_imbalance 1.229 (efficiency.EXPERT_IMBALANCE) and finds no term for the other "
    "6.7 s; the host time is DeepEP's (efficiency.MEGATRON_MOE_HOST_S): the A2A dispatcher "
    "launches more kernels (its permutations, the all-to-all-v's split sizes on the host; no "
    "figure published); the long-context rows' forced / dropless gap suggests this "
    "benchmark's router load is well above 1.229 (no measurement of it published)",
    "Megatron Qwen3-235B DeepEP EP8 TP4": "-25% (step time): TP 4 with EP 8 inside a node, "
    "256 microbatches of 4096 tokens; the host time of the eager MoE layer (moe_host, 4.8 s) "
    "and the dropless load at the measured 1.229 leave 7.2 s: the benchmark's router load "
    "above that (the long-context rows' dropless / forced gap, about 0.09 s a microbatch of "
    "16K tokens a device, scaled to this row's tokens would be about 3 s more), and tensor "
    "parallelism 4's kernels and collectives per layer (arXiv:2603.07685 Table 15: 'Decrease "
    "TP or increase MBS' to reduce kernel launches; no figure published)",
    "Megatron Qwen3-235B 16K dropless": "-19% (step time): dropless routing priced at the "
    "measured expert_imbalance 1.229 (FEPLB's GLM-5 at EP 8: efficiency.EXPERT_IMBALANCE); the "
    "published forced-balance and dropless rows differ by 0.087-0.090 s a microbatch at "
    "every sequence length (16K to 128K, 16K tokens a device), about 1.6-1.7 x the mean "
    "routed work on the busiest device: this benchmark's router load (Qwen3-235B's "
    "checkpoint on its data), of which no measurement outside this table is published; the "
    "forced row holds at -8%",
    "MaxText Llama4 Maverick v5p": "-32% (step time): 128 experts of top 1 under tensor 4; "
    "the model gives 15.8 s of compute (megablox's tiles visited once per group: 1024 rows "
    "an expert, 0.67) and hides 5.8 s of collectives at 0.95 (tensor-parallel all-gathers "
    "and reduce-scatters 2.9 s, FSDP gathers of 400B parameters 2.9 s); candidates for the "
    "other 8 s, not modelled: the collectives inside megablox's shard_map, which XLA does "
    "not overlap, and the gathers of MaxText's float32 weights (weight_dtype)",
}
# Known misses (measured errors in the README table), not hidden by loosening the tolerance.
MISSES = {
    "Korthikanti 22B": "+15.4%: 8 GPUs, batch 4 (0.9 s steps): per-step overheads the model "
    "lacks (kernel launches, small tensor-parallel GEMMs below the MAMF shapes)",
    "MT-NLG 530B": "+23%: DeepSpeed's pipeline engine of 2021 was slower than Megatron's "
    "(the same parallelism in Narayanan et al. 2021 Table 1 reached 163 TFLOP/s)",
    "Llama 3 405B 128K": "-29%: flash attention at 131K tokens taken at FlashAttention-2's 35% "
    "of the H100 peak; Meta's kernels ran faster (virtual stages not published, pinned at 2)",
    "MaxText 32B v5e": "-23%: 66.9% MFU with full remat means 89% of peak in the matmuls, "
    "above the TPU efficiency assumed (0.7; no TPU MAMF is published)",
    "Megatron Qwen3-235B MoE overlap": "-17% (step time): `ep_overlap` hides the all-to-alls "
    "behind the expert compute at the hardware's 0.85; Megatron's 1F1B overlap saved 2.1 s "
    "of the about 5.7 s the model gives them (the overlap's own cost is not modelled); the "
    "same layout without the overlap holds at -4.5%",
    **MOE_MISSES,
}


def _params():
    return [
        pytest.param(run, id=run.name.replace(" ", "-"), marks=pytest.mark.xfail(
            strict=True, reason=MISSES[run.name]) if run.name in MISSES else ())
        for run in RUNS
    ]  # fmt: skip


def test_at_least_eight_runs_hold_across_generations():
    held = [run for run in RUNS if run.name not in MISSES]
    assert len(held) >= 8
    devices = {hardware.resolve(run.device).key.split("-")[0] for run in held}
    assert {"a100", "h100", "tpu"} <= devices
    assert len({run.source.split(" (")[0].split(",")[0] for run in held}) >= 4


@pytest.mark.parametrize("run", _params())
def test_published_run_within_15_percent(run):
    value, e = predict(run)
    error = value / run.published - 1
    assert abs(error) <= TOLERANCE, (
        f"{run.name}: predicted {value:.4g}, published {run.published} ({error:+.1%})"
    )
    # every time term is named and the step is their sum, communication included
    assert e.step_time_s == pytest.approx(sum(t.value for t in e.time))


def test_the_pinned_layout_is_what_plan_returns():
    """`plan` with every field pinned returns exactly the published parallelism (PaLM: 12-way model
    parallelism at s = 2048 without sequence parallelism)."""
    run = next(r for r in RUNS if r.name == "PaLM 540B")
    cluster = hardware.cluster(run.device, nodes=run.nodes, devices_per_node=run.devices_per_node)
    parallelism = parallelism_of(run)
    best = plan(run.model, cluster, global_batch=run.global_batch, seq_len=run.seq_len,
                assumptions=Assumptions.preset(run.preset), mesh=parallelism.mesh_shape, top_k=1,
                **run.options)[0]  # fmt: skip
    assert best.parallelism == parallelism
    assert best.mfu == pytest.approx(predict(run)[0])
