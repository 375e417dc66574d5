"""The one FLOPs and MFU definition: model FLOPs, hardware FLOPs, op FLOPs for benchmarks.

This module sits at the bottom of the package beside `model_spec.py` and
`hardware.py`: it imports nothing from shardfuse but those two. The planner,
the trainer's printed MFU, the profiler and every benchmark read it, so their
numbers can be compared.

Model FLOPs (the MFU numerator; PaLM, Chowdhery et al. 2022, appendix B;
Megatron-LM, Narayanan et al. 2021, eq. 3). Only matmuls count. Per token and
layer the forward pass costs `2 x (matmul weights of the block)` (q, k, v, o
projections and the MLP; GQA, gated MLPs and head dims != h / a as they are)
plus `4 a d s` for attention (`Q K^T` and `A V`: `2 a d` each per key), and
the logits `2 h V` once per token. Training is `3 x` the forward (the backward
pass costs two forwards). Norms, softmax and elementwise work are not counted;
neither is the embedding lookup.

  model FLOPs per token = 3 x (L x (2 W + 4 a d min(s, window)) + 2 h V)

Mixtures of experts count their ACTIVE weights, as published MoE MFU does
(Megatron-Core's `num_floating_point_operations`, MaxText, DeepSeek-V3): `W` is a
block's active matmul weights, `ModelSpec.layer_matmul_params()` (the mean over
the blocks): attention, the `top_k` routed experts a token runs through, the
shared experts, and the router's `h x experts` matmul (and Qwen2-MoE's shared
expert gate, `h x 1`). The backward and the remat recomputation multiply the
same `W`, so every formula below holds unchanged. The memory counts every
expert (`ModelSpec.num_params()`); `expert_matmul_flops` is the routed part,
which runs as grouped matmuls. Mixtral 8x7B: 12.9B active of 46.7B weights.

The causal convention, stated once: **no causal halving**. A causal model is
charged every key of its window (`min(s, window)` keys per query), as PaLM
(`6N + 12 L H Q T`) and Megatron (`96 B s l h^2 (1 + s / 6h + V / 16 l h)`)
do, so an MFU printed here compares with theirs and with the published runs
(Llama 3, MegaScale, MaxText report it the same way). What a kernel actually
skips is a property of the implementation, not of the model: it belongs to
the hardware FLOPs.

Hardware FLOPs (what the devices execute; HFU and the planner's compute time)
add the recomputation of the remat policy (`"full"`: another forward of every
layer; `"selective"` and `"offload"`: the attention core again) and, with
`causal_skip`, charge causal attention only its visible keys
(`(s + 1) / 2` on average, fewer with a window), as flash attention does.

Op FLOPs for benchmarks (the FlashAttention papers' convention, Dao et al.
2022, Dao 2023): a matmul `[M, C] @ [C, N]` is `2 M N C`; attention forward
is `4 D` per visible (query, key) pair per head, counting the mask's visible
pairs exactly (a kernel benchmark measures the kernel); the backward is 2.5 x
the forward (five matmuls instead of two), forward + backward 3.5 x.

  MFU = model FLOPs of a step / (devices x peak FLOP/s x step seconds)

Axis glossary: B batch, T query length, S key length, H query heads, D head
dim; M, N, C matmul dims; L layers, h hidden, a heads, d head dim, s sequence
length, V vocabulary, W matmul weights of one block.

Example:
  >>> from shardfuse import flops, models
  >>> spec = models.get("llama3-8b")
  >>> round(flops.model_flops(spec, seq_len=8192) / 8192 / 1e9, 1)  # GFLOPs per token
  57.9
  >>> flops.mfu(1e15, step_time_s=1.0, devices=2, peak_flops_per_s=1e15)
  0.5
"""

import functools

import numpy as np

from shardfuse.hardware import Device
from shardfuse.model_spec import ModelSpec

FWD = "fwd"
FWD_BWD = "fwd+bwd"
MODES = (FWD, FWD_BWD)
BACKWARD_OVER_FORWARD = 2.5
# Training = forward + backward, the backward two forwards (activation and weight gradients).
TRAINING_OVER_FORWARD = 3
# Activation checkpointing policies, the one list (what each recomputes:
# `recompute_flops_per_token`; what each saves: `shardfuse.layers.remat`).
REMAT_POLICIES = ("none", "full", "selective", "dots", "offload")


def check_remat(policy) -> str:
    """`policy`; ValueError naming the valid policies (`REMAT_POLICIES`) otherwise.

    The one check of a remat policy: `sf.layers.LayerOptions` (hence the run's
    options), the layers and the FLOPs below call it.
    """
    if not isinstance(policy, str) or policy not in REMAT_POLICIES:
        raise ValueError(f"remat={policy!r} is not a remat policy; valid: {REMAT_POLICIES}")
    return policy


