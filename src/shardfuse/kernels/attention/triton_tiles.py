"""Tile helpers of the Triton attention kernels (`triton_kernels.py`): scores, masks, ranges.

`tile_mask` is `masks.visible` (masks.py, the definition) for one tile (positions, causal,
window, segment ids, sequence padding); `block_range` and `stage_bounds`
read the per-block visit table `(lo, full_lo, full_hi, hi)` that the JAX
wrapper computes; `logits` applies scale and softcap in the base-2 domain;
`online_softmax` and `softmax_output` are the forward's softmax (also flash-decoding's).
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """float32-accumulated `a @ b`; exact float32 products when IEEE (no TF32)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def logits(s, SCALE: tl.constexpr, SOFTCAP: tl.constexpr):
    """Raw scores -> base-2 logits `log2(e) * cap(scale * s)`, and tanh for the cap's derivative."""
    if SOFTCAP > 0:
        tanh = 2.0 * tl.sigmoid((2.0 * SCALE / SOFTCAP) * s) - 1.0
        return tanh * (SOFTCAP * LOG2E), tanh
    return s * (SCALE * LOG2E), s


@triton.jit
def online_softmax(s, v, m, denom, acc, IEEE: tl.constexpr):
    """One key tile of the base-2 online softmax: the new running max, normaliser, accumulator.

    `s` `[rows, BLOCK_N]` base-2 logits (-inf where masked), `v` `[BLOCK_N, BLOCK_D]`;
    `m`, `denom` `[rows]` and `acc` `[rows, BLOCK_D]` float32. Rows that have seen no
    key keep `m = -inf` and `denom = 0` (`softmax_output` turns them into 0 and -inf).
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_safe)
    p = tl.math.exp2(s - m_safe[:, None])
    denom = denom * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, denom, acc


@triton.jit
def softmax_output(acc, m, denom):
    """The online softmax's result: `out = acc / denom` and natural-log `lse` (0, -inf: no key)."""
    has_key = denom > 0.0
    denom_safe = tl.where(has_key, denom, 1.0)
    out = acc / denom_safe[:, None]
    lse = tl.where(has_key, (m + tl.math.log2(denom_safe)) * LN2, float("-inf"))
    return out, lse


@triton.jit
def query_block(T, H, K, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The query block of a `(nq, B * H)` program: `(block_q, b, h, kv_head, offs_m, offs_d,
    q_in, q_tile)`, the last two the in-bounds rows and `[BLOCK_M, BLOCK_D]` elements."""
    block_q = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    kv_head = h // (H // K)
    offs_m = block_q * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_in = offs_m < T
    q_tile = q_in[:, None] & (offs_d < D)[None, :]
    return block_q, b, h, kv_head, offs_m, offs_d, q_in, q_tile


@triton.jit
def key_block(block, S, K, D, offs_d, BLOCK_N: tl.constexpr):
    """Key block `block` of one kv head: `(offs_n, kv_in, kv_tile, kv_offsets)`, the element
    offsets `[BLOCK_N, BLOCK_D]` relative to the head's first element."""
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_in = offs_n < S
    kv_tile = kv_in[:, None] & (offs_d < D)[None, :]
    kv_offsets = offs_n[:, None] * (K * D) + offs_d[None, :]
    return offs_n, kv_in, kv_tile, kv_offsets


@triton.jit
def positions(pos_ref, seg_ref, offsets, valid, row, HAS_SEGMENTS: tl.constexpr):
    """`(pos, seg)` at `offsets`; `seg_ref + row` is this batch row's segment ids (without
    segments, `seg` is `pos`, never read)."""
    pos = tl.load(pos_ref + offsets, mask=valid, other=0)
    seg = pos
    if HAS_SEGMENTS:
        seg = tl.load(seg_ref + row + offsets, mask=valid, other=0)
    return pos, seg


@triton.jit
def tile_mask(
    pos,
    seg,
    valid,
    other_pos_ref,
    other_seg_ref,
    other_offsets,
    other_valid,
    ROWS_ARE_QUERIES: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW_LEFT: tl.constexpr,
    WINDOW_RIGHT: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr,
):
    """bool `[rows, cols]`: `masks.visible` (masks.py) on one tile (-1: unbounded window side).

    The rows' positions and segment ids are in registers; the columns' are
    loaded at `other_offsets`. Rows are queries, or keys (dK/dV's transposed tiles).
    """
    other_pos = tl.load(other_pos_ref + other_offsets, mask=other_valid, other=0)
    if ROWS_ARE_QUERIES:
        diff = pos[:, None] - other_pos[None, :]  # q_pos - kv_pos
    else:
        diff = other_pos[None, :] - pos[:, None]
    mask = valid[:, None] & other_valid[None, :]
    if CAUSAL:
        mask = mask & (diff >= 0)
    if WINDOW_LEFT >= 0:
        mask = mask & (diff <= WINDOW_LEFT)
    if WINDOW_RIGHT >= 0:
        mask = mask & (diff >= -WINDOW_RIGHT)
    if HAS_SEGMENTS:
        other_seg = tl.load(other_seg_ref + other_offsets, mask=other_valid, other=0)
        mask = mask & (seg[:, None] == other_seg[None, :])
    return mask


@triton.jit
def any_row(mask):
    """bool `[cols]`: which columns of a `[rows, cols]` mask have any True."""
    return tl.max(mask.to(tl.int32), axis=0) > 0


@triton.jit
def block_range(ranges_ref, row):
    """`(lo, full_lo, full_hi, hi)` of one outer block: see the module docstring."""
    base = ranges_ref + row * 4
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)


@triton.jit
def stage_bounds(stage: tl.constexpr, lo, full_lo, full_hi, hi):
    """Block bounds of stage 0 (masked), 1 (fully visible, unmasked) or 2 (masked)."""
    if stage == 0:
        return lo, full_lo
    if stage == 1:
        return full_lo, full_hi
    return full_hi, hi
