"""Per-hardware figures the cost model cannot derive: matmul efficiency and overlap.

Matmul efficiency (the fraction of the dense peak a training step's matmuls
reach) = MAMF x `LAYER_SHAPE_FACTOR`:

- MAMF, the maximum achievable matmul FLOP/s of the best-shaped BF16 GEMM,
  measured: S. Bekman, "Machine Learning Engineering",
  compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
  table" (github.com/stas00/ml-engineering): A100 SXM 267.9 of 312 TFLOP/s
  (85.9%, CUDA 12.1), A100 PCIe 256.4 (82.2%), H100 SXM 792.1 of 989 (80.1%),
  GH200 821.0 (83.0%). H100 NVL/PCIe and H200 are taken at the H100 SXM
  fraction (same tensor cores; not measured there).
- TPUs: no MAMF is published. STATED, not measured: taken at A100's 85.9%
  (the MXU is a systolic array fed from VMEM; XLA's own matmuls on large
  shapes are reported near peak, but we found no measurement to cite).
- `LAYER_SHAPE_FACTOR` = 0.815: the matmuls of a training step (tensor-parallel
  shards, attention's batched matmuls, fused epilogues, the optimizer) reach
  0.815 of MAMF. Fitted once, in sample, to Narayanan et al. 2021 Table 1
  (A100: 0.859 x 0.815 = 0.70, the constant the planner used before); never
  refitted to the validation runs of tests/planner/test_validation.py.

Flash-attention efficiency (fraction of peak of the fused attention kernels,
forward and backward, where `Assumptions.flash_attention`): Dao 2023
("FlashAttention-2", abstract): 50-73% of the A100's peak: 0.6 taken; Shah et
al. 2024 ("FlashAttention-3", abstract): FlashAttention-2 reaches only 35% on
H100: 0.35 (shardfuse's Triton kernel is FlashAttention-2's algorithm).
TPUs: the matmul efficiency (no figure found: stated). Without flash
attention the scores are batched matmuls at the matmul efficiency.
cuDNN's fused attention on H100 (what Transformer Engine runs on Hopper, the
`attention_efficiency` of the presets of TE-based systems): Shah et al. 2024
(FlashAttention-3, arXiv:2407.08608), figures "Attention forward speed, head dim
128" (causal mask) and "Attention backward speed, head dim 128" (H100 80GB SXM5,
BF16): cuDNN forward 518 / 539 TFLOP/s and backward 499 / 516 at 4K / 16K tokens
(FlashAttention-2: 319 / 335 and 310 / 322, the 35% above), i.e. forward 0.52-0.55
and backward 0.50-0.52 of the 989 TFLOP/s peak; the backward's 2.5x FLOPs weighted:
0.51-0.53: `CUDNN_ATTENTION` 0.52.

Overlap (the fraction of a collective's time that can hide behind compute
that runs at the same time, where the schedule lets it): STATED assumptions,
shown in every plan's JSON:

- GPUs 0.85: NCCL collectives run as kernels on the SMs (tens of CTAs) and
  share HBM bandwidth with the compute they overlap, which slows by some
  10-15% (Jiang et al. 2024, MegaScale, sec. 3.3, on overlapping TP and DP
  communication; the exact figure is not published: stated).
- TPUs 0.95: ICI transfers are DMAs that use no compute cores (async
  collectives of XLA:TPU).
- CPUs (simulated devices) 0.0: the "devices" are threads of one process on
  shared cores; a collective is a memory copy that competes with compute.
"""

from shardfuse.hardware import Device

# key prefix of shardfuse.hardware.DEVICES -> MAMF fraction of the dense bf16 peak
MAMF = {
    "a100-80gb-pcie": 0.822,
    "a100": 0.859,
    "gh200": 0.830,
    "h100": 0.801,
    "h200": 0.801,
    "tpu": 0.859,  # stated, not measured (module docstring)
    "cpu": 1.0,  # the simulated CPU device's peak is its measured rate
}
LAYER_SHAPE_FACTOR = 0.815
FLASH_ATTENTION = {"a100": 0.6, "h100": 0.35, "h200": 0.35, "gh200": 0.35}
CUDNN_ATTENTION = 0.52  # H100, forward and backward (module docstring)
OVERLAP = {"tpu": 0.95, "cpu": 0.0}
GPU_OVERLAP = 0.85

