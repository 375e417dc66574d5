"""Portable blockwise flash attention in plain JAX (lax loops, online softmax).

Forward (FlashAttention, Dao et al. 2022; FlashAttention-2, Dao 2023): for
each query block, loop over key/value blocks keeping a running row maximum
`m`, normaliser `l` and float32 accumulator, rescaled as the maximum grows;
`lse = m + log l`. Backward recomputes probabilities from lse, block by block:
`ds = p * (dp - delta)` with `delta = rowsum(do * o) - dlse`; dK and dV
accumulate in the outer loop over key blocks, dQ in a float32 buffer.

No `[T, S]` tensor is ever built or saved: memory is O((T + S) * D + block^2)
per head. Blocks that no query can see (causal, window, disjoint segment
ranges, padding) are skipped with `lax.cond`, so causal costs about half.
GQA reshapes the query heads into `[K, G]` groups so K/V are never repeated.
Sequence lengths that are not block multiples are zero padded and the pad
is masked by validity, so any T and S work.
"""

import math

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels import vma
from shardfuse.kernels.attention import base, masks, protocol
from shardfuse.kernels.precision import dot_precision

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_KV = 256


def _block_size(length: int, requested: int | None, default: int) -> int:
    """Rows per tile: `requested`, else even tiles of at most `default` rows (multiples of 8)."""
    target = requested or default
    if length <= target:
        return max(length, 1)
    if requested is not None:
        return requested
    num_blocks = math.ceil(length / default)
    return min(default, -(-math.ceil(length / num_blocks) // 8) * 8)


def _pad_axis(x, axis, size):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _block_visibility(config, q_pos, q_valid, kv_pos, kv_valid, q_seg, kv_seg):
    """bool `[nq, nk]`: False only where no query of the block can see any key of it."""
    # Ranges as [nq, 1, 1] against [1, nk, 1]; segment-id ranges [nq, 1, B] against [1, nk, B].
    q_range = [x[:, None, None] for x in masks.value_range(q_pos, q_valid)]
    kv_range = [x[None, :, None] for x in masks.value_range(kv_pos, kv_valid)]
    seg_ranges = ()
    if q_seg is not None:  # q_seg [nq, B, bq], kv_seg [nk, B, bk]
        qs = [x[:, None] for x in masks.value_range(q_seg, q_valid[:, None, :])]
        ks = [x[None, :] for x in masks.value_range(kv_seg, kv_valid[:, None, :])]
        seg_ranges = (qs, ks)
    some, _ = masks.block_visibility(config, q_range, kv_range, *seg_ranges)
    real = jnp.any(q_valid, -1)[:, None] & jnp.any(kv_valid, -1)[None, :]
    return real & jnp.any(some, axis=-1)  # some batch row has a visible pair


class _Tiles:
    """Inputs cut into blocks: q-side `[nq, ...]`, kv-side `[nk, ...]`."""

    def __init__(self, config, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        B, T, H, D = q.shape
        S, K = k.shape[1], k.shape[2]
        self.shape = (B, T, S, H, K, H // K, D)
        self.block_q = bq = _block_size(T, config.block_sizes.block_q, DEFAULT_BLOCK_Q)
        self.block_kv = bk = _block_size(S, config.block_sizes.block_kv, DEFAULT_BLOCK_KV)
        self.nq, self.nk = -(-T // bq), -(-S // bk)
        self.q_pos = _pad_axis(q_pos, 0, self.nq * bq).reshape(self.nq, bq)
        self.kv_pos = _pad_axis(kv_pos, 0, self.nk * bk).reshape(self.nk, bk)
        self.q_valid = (jnp.arange(self.nq * bq) < T).reshape(self.nq, bq)
        self.kv_valid = (jnp.arange(self.nk * bk) < S).reshape(self.nk, bk)
        self.q_seg = self.kv_seg = None
        if q_seg is not None:
            self.q_seg = self._split_seq(q_seg, bq, self.nq, 1)  # [nq, B, bq]
            self.kv_seg = self._split_seq(kv_seg, bk, self.nk, 1)  # [nk, B, bk]
        self.visible = _block_visibility(
            config, self.q_pos, self.q_valid, self.kv_pos, self.kv_valid, self.q_seg, self.kv_seg
        )

    @staticmethod
    def _split_seq(x, block, num_blocks, axis):
        """`[.., L, ..]` along `axis` -> `[n, .., block, ..]` with the block index in front."""
        x = _pad_axis(x, axis, num_blocks * block)
        x = x.reshape(*x.shape[:axis], num_blocks, block, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    def queries(self, x):
        """`[B, T, H, D]` -> `[nq, B, K, G, bq, D]`."""
        B, T, S, H, K, G, D = self.shape
        x = self._split_seq(x, self.block_q, self.nq, 1)  # [nq, B, bq, H, D]
        return x.reshape(self.nq, B, self.block_q, K, G, -1).transpose(0, 1, 3, 4, 2, 5)

    def keys(self, x):
        """`[B, S, K, D]` -> `[nk, B, K, bk, D]`."""
        return self._split_seq(x, self.block_kv, self.nk, 1).transpose(0, 1, 3, 2, 4)

    def row_stats(self, x):
        """`[B, H, T]` -> `[nq, B, K, G, bq]`."""
        B, T, S, H, K, G, D = self.shape
        x = self._split_seq(x.reshape(B, K, G, T), self.block_q, self.nq, 3)
        return x

    def untile_queries(self, x):
        """`[nq, B, K, G, bq, D]` -> `[B, T, H, D]`."""
        B, T, S, H, K, G, D = self.shape
        x = x.transpose(1, 0, 4, 2, 3, 5).reshape(B, self.nq * self.block_q, H, -1)
        return x[:, :T]

    def untile_row_stats(self, x):
        """`[nq, B, K, G, bq]` -> `[B, H, T]`."""
        B, T, S, H, K, G, D = self.shape
        x = x.transpose(1, 2, 3, 0, 4).reshape(B, H, self.nq * self.block_q)
        return x[:, :, :T]

    def untile_keys(self, x):
        """`[nk, B, K, bk, D]` -> `[B, S, K, D]`."""
        B, T, S, H, K, G, D = self.shape
        return x.transpose(1, 0, 3, 2, 4).reshape(B, self.nk * self.block_kv, K, -1)[:, :S]

    def tile_mask(self, config, i, j):
        """bool `[B | 1, bq, bk]`: visibility of query block i to key block j."""
        mask = masks.visibility_mask(
            config,
            self.q_pos[i],
            self.kv_pos[j],
            None if self.q_seg is None else self.q_seg[i],
            None if self.kv_seg is None else self.kv_seg[j],
        )
        mask &= self.q_valid[i][:, None] & self.kv_valid[j][None, :]
        return mask if mask.ndim == 3 else mask[None]


def _logits(config, q_blk, k_blk, precision):
    """Scaled, capped float32 scores `[B, K, G, bq, bk]` and tanh for the cap's derivative."""
    s = jnp.einsum(
        "BKGqD,BKkD->BKGqk", q_blk, k_blk, preferred_element_type=jnp.float32, precision=precision
    )
    s = s * config.scale
    if config.logit_softcap is None:
        return s, None
    t = jnp.tanh(s / config.logit_softcap)
    return config.logit_softcap * t, t


def _tied(q, *index_arrays):
    """`(q, *index_arrays)` through one `lax.optimization_barrier`: the masks then depend on q.

    Differentiating a `lax.scan` whose body calls this kernel (a stack of
    layers), JAX's partial evaluation moves work that does not depend on the
    loop carry out of the loop. The tile masks depend only on positions and
    segment ids, so every tile's mask, broadcast to `[B, K, G, bq, bk]` (and
    the `-inf` it selects), was computed before the loop and kept through it:
    `O(T * S)` memory per layer stack, more than the scores themselves. Tied
    to q they stay in the loop, computed one tile at a time.
    """
    return lax.optimization_barrier((q, *index_arrays))


def forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Blockwise forward on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`.

    Positions must be int32 `[T]` / `[S]`; segment ids None or `[B, T]` / `[B, S]`.
    Used by `flash_attention` and by collectives (ring attention) that merge
    partial results themselves.
    """
    q, k, v, q_pos, kv_pos, q_seg, kv_seg = vma.match_varying(q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    q, q_pos, kv_pos, q_seg, kv_seg = _tied(q, q_pos, kv_pos, q_seg, kv_seg)
    axes = vma.common_axes(q)
    tiles = _Tiles(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    B, T, S, H, K, G, D = tiles.shape
    precision = dot_precision(q.dtype)
    q_tiles, k_tiles, v_tiles = tiles.queries(q), tiles.keys(k), tiles.keys(v)

    def query_block(_, xs):
        i, q_blk = xs

        def kv_step(j, carry):
            m, denom, acc = carry
            mask = tiles.tile_mask(config, i, j)  # [B|1, bq, bk]
            s, _ = _logits(config, q_blk, k_tiles[j], precision)
            s = jnp.where(mask[:, None, None], s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe[..., None])
            # Keys no query of this tile sees are zeroed: 0 * NaN would leak.
            v_blk = jnp.where(jnp.any(mask, axis=1)[:, None, :, None], v_tiles[j], 0)
            pv = jnp.einsum(
                "BKGqk,BKkD->BKGqD",
                p.astype(v.dtype),
                v_blk,
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            return m_new, alpha * denom + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

        def maybe_step(j, carry):
            return lax.cond(tiles.visible[i, j], lambda c: kv_step(j, c), lambda c: c, carry)

        init = tuple(
            vma.to_varying(x, axes)
            for x in (
                jnp.full((B, K, G, tiles.block_q), -jnp.inf, jnp.float32),
                jnp.zeros((B, K, G, tiles.block_q), jnp.float32),
                jnp.zeros((B, K, G, tiles.block_q, D), jnp.float32),
            )
        )
        m, denom, acc = lax.fori_loop(0, tiles.nk, maybe_step, init)
        has_key = denom > 0
        safe_denom = jnp.where(has_key, denom, 1.0)
        out = (acc / safe_denom[..., None]).astype(q.dtype)
        lse = jnp.where(has_key, m + jnp.log(safe_denom), -jnp.inf)
        return None, (out, lse)

    _, (out, lse) = lax.scan(query_block, None, (jnp.arange(tiles.nq), q_tiles))
    return tiles.untile_queries(out), tiles.untile_row_stats(lse)


def backward(
    config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse, *, grad_dtype=jnp.float32
):
    """Blockwise backward from saved `out` and `lse`: `(dq, dk, dv)` in `grad_dtype` (float32).

    `out` and `lse` may be those of a larger attention that this call is one
    block of (ring attention): `delta = rowsum(d_out * out) - d_lse` and
    `p = exp(s - lse)` then give this block's share of the gradients.
    """
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse = vma.match_varying(
        q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse
    )
    axes = vma.common_axes(q)
    tiles = _Tiles(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
    B, T, S, H, K, G, D = tiles.shape
    precision = dot_precision(q.dtype)
    lse, delta = protocol.backward_row_stats(out, lse, d_out, d_lse)
    q_tiles, do_tiles = tiles.queries(q), tiles.queries(d_out.astype(q.dtype))
    k_tiles, v_tiles = tiles.keys(k), tiles.keys(v)
    lse_tiles = tiles.row_stats(lse)
    delta_tiles = tiles.row_stats(delta)

    def kv_block(dq_acc, xs):
        j, k_blk, v_blk = xs

        def q_step(i, carry):
            dk, dv, dq_acc = carry
            mask = tiles.tile_mask(config, i, j)  # [B|1, bq, bk]
            # Zero what this tile cannot see so that NaN there never multiplies a 0.
            row_visible = jnp.any(mask, axis=2)[:, None, None, :, None]
            col_visible = jnp.any(mask, axis=1)[:, None, :, None]
            q_blk = jnp.where(row_visible, q_tiles[i], 0)
            k_clean = jnp.where(col_visible, k_blk, 0)
            v_clean = jnp.where(col_visible, v_blk, 0)
            do_blk = do_tiles[i]
            s, tanh = _logits(config, q_blk, k_clean, precision)
            p = jnp.exp(jnp.where(mask[:, None, None], s - lse_tiles[i][..., None], -jnp.inf))
            dv = dv + jnp.einsum(
                "BKGqk,BKGqD->BKkD",
                p.astype(v.dtype),
                do_blk,
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            dp = jnp.einsum(
                "BKGqD,BKkD->BKGqk",
                do_blk,
                v_clean,
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            ds = p * (dp - delta_tiles[i][..., None])
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds = (ds * config.scale).astype(q.dtype)
            dk = dk + jnp.einsum(
                "BKGqk,BKGqD->BKkD",
                ds,
                q_blk,
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            dq_blk = jnp.einsum(
                "BKGqk,BKkD->BKGqD",
                ds,
                k_clean,
                preferred_element_type=jnp.float32,
                precision=precision,
            )
            return dk, dv, dq_acc.at[i].add(dq_blk)

        def maybe_step(i, carry):
            return lax.cond(tiles.visible[i, j], lambda c: q_step(i, c), lambda c: c, carry)

        zeros = vma.to_varying(jnp.zeros((B, K, tiles.block_kv, D), jnp.float32), axes)
        dk, dv, dq_acc = lax.fori_loop(0, tiles.nq, maybe_step, (zeros, zeros, dq_acc))
        return dq_acc, (dk, dv)

    dq_init = vma.to_varying(jnp.zeros((tiles.nq, B, K, G, tiles.block_q, D), jnp.float32), axes)
    dq, (dk, dv) = lax.scan(kv_block, dq_init, (jnp.arange(tiles.nk), k_tiles, v_tiles))
    dq, dk, dv = tiles.untile_queries(dq), tiles.untile_keys(dk), tiles.untile_keys(dv)
    return dq.astype(grad_dtype), dk.astype(grad_dtype), dv.astype(grad_dtype)


_flash = protocol.differentiable(forward, backward)


def flash_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Blockwise attention on validated inputs; `(out [B, T, H, D], lse float32 [B, H, T])`.

    Differentiable: `protocol.differentiable(forward, backward)`.
    """
    return _flash(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
