"""The decode-attention oracle: plain einsums over the whole `[T, S]` score matrix.

    q_pos[b, t] = lengths[b] - T + t
    visible[b, t, j] = j < lengths[b] and masks.visible(causal, window)(q_pos[b, t], j)
    s[b, t, h, j] = cap(scale * q[b, t, h] . k[b, j, h // G])
    out[b, t, h] = sum_j softmax_j(s[b, t, h, j] over visible j) v[b, j, h // G]

Float32 scores and statistics (`Precision.HIGHEST` for float32 inputs), no
chunking: the oracle of the split backends. Rows without a visible key give 0
and lse = -inf; keys no query sees are zeroed first, so NaN or garbage in the
unused part of the cache never reaches an output. Forward only.
"""

import jax.numpy as jnp

from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.base import apply_softcap
from shardfuse.kernels.decode_attention import base
from shardfuse.kernels.precision import dot_precision


def visibility(config: base.DecodeConfig, lengths, T: int, S: int):
    """bool `[B, T, S]`: which cache rows each query sees (the one decode mask)."""
    q_pos = base.query_positions(lengths, T)[:, :, None]  # [B, T, 1]
    kv_pos = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    valid = kv_pos < lengths.astype(jnp.int32)[:, None, None]
    return masks.visible(config.attention, q_pos, kv_pos, valid=valid)


def decode_attention(config: base.DecodeConfig, q, k, v, lengths):
    """Decode attention on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    precision = dot_precision(q.dtype)
    mask = visibility(config, lengths, T, S)  # [B, T, S]
    row_visible = jnp.any(mask, axis=2)[:, :, None, None]  # [B, T, 1, 1]
    col_visible = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    q = jnp.where(row_visible, q, 0).reshape(B, T, K, G, D)  # query h reads kv head h // G
    k = jnp.where(col_visible, k, 0)
    v = jnp.where(col_visible, v, 0)
    logits = jnp.einsum(
        "BTKGD,BSKD->BKGTS", q, k, preferred_element_type=jnp.float32, precision=precision
    )
    logits = apply_softcap(logits * config.scale, config.logit_softcap)
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnormalized = jnp.exp(jnp.where(mask, logits - row_max, -jnp.inf))
    denom = jnp.sum(unnormalized, axis=-1, keepdims=True)  # [B, K, G, T, 1]
    has_key = denom > 0
    safe_denom = jnp.where(has_key, denom, 1.0)
    probs = unnormalized / safe_denom
    lse = jnp.where(has_key, row_max + jnp.log(safe_denom), -jnp.inf)[..., 0]  # [B, K, G, T]
    out = jnp.einsum(
        "BKGTS,BSKD->BTKGD",
        probs.astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    return out.reshape(B, T, H, D).astype(q.dtype), lse.reshape(B, H, T)