# Megatron-Core's MoE layer on H100, eager (no CUDA graphs): the host time the GPU waits
# for, per MoE layer and microbatch, forward and backward (`Assumptions.moe_host_s`).
_QWEN3_EAGER_STEP_S = 17.6  # 276 TFLOP/s, no CUDA graphs
_QWEN3_EAGER_TFLOPS, _QWEN3_GRAPHED_TFLOPS = 276, 320
_QWEN3_MICROBATCHES, _QWEN3_STAGES, _QWEN3_VIRTUAL, _QWEN3_STAGE_LAYERS = 128, 8, 4, 12
MEGATRON_MOE_HOST_S = (
    _QWEN3_EAGER_STEP_S * (1 - _QWEN3_EAGER_TFLOPS / _QWEN3_GRAPHED_TFLOPS)
    / ((_QWEN3_MICROBATCHES + (_QWEN3_STAGES - 1) / _QWEN3_VIRTUAL) * _QWEN3_STAGE_LAYERS)
)  # fmt: skip
"""Seconds a Megatron-Core MoE layer's host work adds per microbatch (forward and
backward) on H100: 1.55e-3, what CUDA graphs of the layer's static part remove, from two
published runs of one layout that differ in CUDA graphs.

- Eager: NVIDIA Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md, H100 table,
  "Cross-node EP strategy", the "+1f1b overlap" row: Qwen3-235B, DeepEP, BF16, 256 H100s,
  4096 tokens, TP 2, EP 32, PP 8, VPP 4, DP 16, MBS 1, GBS 2048 (GA 128), recompute
  "norm, act": "17.6" s, "276" TFLOP/s; its command (examples/qwen3/run_235b.sh, "Inter-node
  EP + 1F1B overlap solution") sets no CUDA graphs.
- Graphed: the same repository's best_practice/qwen3/run_h100_235b.sh, "# H100 config, 320
  TFLOPS": the same TP 2, PP 8, VPP 4, EP 32, 32 nodes, GBS 2048, `--recompute-modules
  moe_act layernorm --moe-router-force-load-balancing`, DeepEP, A2A_OVERLAP=1, with
  `--cuda-graph-impl transformer_engine --cuda-graph-scope moe_router moe_preprocess`;
  NVIDIA, "Scalable Training of Mixture-of-Experts Models with Megatron Core"
  (arXiv:2603.07685v2), Table 11 ("Qwen3-235B H100 256 4,096 BF16 320") and Table 20 ("TP2
  PP8 CP1 EP32 VPP 4 MBS1 GBS2048"), Appendix B.2 (Qwen3-235B: "Dispatcher: ... DeepEP on
  H100", "1F1B overlap: ... ON for GB200 and H100", "CUDA Graphs: attn, moe_router,
  moe_preprocess"), force-balanced routing as the eager row.

The same step's FLOPs at 320 instead of 276 TFLOP/s: `17.6 x (1 - 276 / 320)` = 2.42 s of
the step; over the 128 microbatches and the interleaved bubble's `(P - 1) / v` = 7 / 4
microbatch slots (how `pipeline_time` charges a per-microbatch stage term) and the 12 MoE
layers of the fullest stage (94 layers and the embedding's and loss's slots on 8 stages):
1.55 ms. What it is (arXiv:2603.07685 sec. 4.3.1, "Host Overhead": "Numerous small
operations create kernel launch overhead, and the CPU cannot dispatch work fast enough to
keep the GPU saturated", and "Dropless routing: Dynamic token counts require host-device
synchronization to determine tensor shapes, placing the CPU on the critical path"; sec.
4.3.6: "Each kernel launch incurs several microseconds of CPU-side cost", and partial CUDA
graphs capture attention, router and EP preprocessing). A fixed cost per layer and
microbatch: the kernels launched, not the tokens, set it.

A lower bound of the eager layer's host cost (sec. 4.3.6: with partial graphs "the
remaining CPU overhead is primarily confined to the region between token dispatch and
combine", which stays in the 320 TFLOP/s run) and an upper bound of the graphs' effect
alone (the two rows come from different Megatron commits: moe_dev f3e6c5 for the eager
row). The eager row is itself a validation run (`published.RUNS`, "Megatron Qwen3-235B MoE
overlap"): this figure is the measured difference of two published runs, not a fit of the
planner's error.
"""


