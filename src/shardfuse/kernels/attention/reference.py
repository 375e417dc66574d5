"""The attention oracle: plain einsums over the whole `[T, S]` score matrix.

    out[b, t, h] = sum_s softmax_s(mask(cap(scale * q[b, t, h] . k[b, s, h // G]))) v[b, s, h // G]
    lse[b, h, t] = log sum_s exp(...)                                   (float32)

Float32 accumulation and statistics, `Precision.HIGHEST` for float32 inputs,
no tiling and no custom_vjp: gradients come from autodiff, written so that
rows without a visible key give 0, lse = -inf and zero (finite) gradients.
Memory is O(T * S); use it to check other implementations, not to train.
"""

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.attention import base, masks
from shardfuse.kernels.precision import dot_precision


def reference_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Attention on validated inputs; returns `(out [B, T, H, D], lse float32 [B, H, T])`."""
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    precision = dot_precision(q.dtype)
    mask = masks.visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg)
    mask = jnp.broadcast_to(mask, (B, T, k.shape[1]))  # [B, T, S]
    # Zero what no query sees (and rows that see nothing), so that NaN or inf
    # there reaches neither outputs nor gradients: 0 * NaN would.
    row_visible = jnp.any(mask, axis=2)  # [B, T]
    col_visible = jnp.any(mask, axis=1)  # [B, S]
    q = jnp.where(row_visible[:, :, None, None], q, 0)
    k = jnp.where(col_visible[:, :, None, None], k, 0)
    v = jnp.where(col_visible[:, :, None, None], v, 0)

    q = q.reshape(B, T, K, G, D)  # GQA by reshape: query head h reads kv head h // G
    logits = jnp.einsum(
        "BTKGD,BSKD->BKGTS", q, k, preferred_element_type=jnp.float32, precision=precision
    )
    logits = base.apply_softcap(logits * config.scale, config.logit_softcap)
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
    row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    # exp(-inf) = 0 with derivative 0: masked entries never see inf * 0.
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
