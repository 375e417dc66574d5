"""Triton kernels of flash attention: forward, delta preprocessing, dK/dV and dQ.

FlashAttention-2 (Dao 2023, arXiv:2307.08691), written in Triton after the
Triton fused-attention tutorial (Tillet et al.). One program owns a block of
rows and loops over the blocks of the other side:

- forward, grid `(nq, B * H)`: a query block keeps the running row maximum
  `m`, the normaliser `denom` and a float32 accumulator, all in the base-2 domain
  (`exp2`, scores pre-multiplied by `log2 e`); `lse = (m + log2 denom) ln 2`.
- delta, grid `(nq, B * H)`: `delta = rowsum(dO * O) - dlse`.
- dK/dV, grid `(nk, B * K)`: a key block of one kv head loops over the
  `G = H / K` query heads that read it and over their query blocks, so GQA
  never repeats K/V and dK/dV are written once, without atomics.
- dQ, grid `(nq, B * H)`: a query block loops over key blocks.

Which blocks a program visits comes from a table `ranges [B, n_outer, 4]`
computed by the JAX wrapper (`triton_gpu.py`): `(lo, full_lo, full_hi, hi)`.
Blocks outside `[lo, hi)` are invisible and skipped; blocks in
`[full_lo, full_hi)` are fully visible and run without a mask; the rest run
masked (positions, causal, window, segment ids, sequence padding). Every load
is masked, so any T, S and head dim (padded to a power of two) work.

Layouts are the JAX ones, contiguous: q, out `[B, T, H, D]`, k, v `[B, S, K, D]`,
lse and delta float32 `[B, H, T]`. Shapes and options are `tl.constexpr`.
"""

import triton
import triton.language as tl

from shardfuse.kernels.attention.triton_tiles import LOG2E
from shardfuse.kernels.attention.triton_tiles import any_row as _any_row
from shardfuse.kernels.attention.triton_tiles import block_range as _block_range
from shardfuse.kernels.attention.triton_tiles import dot as _dot
from shardfuse.kernels.attention.triton_tiles import key_block as _key_block
from shardfuse.kernels.attention.triton_tiles import logits as _logits
from shardfuse.kernels.attention.triton_tiles import online_softmax as _online_softmax
from shardfuse.kernels.attention.triton_tiles import positions as _positions
from shardfuse.kernels.attention.triton_tiles import query_block as _query_block
from shardfuse.kernels.attention.triton_tiles import softmax_output as _softmax_output
from shardfuse.kernels.attention.triton_tiles import stage_bounds as _stage_bounds
from shardfuse.kernels.attention.triton_tiles import tile_mask as _tile_mask


