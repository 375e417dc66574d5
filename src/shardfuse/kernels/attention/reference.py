"""The attention oracle: plain einsums over the whole `[T, S]` score matrix.

    out[b, t, h] = sum_s softmax_s(mask(cap(scale * q[b, t, h] . k[b, s, h // G]))) v[b, s, h // G]
    lse[b, h, t] = log sum_s exp(...)                                   (float32)

Float32 accumulation and statistics, `Precision.HIGHEST` for float32 inputs,
no tiling and no custom_vjp: gradients come from autodiff, written so that
rows without a visible key give 0, lse = -inf and zero (finite) gradients.
Memory is O(T * S); use it to check other implementations, not to train.

For the backend protocol (`protocol.py`), `forward` is `reference_attention`
and `backward` writes the FlashAttention-2 gradients out naively from a given
(possibly global) `out` and `lse`: the oracle of the other backends' block
backwards, itself checked against autodiff.
"""

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.attention import base, masks, protocol
from shardfuse.kernels.precision import dot_precision


def reference_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Attention on validated inputs; returns `(out [B, T, H, D], lse float32 [B, H, T])`."""
    mask = masks.visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg)
    return masked_attention(config, q, k, v, mask)


def masked_attention(config: base.AttentionConfig, q, k, v, mask):
    """Attention under an explicit mask: `(out [B, T, H, D], lse float32 [B, H, T])`.

    The oracle's arithmetic, shared by every op that states its mask its own
    way (`reference_attention` from positions and segment ids, the decode
    reference from cache lengths). Only `config.scale` and
    `config.logit_softcap` are read; `mask` is bool `[B, T, S]` (or
    broadcastable to it).

    Example:
      >>> import jax.numpy as jnp
      >>> config = base.AttentionConfig(causal=False, window=None, logit_softcap=None, scale=1.0)
      >>> q = k = v = jnp.ones((1, 2, 1, 4))
      >>> out, lse = masked_attention(config, q, k, v, jnp.array([[[True, False], [False, False]]]))
      >>> out[0, :, 0, 0].tolist(), lse.tolist()
      ([1.0, 0.0], [[[4.0, -inf]]])
    """
    B, T, H, D = q.shape
    K = k.shape[2]
    G = H // K
    precision = dot_precision(q.dtype)
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


forward = reference_attention


def backward(
    config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
    *, grad_dtype=jnp.float32,
):  # fmt: skip
    """Gradients `(dq, dk, dv)` in `grad_dtype` from a saved `out` and float32 `lse`, naively.

    With `p = exp(s - lse)` over the visible keys and
    `delta = rowsum(d_out * out) - d_lse` (both global when `out` and `lse` are
    those of a larger attention this call is one block of):

        dv = p^T d_out,   ds = p * (d_out v^T - delta) * cap'(s),
        dq = scale * ds k,   dk = scale * ds^T q

    Everything is float32 at `Precision.HIGHEST`, over the whole `[T, S]` score matrix.
    """
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    mask = masks.visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg)
    mask = jnp.broadcast_to(mask, (B, T, S))  # [B, T, S]
    # As in the forward: what nobody sees is zeroed, so that NaN there never leaks.
    row_visible = jnp.any(mask, axis=2)[:, :, None, None]  # [B, T, 1, 1]
    col_visible = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    q = jnp.where(row_visible, q, 0).astype(f32).reshape(B, T, K, G, D)
    k = jnp.where(col_visible, k, 0).astype(f32)
    v = jnp.where(col_visible, v, 0).astype(f32)
    d_out = jnp.where(row_visible, d_out, 0).astype(f32)
    out = jnp.where(row_visible, out, 0).astype(f32)

    s = jnp.einsum("BTKGD,BSKD->BKGTS", q, k, precision=hi) * config.scale
    cap_grad = 1.0
    if config.logit_softcap is not None:
        t = jnp.tanh(s / config.logit_softcap)
        s, cap_grad = config.logit_softcap * t, 1.0 - t * t
    lse, delta = protocol.backward_row_stats(out, lse, d_out, d_lse, precision=hi)
    lse, delta = lse.reshape(B, K, G, T), delta.reshape(B, K, G, T)
    p = jnp.exp(jnp.where(mask[:, None, None], s - lse[..., None], -jnp.inf))  # [B, K, G, T, S]
    d_out = d_out.reshape(B, T, K, G, D)
    dv = jnp.einsum("BKGTS,BTKGD->BSKD", p, d_out, precision=hi)
    dp = jnp.einsum("BTKGD,BSKD->BKGTS", d_out, v, precision=hi)
    ds = p * (dp - delta[..., None]) * cap_grad * config.scale
    dq = jnp.einsum("BKGTS,BSKD->BTKGD", ds, k, precision=hi).reshape(B, T, H, D)
    dk = jnp.einsum("BKGTS,BTKGD->BSKD", ds, q, precision=hi)
    return dq.astype(grad_dtype), dk.astype(grad_dtype), dv.astype(grad_dtype)
