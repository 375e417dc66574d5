"""Launch configurations of the Triton attention kernels, per GPU generation and head dim.

An `AttentionKernelConfig` is the tile shape and the launch options of one kernel:
`block_m` query rows and `block_n` key rows per tile, `num_warps`, and
`num_stages` (software-pipelining depth of the inner loop). `TUNED` maps
(GPU generation, padded head dim, input class) to the four kernels' configs.

How the table was chosen: with no GPU to time configurations at first,
`python -m shardfuse.bench.tools.triton_compile_stats --search` compiled candidate configs (the
Triton fused-attention tutorial's A100/H100 choices first: 128 x 64 forward
tiles, 32 x 128 dK/dV and 128 x 32 dQ tiles, then smaller tiles, more warps,
fewer pipeline stages) for each generation, head dim and input class, in
two variants (plain causal; causal + window + segment ids + softcap), and
kept the first with 0 register spills in both and shared memory within the
per-block limit (A100 166912 B, H100 232448 B).
`bench/results/triton_compile_stats.md` lists registers, spills and shared
memory of every default. Entries timed on a GPU since are listed in `GPU_TIMED`
with the measurement. float32 inputs use exact IEEE dots (no TF32, to
match the HIGHEST-precision oracle) on FMA units, which need far smaller
tiles and do not fit above head dim 64. Re-tune on the target GPU with
`python -m shardfuse.bench.tools.triton_tune` (candidates timed, results checked)
and edit the table; a launch lowers `num_stages` where a config's shared memory
does not fit the GPU at hand (`shardfuse.kernels.triton.compile_stats.fit_num_stages`).

Generations: "sm80" (A100, compute capability 8.x) and "sm90" (H100/H200,
9.x; newer GPUs use the sm90 table). Head dims are padded to the next power
of two >= 16 in registers (masked loads), up to 256.
"""

import dataclasses

import numpy as np

from shardfuse.kernels.triton.compile_stats import generation

KERNELS_MODULE = "shardfuse.kernels.attention.triton_kernels"  # the kernels these configs launch

MAX_HEAD_DIM = 256
# float32 inputs use exact IEEE dots (FMA, no tensor cores): above this head dim
# the dQ kernel spills at any tile size, so float32 falls back to another implementation.
MAX_FLOAT32_HEAD_DIM = 64
GENERATIONS = ("sm80", "sm90")
KERNELS = ("forward", "delta", "dkdv", "dq")


