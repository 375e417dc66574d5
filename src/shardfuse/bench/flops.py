"""Analytic FLOP and byte counts for the benchmarked ops (FLOPs: `shardfuse.flops`).

`cost_analysis()` cannot be trusted for these ops: it counts a `lax.fori_loop`
or `scan` body once, skips blocks a `lax.cond` would skip at run time only
sometimes, and counts nothing inside custom calls (Pallas, Triton, cuDNN). So
throughput is computed from the math, the same for every implementation of
an op, which makes TFLOP/s comparable across them.

FLOPs are those of `shardfuse.flops` (the FlashAttention papers' op
convention: masks counted exactly, backward 2.5 x forward), re-exported here.
Bytes are the compulsory HBM traffic of an ideal kernel: every input read
once and every output written once (forward: q, k, v in, out and the
float32 lse out; backward: q, k, v, out, d_out and lse in, dq, dk, dv out).
An implementation that materialises scores moves far more; its GB/s is then
an "effective bandwidth", useful to compare, not a hardware measurement.

Axis glossary: B batch, T query length, S key length, H query heads, K kv
heads, D head dim; M, N, C matmul dims, N also the number of devices.
"""

from shardfuse.flops import (  # the one FLOPs definition; re-exported for the suites
    BACKWARD_OVER_FORWARD,
    FWD,
    FWD_BWD,
    MODES,
    attention_flops,
    check_mode,
    grouped_matmul_flops,
    matmul_flops,
    visible_pairs,
)

__all__ = [
    "BACKWARD_OVER_FORWARD",
    "FWD",
    "FWD_BWD",
    "MODES",
    "all_gather_bytes",
    "attention_bytes",
    "attention_flops",
    "grouped_matmul_flops",
    "matmul_bytes",
    "matmul_flops",
    "reduce_scatter_bytes",
    "visible_pairs",
]


def attention_bytes(B: int, T: int, S: int, H: int, K: int, D: int, itemsize: int, *, mode=FWD):
    """Compulsory HBM bytes of attention (see the module docstring).

    Example:
      >>> from shardfuse.bench.flops import attention_bytes
      >>> attention_bytes(1, 1, 1, 1, 1, 1, 4)  # q, k, v, out: 4 * 4 bytes; lse 4 bytes
      20
    """
    check_mode(mode)
    q = out = B * T * H * D * itemsize
    kv = B * S * K * D * itemsize
    lse = B * H * T * 4
    forward = q + 2 * kv + out + lse
    if mode == FWD:
        return forward
    # backward reads q, k, v, out, d_out, lse and writes dq, dk, dv
    backward = (q + 2 * kv + out + q + lse) + (q + 2 * kv)
    return forward + backward


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