# The most loaded device's routed work over the mean, in dropless routing over an expert
# axis (`Assumptions.expert_imbalance`): measured, not fitted.
_FEPLB_IDLE_FRACTION = 0.186  # GLM-5 MoE layers, 128 experts, EP 8, H100s
EXPERT_IMBALANCE = 1 / (1 - _FEPLB_IDLE_FRACTION)
"""The most loaded device's share of a dropless MoE layer's routed work over the mean: 1.23.

Source: Qi, Liu and Zhao 2026, "FEPLB: Exploiting Copy Engines for Nearly Free MoE Load
Balancing in Distributed Training" (arXiv:2604.19654), sec. 1 and Fig. 1(b): on GLM-5's MoE
layers (128 routed experts, no auxiliary loss, EP = 8, H100s) the per-micro-batch load
imbalance "wastes 18.6% of GPU time per MoE layer on average" (the figure as the paper's
stored technical review, zzz0906.github.io 2026-04-24 and 04-29, quotes it; the paper's
body is not stored here). A synchronous layer lasts as long as its most loaded device, so
the average device idles `1 - mean / max` of it: `max / mean = 1 / (1 - 0.186)` = 1.229.
A lower bound of the routed work's own ratio where the layer time holds load-independent
parts too. A trained router balanced over the batch, not the micro-batch (GLM-5 without an
auxiliary loss; Qwen3's global-batch balancing loss is the same regime), on real text; not
one of `published.RUNS` and not fitted to any of them. Per-expert max / mean changes by at
most 5% from EP 4 to 32 on real text (Ma et al. 2026, "Diagnosing Overhead in Dispatch
Operations", arXiv:2605.20982, abstract): taken for every expert-axis size. It replaces the
stated 1.15 of the planner before (no source: "inside the 1.1-1.25 that auxiliary-loss-
balanced routers leave at scale").
"""


def _lookup(table, key, default):
    for prefix in sorted(table, key=len, reverse=True):
        if key.startswith(prefix):
            return table[prefix]
    return default


def mamf_fraction(device: Device) -> float:
    """The measured best-GEMM fraction of peak of `device` (the module docstring's sources).

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.efficiency import mamf_fraction
      >>> mamf_fraction(hardware.device("h100-sxm")), mamf_fraction(hardware.device("a100-80gb"))
      (0.801, 0.859)
    """
    return _lookup(MAMF, device.key, MAMF["a100"])


def matmul_efficiency(device: Device) -> float:
    """Fraction of the dense peak a training step's matmuls reach: `MAMF x LAYER_SHAPE_FACTOR`.

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.efficiency import matmul_efficiency
      >>> round(matmul_efficiency(hardware.device("a100-80gb")), 3)
      0.7
      >>> round(matmul_efficiency(hardware.device("h100-sxm")), 3)
      0.653
    """
    if device.key.startswith("cpu"):
        return 1.0
    return mamf_fraction(device) * LAYER_SHAPE_FACTOR


def overlap_fraction(device: Device) -> float:
    """Fraction of an overlappable collective's time hidden behind concurrent compute.

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.efficiency import overlap_fraction
      >>> overlap_fraction(hardware.device("h100-sxm"))
      0.85
      >>> overlap_fraction(hardware.device("tpu-v5p"))
      0.95
    """
    return _lookup(OVERLAP, device.key, GPU_OVERLAP)


def attention_efficiency(device: Device) -> float:
    """Fraction of peak the flash-attention kernels reach (the module docstring's sources).

    Example:
      >>> from shardfuse import hardware
      >>> from shardfuse.planner.efficiency import attention_efficiency
      >>> attention_efficiency(hardware.device("h100-sxm"))
      0.35
    """
    return _lookup(FLASH_ATTENTION, device.key, None) or matmul_efficiency(device)
