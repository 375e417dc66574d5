"""Analytic FLOP and byte counts for the benchmarked ops.

`cost_analysis()` cannot be trusted for these ops: it counts a `lax.fori_loop`
or `scan` body once, skips blocks a `lax.cond` would skip at run time only
sometimes, and counts nothing inside custom calls (Pallas, Triton, cuDNN). So
throughput is computed from the math, the same for every implementation of
an op, which makes TFLOP/s comparable across them.

Conventions (those of the FlashAttention papers and benchmarks, Dao et al.
2022, Dao 2023, `benchmarks/benchmark_flash_attention.py` of flash-attn):

- A matmul `[M, C] @ [C, N]` is `2 * M * N * C` FLOPs. Elementwise work
  (softmax, exp, tanh softcap, masking) is not counted.
- Attention forward: two matmuls per visible (query, key) pair per head,
  `4 * D` FLOPs per pair. Masks count exactly: the visible pairs of the causal
  and window masks are counted (causal T = S: `S (S + 1) / 2` pairs, about
  half; flash-attn divides by exactly 2).
- Attention backward: 2.5 times the forward (five matmuls instead of two;
  the recomputation of the scores is not counted), so forward + backward is
  3.5 times the forward.
- Bytes are the compulsory HBM traffic of an ideal kernel: every input read
  once and every output written once (forward: q, k, v in, out and the
  float32 lse out; backward: q, k, v, out, d_out and lse in, dq, dk, dv out).
  An implementation that materialises scores moves far more; its GB/s is then
  an "effective bandwidth", useful to compare, not a hardware measurement.

Axis glossary: B batch, T query length, S key length, H query heads, K kv
heads, D head dim; M, N, C matmul dims, N also the number of devices.
"""

import numpy as np

from shardfuse.kernels.attention import masks

FWD = "fwd"
FWD_BWD = "fwd+bwd"
MODES = (FWD, FWD_BWD)
BACKWARD_OVER_FORWARD = 2.5


def _check_mode(mode):
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} must be one of {MODES}")


def visible_pairs(T: int, S: int, *, causal: bool = False, window=None) -> int:
    """Number of (query, key) pairs the mask lets through, bottom-right aligned.

    Queries sit at positions `arange(T) + S - T`, keys at `arange(S)` (the
    default of `flash_attention`); `window=(left, right)` with None for an
    unbounded side.

    Example:
      >>> from shardfuse.bench.flops import visible_pairs
      >>> visible_pairs(4, 4, causal=True)
      10
      >>> visible_pairs(4, 4, window=(1, 0))
      7
    """
    if T < 0 or S < 0:
        raise ValueError(f"T={T} and S={S} must be >= 0")
    q_pos = np.arange(T, dtype=np.int64) + (S - T)
    lo = np.zeros(T, dtype=np.int64)
    hi = np.full(T, S - 1, dtype=np.int64)
    lo, hi = masks.key_interval(causal, window, q_pos, lo, hi)
    return int(np.clip(hi - lo + 1, 0, None).sum())


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
      >>> from shardfuse.bench.flops import attention_flops
      >>> attention_flops(1, 2, 2, 1, 8)
      128.0
      >>> attention_flops(1, 2, 2, 1, 8, mode="fwd+bwd")
      448.0
    """
    _check_mode(mode)
    forward = 4.0 * B * H * D * visible_pairs(T, S, causal=causal, window=window)
    return forward * (1.0 + BACKWARD_OVER_FORWARD) if mode == FWD_BWD else forward


def attention_bytes(B: int, T: int, S: int, H: int, K: int, D: int, itemsize: int, *, mode=FWD):
    """Compulsory HBM bytes of attention (see the module docstring).

    Example:
      >>> from shardfuse.bench.flops import attention_bytes
      >>> attention_bytes(1, 1, 1, 1, 1, 1, 4)  # q, k, v, out: 4 * 4 bytes; lse 4 bytes
      20
    """
    _check_mode(mode)
    q = out = B * T * H * D * itemsize
    kv = B * S * K * D * itemsize
    lse = B * H * T * 4
    forward = q + 2 * kv + out + lse
    if mode == FWD:
        return forward
    # backward reads q, k, v, out, d_out, lse and writes dq, dk, dv
    backward = (q + 2 * kv + out + q + lse) + (q + 2 * kv)
    return forward + backward


def matmul_flops(M: int, N: int, C: int) -> float:
    """`2 * M * N * C` for `[M, C] @ [C, N]`.

    Example:
      >>> from shardfuse.bench.flops import matmul_flops
      >>> matmul_flops(2, 3, 4)
      48.0
    """
    return 2.0 * M * N * C


def matmul_bytes(M: int, N: int, C: int, itemsize: int, *, out_itemsize=None) -> int:
    """Bytes of `[M, C] @ [C, N]`: both operands read once, the output written once.

    Example:
      >>> from shardfuse.bench.flops import matmul_bytes
      >>> matmul_bytes(2, 3, 4, 2)
      52
    """
    out_itemsize = itemsize if out_itemsize is None else out_itemsize
    return (M * C + C * N) * itemsize + M * N * out_itemsize


def all_gather_bytes(shard_bytes: int, num_devices: int) -> int:
    """Bytes each device receives in an all-gather of `shard_bytes` per device: `(N - 1) * shard`.

    Example:
      >>> from shardfuse.bench.flops import all_gather_bytes
      >>> all_gather_bytes(100, 4)
      300
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    return (num_devices - 1) * shard_bytes


def reduce_scatter_bytes(full_bytes: int, num_devices: int) -> int:
    """Bytes each device sends in a ring reduce-scatter of `full_bytes`: `(N - 1) / N * full`.

    Example:
      >>> from shardfuse.bench.flops import reduce_scatter_bytes
      >>> reduce_scatter_bytes(400, 4)
      300
    """
    if num_devices < 1:
        raise ValueError(f"num_devices={num_devices} must be >= 1")
    return (num_devices - 1) * full_bytes // num_devices
