"""The Triton kernel of flash-decoding: one program per (cache split, batch row, kv head).

Flash-decoding (Dao, Haziza, Massa, Sizov 2023): program `(split, b * K + kv_head)`
holds the `G * T` query rows that read kv head `kv_head` (the G query heads of
the group times the T queries, row `r = g * T + t`, padded to `BLOCK_M`), so
GQA loads each K/V tile once for all of them. It walks its split of the cache
in `BLOCK_N`-row tiles with an online softmax in the base-2 domain (as the
flash attention forward in `kernels/attention/triton_kernels.py`), visiting
only tiles inside the row's visible range `[lengths - T - left, lengths)`,
and writes the split's normalised partial output and lse; the JAX wrapper
merges the splits by lse. Every load is masked, so rows beyond a length (or
garbage there) are never read. The mask is `masks.visible` (masks.py) with
causal on, restated in Triton: `kv < length`, `kv <= q_pos`, `q_pos - kv <= left`.

Layouts: q `[B, T, H, D]`, k, v `[B, S, K, D]`, lengths int32 `[B]`; partial
outputs float32 `[B, N, T, H, D]` and lse float32 `[B, N, T, H]`.
"""

import triton
import triton.language as tl

from shardfuse.kernels.attention.triton_tiles import dot as _dot
from shardfuse.kernels.attention.triton_tiles import logits as _logits
from shardfuse.kernels.attention.triton_tiles import online_softmax as _online_softmax
from shardfuse.kernels.attention.triton_tiles import softmax_output as _softmax_output


@triton.jit
def decode_attention_kernel(
    q_ref,
    k_ref,
    v_ref,
    lengths_ref,
    out_ref,
    lse_ref,
    T: tl.constexpr,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One split of the cache for one batch row and kv head: partial `out` and `lse`."""
    split = tl.program_id(0)
    b = tl.program_id(1) // K
    kv_head = tl.program_id(1) % K
    G: tl.constexpr = H // K
    rows = tl.arange(0, BLOCK_M)
    row_in = rows < G * T
    t = rows % T
    h = kv_head * G + rows // T
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < D
    q_tile = row_in[:, None] & d_in[None, :]
    b64 = b.to(tl.int64)
    q_rows = t * (H * D) + h * D  # int32 offsets inside the batch row
    q = tl.load(
        q_ref + b64 * (T * H * D) + q_rows[:, None] + offs_d[None, :], mask=q_tile, other=0.0
    )
    length = tl.load(lengths_ref + b)
    q_pos = length - T + t

    # The split's keys some query sees: [max(split start, length - T - left), min(end, length)).
    first = split * SPLIT
    hi = tl.minimum(first + SPLIT, length)
    if WINDOW_LEFT >= 0:
        first = tl.maximum(first, length - T - WINDOW_LEFT)
    kv_head_ref = b64 * (S * K * D) + kv_head * D
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range((first // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kv_in = (offs_n >= first) & (offs_n < hi)
        kv_tile = kv_in[:, None] & d_in[None, :]
        kv_offsets = kv_head_ref + offs_n[:, None] * (K * D) + offs_d[None, :]
        k = tl.load(k_ref + kv_offsets, mask=kv_tile, other=0.0)
        v = tl.load(v_ref + kv_offsets, mask=kv_tile, other=0.0)
        s, _ = _logits(_dot(q, tl.trans(k), IEEE), SCALE, SOFTCAP)  # [BLOCK_M, BLOCK_N]
        diff = q_pos[:, None] - offs_n[None, :]
        mask = row_in[:, None] & kv_in[None, :] & (diff >= 0)
        if WINDOW_LEFT >= 0:
            mask = mask & (diff <= WINDOW_LEFT)
        s = tl.where(mask, s, float("-inf"))
        m, denom, acc = _online_softmax(s, v, m, denom, acc, IEEE)

    out, lse = _softmax_output(acc, m, denom)
    part = b64 * NUM_SPLITS + split
    tl.store(out_ref + part * (T * H * D) + q_rows[:, None] + offs_d[None, :], out, mask=q_tile)
    tl.store(lse_ref + part * (T * H) + t * H + h, lse, mask=row_in)