@triton.jit
def attention_forward_kernel(
    q_ref,
    k_ref,
    v_ref,
    q_pos_ref,
    kv_pos_ref,
    q_seg_ref,
    kv_seg_ref,
    ranges_ref,
    out_ref,
    lse_ref,
    T: tl.constexpr,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One query block of one head: `out [B, T, H, D]` and float32 `lse [B, H, T]`."""
    block_q, b, h, kv_head, offs_m, offs_d, q_in, q_tile = _query_block(
        T, H, K, D, BLOCK_M, BLOCK_D
    )
    # Scalar int64 bases, int32 tile offsets: int64 tiles would hold twice the registers.
    q_head = b.to(tl.int64) * (T * H * D) + h * D
    q = tl.load(
        q_ref + q_head + offs_m[:, None] * (H * D) + offs_d[None, :], mask=q_tile, other=0.0
    )
    q_pos, q_seg = _positions(q_pos_ref, q_seg_ref, offs_m, q_in, b * T, HAS_SEGMENTS)
    kv_offset = b.to(tl.int64) * (S * K * D) + kv_head * D
    lo, full_lo, full_hi, hi = _block_range(ranges_ref, b * tl.cdiv(T, BLOCK_M) + block_q)

    k_head_ref = k_ref + kv_offset
    v_head_ref = v_ref + kv_offset
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    for stage in tl.static_range(3):  # masked, full (no mask), masked
        start, end = _stage_bounds(stage, lo, full_lo, full_hi, hi)
        for block in range(start, end):
            offs_n, kv_in, kv_tile, kv_offsets = _key_block(block, S, K, D, offs_d, BLOCK_N)
            k = tl.load(k_head_ref + kv_offsets, mask=kv_tile, other=0.0)
            s, _ = _logits(_dot(q, tl.trans(k), IEEE), SCALE, SOFTCAP)  # [BLOCK_M, BLOCK_N]
            v_tile = kv_tile
            if stage != 1:
                # fmt: off
                mask = _tile_mask(q_pos, q_seg, q_in, kv_pos_ref, kv_seg_ref + b * S, offs_n,
                                  kv_in, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
                # fmt: on
                s = tl.where(mask, s, float("-inf"))
                # Values nobody in this tile sees load as 0: 0 * NaN would leak.
                v_tile = v_tile & _any_row(mask)[:, None]
            v = tl.load(v_head_ref + kv_offsets, mask=v_tile, other=0.0)
            m, denom, acc = _online_softmax(s, v, m, denom, acc, IEEE)

    out, lse = _softmax_output(acc, m, denom)
    out_offsets = q_head + offs_m[:, None] * (H * D) + offs_d[None, :]
    tl.store(out_ref + out_offsets, out.to(out_ref.dtype.element_ty), mask=q_tile)
    tl.store(lse_ref + (b * H + h) * T + offs_m, lse, mask=q_in)


@triton.jit
def attention_backward_delta_kernel(
    out_ref,
    d_out_ref,
    d_lse_ref,
    delta_ref,
    T: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`delta [B, H, T] = rowsum(dO * O) - dlse` in float32 (d lse / d s = p)."""
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_in = offs_m < T
    tile = q_in[:, None] & (offs_d < D)[None, :]
    head = b.to(tl.int64) * (T * H * D) + h * D
    offsets = offs_m[:, None] * (H * D) + offs_d[None, :]
    out = tl.load(out_ref + head + offsets, mask=tile, other=0.0).to(tl.float32)
    d_out = tl.load(d_out_ref + head + offsets, mask=tile, other=0.0).to(tl.float32)
    rows = (b * H + h) * T + offs_m
    d_lse = tl.load(d_lse_ref + rows, mask=q_in, other=0.0)
    tl.store(delta_ref + rows, tl.sum(out * d_out, axis=1) - d_lse, mask=q_in)


@triton.jit
def attention_backward_dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    q_pos_ref,
    kv_pos_ref,
    q_seg_ref,
    kv_seg_ref,
    ranges_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    T: tl.constexpr,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One key block of one kv head: dK, dV summed over its G query heads and their rows.

    Works on transposed tiles `[BLOCK_N, BLOCK_M]` (keys x queries), so
    `dV += P^T dO` and `dK += dS^T Q` need no transposed accumulator.
    """
    block_kv = tl.program_id(0)
    b = tl.program_id(1) // K
    kv_head = tl.program_id(1) % K
    G: tl.constexpr = H // K
    offs_n = block_kv * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_in = offs_n < S
    d_in = offs_d < D
    kv_tile = kv_in[:, None] & d_in[None, :]
    b64 = b.to(tl.int64)
    kv_head_offset = b64 * (S * K * D) + kv_head * D
    kv_offsets = offs_n[:, None] * (K * D) + offs_d[None, :]
    k = tl.load(k_ref + kv_head_offset + kv_offsets, mask=kv_tile, other=0.0)
    v = tl.load(v_ref + kv_head_offset + kv_offsets, mask=kv_tile, other=0.0)
    kv_pos, kv_seg = _positions(kv_pos_ref, kv_seg_ref, offs_n, kv_in, b * S, HAS_SEGMENTS)
    lo, full_lo, full_hi, hi = _block_range(ranges_ref, b * tl.cdiv(S, BLOCK_N) + block_kv)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    key_seen = tl.zeros([BLOCK_N], dtype=tl.int32)  # does any visited query see the key
    for g in range(G):
        h = kv_head * G + g
        q_head = b64 * (T * H * D) + h * D
        for stage in tl.static_range(3):  # masked, full (no mask), masked
            start, end = _stage_bounds(stage, lo, full_lo, full_hi, hi)
            for block in range(start, end):
                offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
                q_in = offs_m < T
                rows = (b * H + h) * T + offs_m
                lse = tl.load(lse_ref + rows, mask=q_in, other=0.0)
                delta = tl.load(delta_ref + rows, mask=q_in, other=0.0)
                q_offsets = offs_m[:, None] * (H * D) + offs_d[None, :]
                # Queries that see no key at all (lse = -inf) load as 0: 0 * NaN would leak.
                q_seen = q_in & (lse != float("-inf"))
                q_tile = q_seen[:, None] & d_in[None, :]
                q = tl.load(q_ref + q_head + q_offsets, mask=q_tile, other=0.0)
                d_out = tl.load(
                    d_out_ref + q_head + q_offsets, mask=q_in[:, None] & d_in[None, :], other=0.0
                )
                lse = tl.where(q_seen, lse, 0.0) * LOG2E
                s, tanh = _logits(_dot(k, tl.trans(q), IEEE), SCALE, SOFTCAP)  # [N, M]
                s = s - lse[None, :]
                if stage != 1:
                    # fmt: off
                    mask = _tile_mask(kv_pos, kv_seg, kv_in, q_pos_ref, q_seg_ref + b * T, offs_m,
                                      q_in, False, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
                    # fmt: on
                    s = tl.where(mask, s, float("-inf"))
                    key_seen = tl.maximum(key_seen, tl.max(mask.to(tl.int32), axis=1))
                else:
                    key_seen = tl.full([BLOCK_N], 1, dtype=tl.int32)
                p = tl.math.exp2(s)  # [N, M]
                dv += _dot(p.to(d_out.dtype), d_out, IEEE)
                ds = p * (_dot(v, tl.trans(d_out), IEEE) - delta[None, :])
                if SOFTCAP > 0:
                    ds = ds * (1.0 - tanh * tanh)
                dk += _dot((ds * SCALE).to(q.dtype), q, IEEE)
    # Keys no query sees get zero gradients even where their k or v hold NaN (p = 0 there,
    # but 0 * NaN is not 0).
    key_seen = key_seen > 0
    dk = tl.where(key_seen[:, None], dk, 0.0)
    dv = tl.where(key_seen[:, None], dv, 0.0)
    kv_offsets = kv_head_offset + offs_n[:, None] * (K * D) + offs_d[None, :]
    tl.store(dk_ref + kv_offsets, dk.to(dk_ref.dtype.element_ty), mask=kv_tile)
    tl.store(dv_ref + kv_offsets, dv.to(dv_ref.dtype.element_ty), mask=kv_tile)


@triton.jit
def attention_backward_dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    q_pos_ref,
    kv_pos_ref,
    q_seg_ref,
    kv_seg_ref,
    ranges_ref,
    d_out_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    T: tl.constexpr,
    S: tl.constexpr,
    H: tl.constexpr,
    K: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SCALE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One query block of one head: `dQ = sum_j dS_j K_j * scale`, no atomics."""
    block_q, b, h, kv_head, offs_m, offs_d, q_in, q_tile = _query_block(
        T, H, K, D, BLOCK_M, BLOCK_D
    )
    b64 = b.to(tl.int64)
    q_head = b64 * (T * H * D) + h * D
    q_offsets = offs_m[:, None] * (H * D) + offs_d[None, :]
    q = tl.load(q_ref + q_head + q_offsets, mask=q_tile, other=0.0)
    d_out = tl.load(d_out_ref + q_head + q_offsets, mask=q_tile, other=0.0)
    rows = (b * H + h) * T + offs_m
    lse = tl.load(lse_ref + rows, mask=q_in, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E
    delta = tl.load(delta_ref + rows, mask=q_in, other=0.0)
    q_pos, q_seg = _positions(q_pos_ref, q_seg_ref, offs_m, q_in, b * T, HAS_SEGMENTS)
    k_head_ref = k_ref + b64 * (S * K * D) + kv_head * D
    v_head_ref = v_ref + b64 * (S * K * D) + kv_head * D
    lo, full_lo, full_hi, hi = _block_range(ranges_ref, b * tl.cdiv(T, BLOCK_M) + block_q)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for stage in tl.static_range(3):  # masked, full (no mask), masked
        start, end = _stage_bounds(stage, lo, full_lo, full_hi, hi)
        for block in range(start, end):
            offs_n, kv_in, kv_tile, kv_offsets = _key_block(block, S, K, D, offs_d, BLOCK_N)
            k = tl.load(k_head_ref + kv_offsets, mask=kv_tile, other=0.0)
            s, tanh = _logits(_dot(q, tl.trans(k), IEEE), SCALE, SOFTCAP)  # [M, N]
            s = s - lse[:, None]
            v_tile = kv_tile
            if stage != 1:
                # fmt: off
                mask = _tile_mask(q_pos, q_seg, q_in, kv_pos_ref, kv_seg_ref + b * S, offs_n,
                                  kv_in, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_SEGMENTS)
                # fmt: on
                s = tl.where(mask, s, float("-inf"))
                # Keys nobody in this tile sees count as 0: 0 * NaN would leak into dQ.
                key_seen = _any_row(mask)
                v_tile = v_tile & key_seen[:, None]
                k = tl.where(key_seen[:, None], k, 0.0)
                if SOFTCAP > 0:
                    tanh = tl.where(mask, tanh, 0.0)
            v = tl.load(v_head_ref + kv_offsets, mask=v_tile, other=0.0)
            p = tl.math.exp2(s)
            ds = p * (_dot(d_out, tl.trans(v), IEEE) - delta[:, None])
            if SOFTCAP > 0:
                ds = ds * (1.0 - tanh * tanh)
            dq += _dot((ds * SCALE).to(k.dtype), k, IEEE)
    dq_offsets = q_head + offs_m[:, None] * (H * D) + offs_d[None, :]
    tl.store(dq_ref + dq_offsets, dq.to(dq_ref.dtype.element_ty), mask=q_tile)
