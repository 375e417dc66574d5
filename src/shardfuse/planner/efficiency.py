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