def check_mode(mode):
    """ValueError unless `mode` is one of `MODES` ("fwd", "fwd+bwd")."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")


# ---- op FLOPs (benchmarks) ----


def visible_key_counts(q_pos, kv_pos, *, causal: bool = False, window=None) -> np.ndarray:
    """For each query position, how many of the key positions `kv_pos` it sees.

    The one host-side count of visible (query, key) pairs: `visible_pairs`, the
    causal keys of `mean_visible_keys` (the planner's hardware FLOPs) and
    `ring_balance` (each device's pair work under a ring layout) all call it.
    It is the mask rule of `sf.flash_attention` on positions (DESIGN.md,
    Conventions; `kernels/attention/masks.visible` is the same rule on traced
    arrays): causal, key j is visible to query i iff `kv_pos[j] <= q_pos[i]`;
    `window=(left, right)` (None: unbounded on that side), iff
    `q_pos[i] - left <= kv_pos[j] <= q_pos[i] + right`. The keys a query sees
    form an interval of positions, so the count is two binary searches per
    query: no `[T, S]` matrix.

    Args:
      q_pos: int `[T]` query positions.
      kv_pos: int `[S]` key positions, any order.
      causal, window: the mask, as in `sf.flash_attention`.

    Returns:
      int64 `[T]`, the visible keys of each query.

    Example:
      >>> import numpy as np
      >>> from shardfuse.flops import visible_key_counts
      >>> visible_key_counts(np.arange(3), np.arange(3), causal=True, window=(1, None)).tolist()
      [1, 2, 2]
    """
    q_pos = np.asarray(q_pos, np.int64)
    kv_sorted = np.sort(np.asarray(kv_pos, np.int64))
    lo = np.full(q_pos.shape, np.iinfo(np.int64).min)
    hi = np.full(q_pos.shape, np.iinfo(np.int64).max)
    if causal:
        hi = np.minimum(hi, q_pos)
    left, right = window if window is not None else (None, None)
    if left is not None:
        lo = np.maximum(lo, q_pos - left)
    if right is not None:
        hi = np.minimum(hi, q_pos + right)
    count = np.searchsorted(kv_sorted, hi, side="right") - np.searchsorted(
        kv_sorted, lo, side="left"
    )
    return np.maximum(count, 0).astype(np.int64)


def visible_pairs(T: int, S: int, *, causal: bool = False, window=None) -> int:
    """Number of (query, key) pairs the mask lets through, bottom-right aligned.

    Queries sit at positions `arange(T) + S - T`, keys at `arange(S)` (the
    default of `flash_attention`); `window=(left, right)` with None for an
    unbounded side; causal: key j is visible to query i iff `j <= i`. The
    sum of `visible_key_counts` over the queries.

    Example:
      >>> from shardfuse.flops import visible_pairs
      >>> visible_pairs(4, 4, causal=True)
      10
      >>> visible_pairs(4, 4, window=(1, 0))
      7
    """
    if T < 0 or S < 0:
        raise ValueError(f"T={T} and S={S} must be >= 0")
    left, right = window if window is not None else (None, None)
    return _visible_pairs(int(T), int(S), bool(causal), left, right)


@functools.lru_cache(maxsize=256)  # the planner asks for the same sequence length per layout
def _visible_pairs(T, S, causal, left, right) -> int:
    q_pos = np.arange(T, dtype=np.int64) + (S - T)
    counts = visible_key_counts(q_pos, np.arange(S), causal=causal, window=(left, right))
    return int(counts.sum())


def attention_flops(
    B: int, T: int, S: int, H: int, D: int, *, causal=False, window=None, mode=FWD
) -> float:
    """Matmul FLOPs of attention: `4 * B * H * D * visible_pairs`, times 3.5 for fwd+bwd.

    Args:
      B, T, S, H, D: batch, query length, key length, query heads, head dim
        (the number of kv heads K does not change the FLOPs).
      causal, window: the mask, as in `flash_attention`.
      mode: "fwd" or "fwd+bwd".

    Example:
      >>> from shardfuse.flops import attention_flops
      >>> attention_flops(1, 2, 2, 1, 8)
      128.0
      >>> attention_flops(1, 2, 2, 1, 8, mode="fwd+bwd")
      448.0
    """
    check_mode(mode)
    forward = 4.0 * B * H * D * visible_pairs(T, S, causal=causal, window=window)
    return forward * (1.0 + BACKWARD_OVER_FORWARD) if mode == FWD_BWD else forward


def matmul_flops(M: int, N: int, C: int) -> float:
    """`2 * M * N * C` for `[M, C] @ [C, N]`.

    Example:
      >>> from shardfuse.flops import matmul_flops
      >>> matmul_flops(2, 3, 4)
      48.0
    """
    return 2.0 * M * N * C


def grouped_matmul_flops(rows: int, K: int, N: int, *, mode: str = FWD) -> float:
    """A grouped (mixture-of-experts) matmul computing `rows` routed rows: `2 rows K N`, each row
    against its own group's `[K, N]`; forward + backward 3x (d lhs and d rhs are one product
    each, as a dense matmul's). Rows no group owns count nothing.

    Example:
      >>> from shardfuse.flops import grouped_matmul_flops
      >>> grouped_matmul_flops(8, 4, 2), grouped_matmul_flops(8, 4, 2, mode="fwd+bwd")
      (128.0, 384.0)
    """
    check_mode(mode)
    forward = matmul_flops(rows, N, K)
    return 3.0 * forward if mode == FWD_BWD else forward


# ---- model and hardware FLOPs (MFU, planner, trainer, profiler) ----


def mean_visible_keys(s: int, window: int | None, causal_skip: bool) -> float:
    """Keys a query attends to, on average: s, (s + 1) / 2 causal, fewer with a window.

    `window` is a model's sliding window W (keys, the query included: `window=(W - 1, 0)`
    of `flash_attention`); with `causal_skip` the causal `visible_pairs(s, s) / s`.

    Example:
      >>> from shardfuse.flops import mean_visible_keys
      >>> mean_visible_keys(4, None, True), mean_visible_keys(4, None, False)
      (2.5, 4)
    """
    if s < 1:
        raise ValueError(f"s={s!r} must be a sequence length >= 1")
    if not causal_skip:
        return s
    left = None if window is None else window - 1
    return visible_pairs(s, s, causal=True, window=(left, None)) / s


def layer_matmul_flops(spec: ModelSpec) -> float:
    """Forward matmul FLOPs of one block per token: `2 x` its active matmul weights (norms
    excluded; a mixture of experts: the `top_k` routed experts, shared experts and router),
    the mean over the blocks.

    Example:
      >>> from shardfuse import flops, models
      >>> spec = models.ModelSpec.tiny(hidden=64, ffn_hidden=128, experts=4, top_k=2)
      >>> # q and o 64 x 64, k and v 64 x 32 (2 kv heads of 16); 3 SwiGLU matrices of 2
      >>> # experts; the router 64 x 4
      >>> flops.layer_matmul_flops(spec) == 2 * (64 * (64 + 2 * 32) + 64 * 64
      ...                                        + 2 * 3 * 64 * 128 + 64 * 4)
      True
    """
    return 2.0 * spec.layer_matmul_params()


def expert_matmul_flops(spec: ModelSpec) -> float:
    """Forward FLOPs per token of the routed experts of one block (the mean over the blocks):
    `2 x top_k x` one expert's weights; 0 in a dense model. The part of
    `layer_matmul_flops` that runs as grouped matmuls (the planner prices it apart).

    Example:
      >>> from shardfuse import flops, models
      >>> flops.expert_matmul_flops(models.get("mixtral-8x7b")) == 2 * 2 * 3 * 4096 * 14336
      True
      >>> flops.expert_matmul_flops(models.get("llama3-8b"))
      0.0
    """
    return 2.0 * spec.routed_expert_params(active=True)


def layer_attention_flops(spec: ModelSpec, seq_len: int, *, causal_skip: bool = False) -> float:
    """Forward attention FLOPs of one block per token: `4 a d` per key attended.

    `causal_skip=False` (model FLOPs): every key of the window, `min(s, window)`;
    True (hardware FLOPs of a kernel that skips masked blocks): the visible keys. With
    `spec.window_layers` (a window on some blocks only) the mean over the blocks.
    """

    def keys(window):
        if causal_skip:
            return mean_visible_keys(seq_len, window, True)
        return min(seq_len, window or seq_len)

    mean = keys(spec.window)
    if spec.window is not None and spec.window_layers is not None:  # the mean over the blocks
        slide = len(spec.window_layers)
        mean = (slide * mean + (spec.num_layers - slide) * keys(None)) / spec.num_layers
    return 4.0 * spec.heads * spec.head_dim * mean


def logits_flops(spec: ModelSpec) -> float:
    """Forward FLOPs of the output projection per token: `2 h V`."""
    return 2.0 * spec.hidden * spec.vocab_size


def model_flops_per_token(spec: ModelSpec, seq_len: int) -> float:
    """Training model FLOPs per token (the module docstring's formula, no causal halving).

    Example:
      >>> from shardfuse import flops, models
      >>> spec = models.ModelSpec.gpt("gpt-small", 768, 12, 12)
      >>> h, L, s, V = 768, 12, 2048, 51200  # Megatron's eq. 3 without recomputation
      >>> flops.model_flops_per_token(spec, s) == 72 * L * h * h * (1 + s / (6 * h)) + 6 * h * V
      True
    """
    forward = spec.num_layers * (layer_matmul_flops(spec) + layer_attention_flops(spec, seq_len))
    return TRAINING_OVER_FORWARD * (forward + logits_flops(spec))


def model_flops(spec: ModelSpec, *, seq_len: int, batch: int = 1) -> float:
    """Training model FLOPs of a step of `batch` sequences of `seq_len` tokens (MFU numerator).

    Args:
      spec: the transformer (`sf.models.ModelSpec`).
      seq_len: tokens per sequence.
      batch: sequences per step (default 1).

    Raises:
      ValueError: `seq_len` or `batch` not a positive int.
    """
    _check_positive(seq_len=seq_len, batch=batch)
    return batch * seq_len * model_flops_per_token(spec, seq_len)


def recompute_flops_per_token(
    spec: ModelSpec, seq_len: int, remat: str, *, causal_skip: bool = True, prefetch: bool = False
) -> float:
    """Forward FLOPs per token the remat policy reruns in the backward pass.

    "full": every layer's forward; "selective" and "offload": the attention
    core; "none" and "dots": nothing. With the ZeRO-3 layer `prefetch`
    (`shardfuse.layers.prefetch`) the backward reruns the forward of every layer
    but the last (whose forward it still holds), as "full" does, and the policy
    applies inside each layer's backward ("full" there as "none"); counted in the
    compiled program by tests/layers/test_prefetch.py.
    """
    check_remat(remat)
    attention = layer_attention_flops(spec, seq_len, causal_skip=causal_skip)
    per_layer = {"full": layer_matmul_flops(spec) + attention, "selective": attention}
    per_layer["offload"] = attention
    if prefetch:
        inside = 0.0 if remat == "full" else per_layer.get(remat, 0.0)
        return (spec.num_layers - 1) * per_layer["full"] + spec.num_layers * inside
    return spec.num_layers * per_layer.get(remat, 0.0)


def hardware_flops(
    spec: ModelSpec,
    *,
    seq_len: int,
    batch: int = 1,
    remat: str = "none",
    causal_skip: bool = True,
    prefetch: bool = False,
) -> float:
    """FLOPs the devices execute in one training step: recomputation and causal skip included.

    Args:
      spec, seq_len, batch: as in `model_flops`.
      remat: activation checkpointing policy ("none", "dots", "selective", "offload", "full").
      causal_skip: the attention kernels skip masked blocks (visible keys only).
      prefetch: the ZeRO-3 layer prefetch reruns the forward of every layer but the last
        (as "full" does); see `recompute_flops_per_token`.

    Example:
      >>> from shardfuse import flops, models
      >>> spec = models.get("llama3-8b")
      >>> full = flops.hardware_flops(spec, seq_len=4096, remat="full", causal_skip=False)
      >>> round(full / flops.model_flops(spec, seq_len=4096), 3)
      1.313
    """
    _check_positive(seq_len=seq_len, batch=batch)
    layer = layer_matmul_flops(spec) + layer_attention_flops(spec, seq_len, causal_skip=causal_skip)
    forward = spec.num_layers * layer + logits_flops(spec)
    recompute = recompute_flops_per_token(
        spec, seq_len, remat, causal_skip=causal_skip, prefetch=prefetch
    )
    return batch * seq_len * (TRAINING_OVER_FORWARD * forward + recompute)


def peak_flops_per_s(device: Device, dtype: str = "bfloat16") -> float:
    """Dense peak FLOP/s of `device` for `dtype`, the bfloat16 peak where `dtype` has none."""
    peak = device.peak_tflops(str(dtype))
    if peak is None:
        peak = device.peak_tflops("bfloat16")
    return peak * 1e12


def mfu(
    model_flops_per_step: float, *, step_time_s: float, devices: int, peak_flops_per_s: float
) -> float:
    """Model FLOPs utilisation: `model_flops_per_step / (devices * peak_flops_per_s * step_time_s)`.

    Raises:
      ValueError: a non-positive step time, device count or peak.
    """
    _check_positive(step_time_s=step_time_s, devices=devices, peak_flops_per_s=peak_flops_per_s)
    return model_flops_per_step / (devices * peak_flops_per_s * step_time_s)


def _check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name}={value!r} must be > 0")
