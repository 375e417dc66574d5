"""Published large training runs, with their parallelisms: the planner's out-of-sample check.

Each `ValidationRun` is one run a paper or a project reports: the model, the
cluster, the mesh and options as published (pinned in `plan`), the system's assumptions
preset (`Assumptions.preset`) and the measured throughput (MFU, or TFLOP/s per
device in the paper's own FLOP count). tests/planner/test_validation.py
asserts the planner's prediction within 15% of each; the README lists them.
None of them was used to fit anything: the efficiencies come from
`planner.efficiency` (MAMF measurements and one factor fitted to Narayanan et
al. 2021 Table 1, which these runs are not part of). That table's runs are
`NARAYANAN_2021_TABLE1` (`PublishedRun`s: the parallel sizes, batch, GPUs and the
achieved TFLOP/s per GPU of each GPT of `shardfuse.models`, "gpt-1.7b" ... "gpt-1t").

Sources (the numbers, verified against the text where it is stored):
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198): the MFU of 22B/175B/530B/1T GPT models with
  sequence parallelism and selective recompute on A100 80GB (Selene), data
  parallel size 1, as tabulated in the Megatron-LM README ("Model FLOPs
  Utilization" 41.5%, 51.4%, 56.0%, 56.3%); the parallelisms are the paper's Table 3
  (t = 8; p = 1, 8, 35, 64; GPUs 8, 64, 280, 512; global batch 4, 64, 280, 512;
  sequence 2048).
- Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG
  530B" (arXiv:2201.11990): 530B on 280 DGX A100 nodes (2240 GPUs), t = 8,
  p = 35, d = 8, batch 1920, 126 TFLOP/s per GPU (Megatron's FLOP count, with
  recomputation).
- Jiang et al. 2024, "MegaScale: Scaling Large Language Model Training to More
  Than 10,000 GPUs" (NSDI'24): 175B on 12,288 A100s, 55.2% MFU (t = 8, p = 8,
  batch 6144, sequence 2048, interleaved pipeline).
- Dubey et al. 2024, "The Llama 3 Herd of Models" (arXiv:2407.21783), Table 4:
  405B on 8,192 H100s, TP 8, CP 1, PP 16, DP 64, sequence 8192, batch 32 per DP
  replica, 430 TFLOP/s per GPU, 43% BF16 MFU; on 16,384 H100s DP 128 and batch
  16 per replica, 400 TFLOP/s, 41%; at sequence 131,072 CP 16 (all-gather K/V
  context parallelism, their sec. 3.3.2), DP 8, 380 TFLOP/s, 38%. Its 126 layers sit on 16 stages
  of 8 layer slots (the first and last stage one layer short): planned as a
  128-layer model whose step time is the most loaded stage's, MFU counted on 126; the
  head runs in the last stage's free slot (`Assumptions.loss_slot`).
- Chowdhery et al. 2022, "PaLM" (arXiv:2204.02311), sec. 4 and Table 3: 540B on
  6144 TPU v4 chips (two pods of 3072), 12-way model parallelism x 256-way
  fully sharded data parallelism per pod, 2 pods data parallel, batch 2048 x
  2048 tokens, rematerialisation, 46.2% MFU.
- MaxText, MaxText/configs/v5p/README.md and 32b.sh (github.com/AI-Hypercomputer/
  maxtext): a 32B model (global_parameter_scale=32: emb 8192, 64 heads of 128,
  MLP 28672 SwiGLU, 32 layers, vocabulary 32000) on v5p-128 (64 chips),
  ici_fsdp 16 x ici_tensor 4, per-device batch 7 (28 sequences per fsdp replica,
  no accumulation), sequence 2048, remat
  "minimal", 71.47% MFU; and v5e/README.md, 32b.sh: the same model on v5e-256
  (fsdp 256), per-device batch 4, remat "full", 66.86% MFU.
- Megatron-Core MoE, Qwen3-235B-A22B (mixture of experts; the NVIDIA Megatron MoE
  model zoo, github.com/yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md,
  "Cross-node EP strategy", commit moe_dev f3e6c5): 256 H100s (NVLink 4, InfiniBand
  8 x 50 GB/s per node), BF16, sequence 4096, TP 2, CP 1, EP 32, PP 8, VPP 4, DP 16,
  expert TP 1, micro batch 1, global batch 2048 (128 accumulation steps), recompute of
  the norms and activations only, DeepEP dispatcher: a 19.7 s step (245 TFLOP/s per
  GPU in Megatron's count, causal attention halved); with the all-to-alls overlapped
  with the other microbatch's compute ("+1f1b overlap") 17.6 s (276). Checked against
  these figures: 245e12 x 256 x 19.7 s / (2048 x 4096 tokens) = 147 GFLOP per token,
  which is 6 x the active weights (22.2B less the input table) + 6 s a d L with the causal
  halving. Compared on the step time (`metric="step_s"`): the count conventions drop
  out. Planned as shardfuse lays it out: the 16-way data parallelism is the expert
  axis (which splits the batch outside the MoE blocks) and the experts are sharded
  over expert x model = 32, as Megatron's EP 32 over its TP 2 x DP 16 ranks; 94 layers
  on 8 stages of 4 chunks planned as 96 layer slots (the most loaded stage: 12 layers):
  the model config's `--account-for-embedding-in-pipeline-split` and
  `--account-for-loss-in-pipeline-split` give the embedding and the head one slot each, so
  the last stage runs the head in place of a layer (`Assumptions.loss_slot`, on every
  Qwen3-235B row).
  Preset "megatron-moe": DeepEP sends a token once per remote node
  (`Assumptions.ep_node_dedup`); modelled after a first prediction that charged every
  routed copy to InfiniBand came out 39% slow (a property of the dispatcher, nothing fitted).
  Routing: forced balanced. The table does not say; the same directory's run_235b.sh gives
  this layout as the "H100 baseline config" (TP 2, PP 8, VPP 4, EP 32, 32 nodes, batch
  2048, `--recompute-modules moe_act layernorm`, A2A_OVERLAP=1) with
  `--moe-router-force-load-balancing` (sbatch_benchmarking.sh alone is dropless: the flag
  is opt-in).

Mixture-of-experts runs (issue 45; `MOE_RUNS`, each with its `routing`), from three
publications of three systems:

- Megatron-Core (the Megatron-MoE-ModelZoo readme above, commit e865051), Qwen3-235B-A22B
  on 256 H100s, BF16, besides the two cross-node rows: the "Intra-node EP strategy" rows
  (main(1e057005)): the "A2A" dispatcher with TP 2, EP 8, PP 32, VPP 3, DP 4 (EDP 1),
  micro batch 1, global batch 2048, recompute of norms and activations, 24.2 s (200 TFLOP/s);
  DeepEP with TP 4, EP 8, PP 8, VPP 4, DP 8 (EDP 4), no recompute, 29.0 s (167 TFLOP/s);
  and the "Long Context" table (DeepEP, 32 nodes, TP 4, CP 1/2/4/8, EP 8, PP 8, VPP 4,
  global batch 256, `--recompute-modules layernorm moe`: `Assumptions.recompute_moe`), TFLOP/s
  per GPU at 16K, 32K, 64K tokens: 295 / 237, 335 / 277, 368 / 320 (forced balance /
  dropless). Those are Megatron's count (`megatron_flops_per_token`), turned into the step
  time they imply (`megatron_step_s`); at 128K (CP 8) the data-parallel size is 1 and
  shardfuse's expert axis, a batch axis, has no room: not planned. Routing: the
  long-context rows say; the intra-node rows do not and have no script: planned dropless
  (sbatch_benchmarking.sh's default).
- MaxText (github.com/AI-Hypercomputer/maxtext) as published by Google's TPU recipes
  (github.com/AI-Hypercomputer/tpu-recipes), step time from the logged line
  ("completed step: ..., seconds: ..."): Mixtral 8x7B on one v6e-256, training/trillium/
  Mixtral-8x7B-MaxText/README.md at commit 372537f (maxtext e7292a3, libtpu 20241028; benchmarks/
  maxtext_trillium_model_configs.py `mixtral_8x7b_dropped`: per-device batch 8, fsdp 256,
  sequence 4096, remat "full", capacity factor 1.25, `megablox=False`: dense dispatch,
  every expert padded to its capacity and the one-hot dispatch / combine einsums
  "BSM,BSEC -> EBCM", "EBCM,BSEC -> BSM" of layers/linears.py `dense_matmul`:
  `Assumptions.expert_capacity_padded`), 8.409 s; the
  same README at HEAD (7e88b6d; MaxText tag tpu-recipes-v0.1.2, per-device batch 12, the
  "custom" remat offloading the layer input and the q/k/v/out projections to the host,
  recomputing the rest: planned as "full", which also recomputes those projections), 13.484
  s; Mixtral 8x22B, training/trillium/Mixtral-8x22B-MaxText/README.md (c78c38e; its config
  `mixtral_8x22b_dropped`, maxtext 449b4fe, the same day: per-device batch 8, fsdp 64 x
  expert 4, the same offloading remat, capacity 1.25, `megablox=False`, weights bfloat16),
  24.706 s; Llama 4 Scout 17B-16E on v5p (training/v5p/Llama4-Scout-17B-16E-Maxtext/
  README.md, maxtext 3eb77db `llama4_scout_dropless_v5p_256`: per-device batch 8, sequence
  8192, fsdp over every chip, megablox dropless, remat offloading the layer input only:
  "full"), 31.652 s; the logged total_weights 33,554,432 = 512 chips x 8 x 8192: a
  v5p-1024; Llama 4 Maverick 17B-128E on v5p-256 (training/v5p/Llama4-Maverick-17B-128E-
  Maxtext/README.md, maxtext 9ca35d7 `llama4_maverick_dropless_v5p_256`: per-device batch
  4, sequence 8192, fsdp 32 x tensor 4, megablox dropless, the offloading remat as
  Mixtral's), 24.792 s: 512 sequences, 16 a fsdp replica (its 4 tensor-parallel chips
  share them), no accumulation. Model shapes: MaxText's configs/models/*.yml of those commits.
  The dropless runs' grouped matmuls are megablox's `gmm` with row tiles of
  `tile_batch_seq` 512 (base.yml of both commits), which visits a tile once for each group
  it holds rows of (kernels/megablox/gmm.py, `make_group_metadata`: "m // tm + num_groups
  - 1" tiles when every group starts inside a tile): `Assumptions.grouped_matmul_row_tile`.
  Maverick's 128 experts of 1024 rows each on a device make it 383 tile visits for 256
  tiles of rows.
  Routing as the configs name them: "dropping" (capacity 1.25, the `_dropped` configs) or
  "dropless".
- NeMo AutoModel (github.com/NVIDIA-NeMo/Automodel, docs/performance-summary.md at
  8d9bfb9, "System: DGX-H100, Precision: BF16"): Qwen3 MoE 30B on 8 H100s, global batch
  512, local batch 4, 16 accumulation steps, sequence 4096, EP 8, FSDP 8, TE + DeepEP,
  21.773 s a step (12,040 tokens/s per GPU); its config examples/benchmark/configs/
  qwen3_moe_30b_te_deepep.yaml: `fake_balanced_gate: true` (forced balanced),
  `activation_checkpointing: true` (remat "full"). Planned as expert = 8 (the dense
  weights replicated instead of FSDP-sharded: the same compute, gathers and reductions
  on one node's NVLink).

Not planned (no honest `ModelSpec` or hardware entry): DeepSeek-V3 (multi-head latent
attention; its report's H800 run is FP8), GPT-OSS (alternating 128-token sliding windows
and attention sinks), the GB200/B200 rows of the ModelZoo and Megatron-Bridge, and
MaxText's Mixtral 8x7B 54.89% MFU on v5p-128 (tests/end_to_end/tpu/mixtral/Run_Mixtral.md:
no layout published beside it).
"""