@dataclasses.dataclass(frozen=True)
class AttentionKernelConfig:
    """Tile shape and launch options of one kernel.

    Attributes:
      block_m: query rows per tile (a power of two >= 16).
      block_n: key rows per tile (a power of two >= 16; unused by "delta").
      num_warps: warps per program.
      num_stages: software-pipelining stages of the inner loop.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class AttentionConfigs:
    """The configs of the four kernels of one attention call."""

    forward: AttentionKernelConfig
    delta: AttentionKernelConfig
    dkdv: AttentionKernelConfig
    dq: AttentionKernelConfig

    def get(self, kernel: str) -> AttentionKernelConfig:
        return getattr(self, kernel)


def _configs(forward, dkdv, dq, delta=(128, 16, 4, 1)):
    return AttentionConfigs(
        forward=AttentionKernelConfig(*forward),
        delta=AttentionKernelConfig(*delta),
        dkdv=AttentionKernelConfig(*dkdv),
        dq=AttentionKernelConfig(*dq),
    )


# (generation, padded head dim, "16bit" | "float32") -> configs, filled in by
# `python -m shardfuse.bench.tools.triton_compile_stats --search`.
# Tuples: (block_m, block_n, num_warps, num_stages).
_16BIT = {
    ("sm80", 16): ((128, 64, 8, 3), (32, 128, 8, 3), (128, 32, 8, 3)),
    ("sm80", 32): ((128, 64, 8, 3), (32, 64, 4, 1), (128, 32, 8, 3)),
    ("sm80", 64): ((128, 64, 8, 3), (32, 64, 4, 1), (128, 32, 8, 3)),
    ("sm80", 128): ((128, 32, 8, 2), (32, 64, 8, 2), (64, 32, 4, 2)),
    ("sm80", 256): ((64, 32, 8, 2), (32, 32, 8, 2), (64, 32, 8, 2)),
    ("sm90", 16): ((128, 64, 8, 3), (32, 128, 8, 3), (128, 32, 8, 3)),
    ("sm90", 32): ((128, 64, 8, 3), (32, 128, 8, 3), (128, 32, 8, 3)),
    ("sm90", 64): ((128, 64, 8, 3), (32, 64, 4, 3), (128, 32, 8, 3)),  # dkdv: GPU_TIMED
    ("sm90", 128): ((128, 64, 8, 3), (32, 128, 8, 3), (128, 32, 8, 3)),  # dkdv: GPU_TIMED
    ("sm90", 256): ((128, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 1)),
}
_FLOAT32 = {  # exact IEEE dots; head dims up to MAX_FLOAT32_HEAD_DIM
    ("sm80", 16): ((64, 32, 8, 2), (16, 32, 4, 1), (32, 16, 4, 1)),
    ("sm80", 32): ((32, 32, 8, 2), (16, 32, 8, 1), (32, 16, 4, 1)),
    ("sm80", 64): ((64, 32, 8, 2), (16, 32, 8, 1), (32, 16, 4, 1)),
    ("sm90", 16): ((32, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
    ("sm90", 32): ((32, 32, 8, 2), (16, 32, 8, 1), (32, 32, 8, 2)),
    ("sm90", 64): ((64, 32, 8, 2), (32, 32, 8, 2), (32, 32, 8, 2)),
}
# Entries re-chosen by timing on a GPU (`python -m shardfuse.bench.tools.triton_tune`),
# which may keep a few spilled registers when that measured faster, and where.
GPU_TIMED = {
    ("sm90", 128, "16bit", "dkdv"): (
        "H200, 2026-11-26, bench/results/2026-11-26_h200_triton_tune.md: forward + "
        "backward of B=4, S=4096, H=16, D=128, bfloat16, non-causal in 6.67 ms against "
        "10.18 ms with (32, 64, 8, 2), results bitwise equal; 0 spills causal, 36/44 bytes "
        "with every mask option (triton 3.9 ptxas)"
    ),
    ("sm90", 64, "16bit", "dkdv"): (
        "H200, 2026-11-26, bench/results/2026-11-26_h200_triton_tune_d64.md: forward + "
        "backward of B=4, S=4096, H=32, D=64, bfloat16 in 6.22 ms non-causal and 4.36 ms "
        "causal against 7.91 and 5.08 ms with (32, 128, 8, 3), results bitwise equal; "
        "0 spills causal and with every mask option (triton 3.9 ptxas)"
    ),
}
GPU_TIMED_SPILL_BYTES = 128  # the spill stores / loads a GPU-timed entry may keep


def spill_allowance(generation: str, head_dim: int, dtype, kernel: str, config) -> int:
    """Spill bytes accepted for `config` of `kernel`: 0, or a few for a GPU-timed table entry.

    Example:
      >>> import jax.numpy as jnp
      >>> tuned = default_configs(90, 128, jnp.bfloat16)
      >>> spill_allowance("sm90", 128, jnp.bfloat16, "dkdv", tuned.dkdv)
      128
      >>> spill_allowance("sm90", 128, jnp.bfloat16, "dq", tuned.dq)
      0
    """
    kind = "float32" if np.dtype(dtype) == np.float32 else "16bit"
    key = (generation, padded_head_dim(head_dim), kind)
    timed = (*key, kernel) in GPU_TIMED and TUNED[key].get(kernel) == config
    return GPU_TIMED_SPILL_BYTES if timed else 0


TUNED = {}
for (_generation, _padded), (_forward, _dkdv, _dq) in _16BIT.items():
    TUNED[(_generation, _padded, "16bit")] = _configs(_forward, _dkdv, _dq)
for (_generation, _padded), (_forward, _dkdv, _dq) in _FLOAT32.items():
    TUNED[(_generation, _padded, "float32")] = _configs(_forward, _dkdv, _dq, delta=(64, 16, 4, 1))


def padded_head_dim(head_dim: int) -> int:
    """The register tile width of a head dim: the next power of two, at least 16.

    Example:
      >>> from shardfuse.kernels.attention.triton_configs import padded_head_dim
      >>> padded_head_dim(8), padded_head_dim(72), padded_head_dim(128)
      (16, 128, 128)
    """
    return max(16, 1 << (int(head_dim) - 1).bit_length())


def default_configs(compute_capability: int, head_dim: int, dtype) -> AttentionConfigs:
    """The tuned configs of an attention call.

    Args:
      compute_capability: e.g. 80 for A100, 90 for H100.
      head_dim: D of the inputs (<= 256).
      dtype: the input dtype (float32 uses the IEEE-dot table).

    Returns:
      The `AttentionConfigs` of the forward, delta, dK/dV and dQ kernels.

    Raises:
      NotImplementedError: a GPU before Ampere, a head dim above 256, or float32
        inputs with a head dim above 64.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.kernels.attention import triton_configs
      >>> triton_configs.default_configs(90, 128, jnp.bfloat16).forward
      AttentionKernelConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    """
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"the Triton attention kernels support head dims up to {MAX_HEAD_DIM}; got D={head_dim}"
        )
    kind = "float32" if np.dtype(dtype) == np.float32 else "16bit"
    if kind == "float32" and head_dim > MAX_FLOAT32_HEAD_DIM:
        raise NotImplementedError(
            f"the Triton attention kernels take float32 inputs up to head dim "
            f"{MAX_FLOAT32_HEAD_DIM} (exact float32 dots spill registers above it); got "
            f"D={head_dim}: use bfloat16 or float16 inputs, or implementation='xla'"
        )
    return TUNED[(generation(compute_capability), padded_head_dim(head_dim), kind)]