import dataclasses

from shardfuse.model_spec import ModelSpec
from shardfuse.model_spec import get as get_model


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One training run reported in a paper: its parallelism and its measured throughput.

    Attributes:
      model: a key of `shardfuse.models.MODELS`.
      tensor, pipeline, data: the parallel sizes (t, p, d); `tensor * pipeline * data == gpus`.
      global_batch: sequences per step.
      seq_len: tokens per sequence.
      gpus: devices used.
      device: a key of `shardfuse.hardware.DEVICES`.
      tflops_per_gpu: the achieved TFLOP/s per GPU the paper reports (its own FLOP count).
      source: where the numbers come from.
    """

    model: str
    tensor: int
    pipeline: int
    data: int
    global_batch: int
    seq_len: int
    gpus: int
    device: str
    tflops_per_gpu: float
    source: str


_TABLE1 = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1"

# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", Table 1 ("Weak-scaling throughput for GPT models
# ranging from 1 billion to 1 trillion parameters"): columns number of parameters,
# attention heads, hidden size, layers, tensor-parallel size, pipeline-parallel
# size, number of GPUs, batch size, achieved teraFLOP/s per GPU, percentage of
# theoretical peak, achieved aggregate petaFLOP/s. Data-parallel size = GPUs / (t p).
# Sequence length 2048, A100 80GB GPUs of the Selene supercomputer (section 5).
# Their FLOP count: 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per step
# (activation recomputation included).
NARAYANAN_2021_TABLE1: tuple[PublishedRun, ...] = tuple(
    PublishedRun(name, t, p, gpus // (t * p), batch, 2048, gpus, "a100-80gb", tflops, _TABLE1)
    for name, t, p, gpus, batch, tflops in (
        ("gpt-1.7b", 1, 1, 32, 512, 137.0),
        ("gpt-3.6b", 2, 1, 64, 512, 138.0),
        ("gpt-7.5b", 4, 1, 128, 512, 142.0),
        ("gpt-18b", 8, 1, 256, 1024, 135.0),
        ("gpt-39b", 8, 2, 512, 1536, 138.0),
        ("gpt-76b", 8, 4, 1024, 1792, 140.0),
        ("gpt-145b", 8, 8, 1536, 2304, 148.0),
        ("gpt-310b", 8, 16, 1920, 2160, 155.0),
        ("gpt-530b", 8, 35, 2520, 2520, 163.0),
        ("gpt-1t", 8, 64, 3072, 3072, 163.0),
    )
)


@dataclasses.dataclass(frozen=True)
class ValidationRun:
    """One published run: model, cluster, pinned parallelism, assumptions preset and its throughput.

    Attributes:
      name: short label.
      model: the `ModelSpec` as planned.
      device, nodes, devices_per_node: the cluster (`hardware.cluster`).
      mesh: the published mesh sizes (axes of `planner.MESH_AXES`).
      global_batch, seq_len: sequences per step and tokens per sequence.
      options: the remaining pinned `plan` options (zero, remat, schedule,
        microbatch_size, virtual_stages).
      preset: `Assumptions.preset` name of the system that ran it.
      published: the published figure; `metric` says which: "mfu" (a fraction),
        "tflops" (TFLOP/s per device, the paper's FLOP count with recomputation:
        the planner's hardware FLOPs) or "step_s" (the step time, seconds).
      model_flops_scale: the model FLOPs of the real model over the planned one's
        (Llama 3's 126 layers planned on 128 slots), applied to the MFU.
      source: where the numbers are published.
      routing: a mixture of experts' routing as run: "dropless" (every routed token
        computed, the load as the router leaves it: `Assumptions.expert_imbalance`),
        "forced balanced" (Megatron's `--moe-router-force-load-balancing`: every expert
        the same load, planned with `expert_imbalance=1`) or "dropping" (a capacity
        factor, `options["capacity_factor"]`); "" for a dense model.
      overrides: `Assumptions` fields the run sets beyond its preset (its dispatcher,
        its MoE implementation).
    """

    name: str
    model: ModelSpec
    device: str
    nodes: int
    devices_per_node: int | None
    mesh: dict
    global_batch: int
    seq_len: int
    options: dict
    preset: str
    published: float
    metric: str
    source: str
    model_flops_scale: float = 1.0
    routing: str = ""
    overrides: dict = dataclasses.field(default_factory=dict)

    def assumptions(self):
        """The run's `Assumptions`: its preset, its `overrides`, and `expert_imbalance=1`
        where the routing was forced balanced."""
        from shardfuse.planner.options import Assumptions

        overrides = dict(self.overrides)
        if self.routing == "forced balanced":
            overrides["expert_imbalance"] = 1.0
        return Assumptions.preset(self.preset, **overrides)


_GPT = ModelSpec.gpt
GPT_22B = _GPT("gpt-22b", 6144, 64, 48)
GPT_175B = _GPT("gpt-175b", 12288, 96, 96)
PALM_540B = ModelSpec("palm-540b", 18432, 48, 1, 256, 73728, num_layers=118,
                       vocab_size=256000, tied_embeddings=True)  # fmt: skip
MAXTEXT_32B = ModelSpec("maxtext-32b", 8192, 64, 64, 128, 28672, num_layers=32,
                         vocab_size=32000)  # fmt: skip
LLAMA3_405B_SLOTS = dataclasses.replace(
    get_model("llama3-405b"), name="llama3-405b", num_layers=128
)
QWEN3_235B_SLOTS = dataclasses.replace(get_model("qwen3-235b-a22b"), num_layers=96)
# MaxText configs/models/mixtral-8x22b.yml (maxtext 449b4fe): emb 6144, 48 heads, 8 kv heads
# of 128, MLP 16384 (SwiGLU), 56 layers, vocabulary 32768, 8 experts, top 2.
MIXTRAL_8X22B = ModelSpec("mixtral-8x22b", 6144, 48, 8, 128, 16384, num_layers=56,
                          vocab_size=32768, experts=8, top_k=2)  # fmt: skip
# MaxText configs/models/llama4-17b-16e.yml and llama4-17b-128e.yml (maxtext 3eb77db): emb
# 5120, 40 heads, 8 kv heads of 128, vocabulary 202048, 48 layers, one shared expert and
# top 1 of the routed; Scout 16 experts of 8192, every layer MoE; Maverick 128 experts of
# 8192, every 2nd layer MoE (`interleave_moe_layer_step: 2`), dense MLP 16384. Their chunked
# attention (chunks of 8192) is causal attention at the runs' 8192 tokens.
LLAMA4_SCOUT = ModelSpec("llama4-scout-17b-16e", 5120, 40, 8, 128, 8192, num_layers=48,
                         vocab_size=202048, experts=16, top_k=1, shared_experts=1)  # fmt: skip
LLAMA4_MAVERICK = ModelSpec("llama4-maverick-17b-128e", 5120, 40, 8, 128, 16384,
                            num_layers=48, vocab_size=202048, experts=128, top_k=1,
                            expert_hidden=8192, shared_experts=1, moe_every=2)  # fmt: skip


def megatron_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Megatron-LM's FLOPs per token of a training step (its `num_floating_point_operations`,
    megatron/training/training.py, the GQA branch, causal `average_ratio` 0.5): `12 L h (a d)
    (1 + k / a)` for the attention projections, `6 L s a d` for the causal attention cores,
    `18 L h f_e top_k` for the routed SwiGLU experts (every block MoE), `6 h V` for the
    logits; no recomputation.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.published import megatron_flops_per_token
      >>> round(megatron_flops_per_token(models.get("qwen3-235b-a22b"), 4096) / 1e9, 1)
      148.0
    """
    h, a, k, d, L = model.hidden, model.heads, model.kv_heads, model.head_dim, model.num_layers
    attention = 12 * L * h * a * d * (1 + k / a) + 6 * L * seq_len * a * d
    experts = 18 * L * h * model.expert_ffn_hidden * model.top_k
    return attention + experts + 6 * h * model.vocab_size


def megatron_step_s(model, seq_len, global_batch, devices, tflops_per_device) -> float:
    """The step time a Megatron-reported TFLOP/s per device implies: `megatron_flops_per_token
    x B s / (TFLOP/s x devices)`. Check: the 245 TFLOP/s of the Qwen3-235B row above give
    19.8 s; its table says 19.7 s.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.published import megatron_step_s
      >>> round(megatron_step_s(models.get("qwen3-235b-a22b"), 4096, 2048, 256, 245.0), 1)
      19.8
    """
    tokens = global_batch * seq_len
    return megatron_flops_per_token(model, seq_len) * tokens / (tflops_per_device * 1e12 * devices)


_MEGATRON_MOE = "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (H100, cross-node EP)"
_MEGATRON_MOE_INTRA = "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (H100, intra-node EP)"
_MEGATRON_MOE_LONG = "Megatron-MoE-ModelZoo best_practice/qwen3/readme.md (H100, Long Context)"
_TPU_RECIPES = "MaxText, tpu-recipes"
_AUTOMODEL = "NeMo AutoModel docs/performance-summary.md (DGX-H100, BF16)"

_KORTHIKANTI = "Korthikanti et al. 2022 (arXiv:2205.05198) Table 3; MFU: Megatron-LM README"
_MEGATRON = dict(zero=0, remat="selective", microbatch_size=1, schedule="1f1b")


_QWEN3_235B_RUN = ValidationRun(
    "Megatron Qwen3-235B MoE",
    QWEN3_235B_SLOTS,
    "h100",
    32,
    None,
    dict(pipeline=8, expert=16, model=2),
    2048,
    4096,
    dict(zero=0, remat="none", microbatch_size=1, schedule="interleaved", virtual_stages=4),
    "megatron-moe",
    19.7,
    "step_s",
    _MEGATRON_MOE,
    routing="forced balanced",
    overrides=dict(loss_slot=True),
)
_MOE_INTERLEAVED = dict(zero=0, microbatch_size=1, schedule="interleaved", virtual_stages=4)


def _long_context(seq_len, cp, routing, tflops):
    """A Long Context row: 256 H100s, TP 4, CP `cp`, EP 8 (expert 2 x model 4), PP 8, VPP 4,
    DP 8 / cp, batch 256, the MoE blocks recomputed."""
    kind = "forced" if routing == "forced balanced" else "dropless"
    return ValidationRun(
        f"Megatron Qwen3-235B {seq_len // 1024}K {kind}",
        QWEN3_235B_SLOTS,
        "h100",
        32,
        None,
        dict(pipeline=8, data=8 // cp // 2, expert=2, sequence=cp, model=4),
        256,
        seq_len,
        dict(_MOE_INTERLEAVED, remat="none"),
        "megatron-moe",
        megatron_step_s(get_model("qwen3-235b-a22b"), seq_len, 256, 256, tflops),
        "step_s",
        f"{_MEGATRON_MOE_LONG}: {tflops:g} TFLOP/s per GPU",
        routing=routing,
        overrides=dict(recompute_moe=True, loss_slot=True),
    )


RUNS: tuple[ValidationRun, ...] = (
    ValidationRun(
        "Korthikanti 22B",
        GPT_22B,
        "a100",
        1,
        None,
        dict(model=8, pipeline=1, data=1),
        4,
        2048,
        dict(_MEGATRON, microbatch_size=4),
        "megatron-2022",
        0.415,
        "mfu",
        _KORTHIKANTI,
    ),
    ValidationRun(
        "Korthikanti 175B",
        GPT_175B,
        "a100",
        8,
        None,
        dict(model=8, pipeline=8, data=1),
        64,
        2048,
        _MEGATRON,
        "megatron-2022",
        0.514,
        "mfu",
        _KORTHIKANTI,
    ),
    ValidationRun(
        "Korthikanti 530B",
        get_model("gpt-530b"),
        "a100",
        35,
        None,
        dict(model=8, pipeline=35, data=1),
        280,
        2048,
        _MEGATRON,
        "megatron-2022",
        0.560,
        "mfu",
        _KORTHIKANTI,
    ),
    ValidationRun(
        "Korthikanti 1T",
        get_model("gpt-1t"),
        "a100",
        64,
        None,
        dict(model=8, pipeline=64, data=1),
        512,
        2048,
        _MEGATRON,
        "megatron-2022",
        0.563,
        "mfu",
        _KORTHIKANTI,
    ),
    ValidationRun(
        "MT-NLG 530B",
        get_model("gpt-530b"),
        "a100",
        280,
        None,
        dict(model=8, pipeline=35, data=8),
        1920,
        2048,
        dict(_MEGATRON, remat="full"),
        "megatron-2021",
        126.0,
        "tflops",
        "Smith et al. 2022 (arXiv:2201.11990), sec. 2.3 / Table of system performance",
    ),
    ValidationRun(
        "MegaScale 175B",
        GPT_175B,
        "a100",
        1536,
        None,
        dict(model=8, pipeline=8, data=192),
        6144,
        2048,
        dict(_MEGATRON, schedule="interleaved", virtual_stages=2),
        "megascale",
        0.552,
        "mfu",
        "Jiang et al. 2024 (MegaScale, NSDI'24), abstract and Table 2",
    ),
    ValidationRun(
        "Llama 3 405B",
        LLAMA3_405B_SLOTS,
        "h100",
        1024,
        None,
        dict(model=8, pipeline=16, fsdp=64),
        2048,
        8192,
        dict(zero=2, remat="none", microbatch_size=1, schedule="interleaved", virtual_stages=2),
        "llama3",
        0.43,
        "mfu",
        "Dubey et al. 2024 (arXiv:2407.21783), Table 4",
        model_flops_scale=126 / 128,
        overrides=dict(loss_slot=True),
    ),
    ValidationRun(
        "Llama 3 405B 16K",
        LLAMA3_405B_SLOTS,
        "h100",
        2048,
        None,
        dict(model=8, pipeline=16, fsdp=128),
        2048,
        8192,
        dict(zero=2, remat="none", microbatch_size=1, schedule="interleaved", virtual_stages=2),
        "llama3",
        0.41,
        "mfu",
        "Dubey et al. 2024 (arXiv:2407.21783), Table 4",
        model_flops_scale=126 / 128,
        overrides=dict(loss_slot=True),
    ),
    ValidationRun(
        "Llama 3 405B 128K",
        LLAMA3_405B_SLOTS,
        "h100",
        2048,
        None,
        dict(model=8, sequence=16, pipeline=16, fsdp=8),
        128,
        131072,
        dict(
            zero=2,
            remat="none",
            microbatch_size=1,
            schedule="interleaved",
            virtual_stages=2,
            cp_strategy="all_gather",
        ),
        "llama3",
        0.38,
        "mfu",
        "Dubey et al. 2024 (arXiv:2407.21783), Table 4",
        model_flops_scale=126 / 128,
        overrides=dict(loss_slot=True),
    ),
    ValidationRun(
        "PaLM 540B",
        PALM_540B,
        "tpu-v4",
        2,
        3072,
        dict(model=12, fsdp=256, data=2),
        2048,
        2048,
        dict(zero=3, remat="full", microbatch_size=4),
        "palm",
        0.462,
        "mfu",
        "Chowdhery et al. 2022 (arXiv:2204.02311), sec. 4, Table 3",
    ),
    ValidationRun(
        "MaxText 32B v5p",
        MAXTEXT_32B,
        "tpu-v5p",
        1,
        64,
        dict(model=4, fsdp=16),
        448,
        2048,
        dict(zero=3, remat="dots", microbatch_size=28),
        "maxtext",
        0.7147,
        "mfu",
        "MaxText MaxText/configs/v5p/README.md, 32b.sh (v5p-128)",
    ),
    ValidationRun(
        "MaxText 32B v5e",
        MAXTEXT_32B,
        "tpu-v5e",
        1,
        256,
        dict(fsdp=256),
        1024,
        2048,
        dict(zero=3, remat="full", microbatch_size=4),
        "maxtext",
        0.6686,
        "mfu",
        "MaxText MaxText/configs/v5e/README.md, 32b.sh (1x v5e-256)",
    ),
    _QWEN3_235B_RUN,
    # The same layout with the all-to-alls overlapped ("+1f1b overlap").
    dataclasses.replace(
        _QWEN3_235B_RUN,
        name="Megatron Qwen3-235B MoE overlap",
        preset="megatron-moe-overlap",
        published=17.6,
        source=_MEGATRON_MOE + ", +1f1b overlap",
    ),
    ValidationRun(
        "Megatron Qwen3-235B A2A EP8 PP32",
        QWEN3_235B_SLOTS,
        "h100",
        32,
        None,
        dict(pipeline=32, expert=4, model=2),
        2048,
        4096,
        dict(_MOE_INTERLEAVED, remat="none", virtual_stages=3),
        "megatron-moe",
        24.2,
        "step_s",
        _MEGATRON_MOE_INTRA + ", A2A dispatcher",
        routing="dropless",
        overrides=dict(ep_node_dedup=False, loss_slot=True),
    ),
    ValidationRun(
        "Megatron Qwen3-235B DeepEP EP8 TP4",
        QWEN3_235B_SLOTS,
        "h100",
        32,
        None,
        dict(pipeline=8, data=4, expert=2, model=4),
        2048,
        4096,
        dict(_MOE_INTERLEAVED, remat="none"),
        "megatron-moe",
        29.0,
        "step_s",
        _MEGATRON_MOE_INTRA + ", DeepEP",
        routing="dropless",
        overrides=dict(loss_slot=True),
    ),
    *(
        _long_context(seq_len, cp, routing, tflops)
        for seq_len, cp, forced, dropless in (
            (16384, 1, 295.0, 237.0),
            (32768, 2, 335.0, 277.0),
            (65536, 4, 368.0, 320.0),
        )
        for routing, tflops in (("forced balanced", forced), ("dropless", dropless))
    ),
    ValidationRun(
        "MaxText Mixtral 8x7B v6e dropped",
        get_model("mixtral-8x7b"),
        "tpu-v6e",
        1,
        256,
        dict(fsdp=256),
        2048,
        4096,
        dict(zero=3, remat="full", microbatch_size=8, capacity_factor=1.25),
        "maxtext",
        8.409,
        "step_s",
        f"{_TPU_RECIPES} training/trillium/Mixtral-8x7B-MaxText/README.md (372537f)",
        routing="dropping",
        overrides=dict(expert_capacity_padded=True),
    ),
    ValidationRun(
        "MaxText Mixtral 8x7B v6e dropped offload",
        get_model("mixtral-8x7b"),
        "tpu-v6e",
        1,
        256,
        dict(fsdp=256),
        3072,
        4096,
        dict(zero=3, remat="full", microbatch_size=12, capacity_factor=1.25),
        "maxtext",
        13.484,
        "step_s",
        f"{_TPU_RECIPES} training/trillium/Mixtral-8x7B-MaxText/README.md (7e88b6d)",
        routing="dropping",
        overrides=dict(expert_capacity_padded=True),
    ),
    ValidationRun(
        "MaxText Mixtral 8x22B v6e dropped",
        MIXTRAL_8X22B,
        "tpu-v6e",
        1,
        256,
        dict(fsdp=64, expert=4),
        2048,
        4096,
        dict(zero=3, remat="full", microbatch_size=8, capacity_factor=1.25),
        "maxtext",
        24.706,
        "step_s",
        f"{_TPU_RECIPES} training/trillium/Mixtral-8x22B-MaxText/README.md (c78c38e)",
        routing="dropping",
        overrides=dict(expert_capacity_padded=True),
    ),
    ValidationRun(
        "MaxText Llama4 Scout v5p",
        LLAMA4_SCOUT,
        "tpu-v5p",
        1,
        512,
        dict(fsdp=512),
        4096,
        8192,
        dict(zero=3, remat="full", microbatch_size=8),
        "maxtext",
        31.652,
        "step_s",
        f"{_TPU_RECIPES} training/v5p/Llama4-Scout-17B-16E-Maxtext/README.md",
        routing="dropless",
        overrides=dict(grouped_matmul_row_tile=512),
    ),
    ValidationRun(
        "MaxText Llama4 Maverick v5p",
        LLAMA4_MAVERICK,
        "tpu-v5p",
        1,
        128,
        dict(fsdp=32, model=4),
        512,
        8192,
        dict(zero=3, remat="full", microbatch_size=16),
        "maxtext",
        24.792,
        "step_s",
        f"{_TPU_RECIPES} training/v5p/Llama4-Maverick-17B-128E-Maxtext/README.md",
        routing="dropless",
        overrides=dict(grouped_matmul_row_tile=512),
    ),
    ValidationRun(
        "AutoModel Qwen3-30B EP8",
        get_model("qwen3-30b-a3b"),
        "h100",
        1,
        None,
        dict(expert=8),
        512,
        4096,
        dict(zero=0, remat="full", microbatch_size=4),
        "automodel",
        21.773,
        "step_s",
        _AUTOMODEL + ", Qwen3 MoE 30B",
        routing="forced balanced",
    ),
)
# The mixture-of-experts runs (issue 45): every run with a routing.
MOE_RUNS: tuple[ValidationRun, ...] = tuple(run for run in RUNS if run.routing)


def parallelism_of(run: ValidationRun):
    """The published mesh and options of `run` as a `Parallelism` (microbatches from the
    batch per replica)."""
    from shardfuse.planner.options import MESH_AXES, Parallelism

    mesh = {axis: run.mesh.get(axis, 1) for axis in MESH_AXES}
    options = dict(run.options)
    mb = options.pop("microbatch_size")
    capacity = options.pop("capacity_factor", None)
    replicas = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    parallelism = Parallelism.of(**mesh, **options, microbatch_size=mb,
                                 num_microbatches=run.global_batch // (replicas * mb))  # fmt: skip
    if capacity is not None:
        parallelism = parallelism.replace(
            options=parallelism.options.replace(capacity_factor=capacity)
        )
    return parallelism


def predict(run: ValidationRun):
    """`(predicted figure, estimate)`: the planner's MFU or TFLOP/s per device for `run`.

    The cost model on the pinned parallelism (`parallelism_of`), under the run's preset;
    `estimate.fits` says whether the planner's memory model would also admit it
    (a throughput check: memory is checked against compiled programs elsewhere).

    Example:
      >>> from shardfuse.planner.published import RUNS, predict
      >>> value, e = predict(RUNS[1])
      >>> abs(value / RUNS[1].published - 1) < 0.15  # Korthikanti 175B
      True
    """
    from shardfuse import hardware
    from shardfuse.planner.constraints import parallelism_constraints
    from shardfuse.planner.cost import estimate

    cluster = hardware.cluster(run.device, nodes=run.nodes, devices_per_node=run.devices_per_node)
    a = run.assumptions()
    parallelism = parallelism_of(run)
    sizes = dict(global_batch=run.global_batch, seq_len=run.seq_len)
    broken = parallelism_constraints(run.model, parallelism, assumptions=a, **sizes)
    if broken:
        raise ValueError(f"{run.name}: the published parallelism breaks {broken}")
    e = estimate(run.model, cluster, parallelism, assumptions=a, **sizes)
    if run.metric == "tflops":
        return e.tflops_per_device, e
    if run.metric == "step_s":
        return e.step_time_s, e
    return e.mfu * run.model_flops_scale, e
