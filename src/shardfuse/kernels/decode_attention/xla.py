"""Flash-decoding in plain JAX: the cache cut into chunks, partial softmaxes merged by lse.

The cache `[B, S, K, D]` is viewed as `[B, N, C, K, D]` (N chunks of C =
`block_kv` rows; zero padded to a chunk multiple only when S is not one), and
every chunk computes, for all T queries and H heads at once, its own row
maximum, normaliser, normalised output and lse: one batched einsum over the
chunk axis, so the chunks run in parallel as flash-decoding's splits do on a
GPU. `base.merge_partials` then combines them exactly. Masks are the ones of
`reference.visibility`, per chunk; values nobody sees are zeroed first so
that garbage (NaN) in the unused cache never leaks. Forward only.

Axis glossary: B batch, T queries, S cache length, H query heads, K kv heads,
G = H // K, D head dim, N chunks, C rows per chunk.
"""

import math

import jax.numpy as jnp

from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.base import apply_softcap
from shardfuse.kernels.decode_attention import base
from shardfuse.kernels.precision import dot_precision

DEFAULT_BLOCK_KV = 512


def chunk_size(S: int, requested: int | None) -> int:
    """Cache rows per chunk: `requested`, else even chunks of at most 512 rows.

    Example:
      >>> chunk_size(1000, None), chunk_size(100, None), chunk_size(100, 32)
      (500, 100, 32)
    """
    if requested is not None:
        return min(requested, max(S, 1))
    if S <= DEFAULT_BLOCK_KV:
        return max(S, 1)
    return math.ceil(S / math.ceil(S / DEFAULT_BLOCK_KV))


def partials(config: base.DecodeConfig, q, k, v, lengths):
    """Each chunk's `(out_part float32 [B, N, T, H, D], lse_part float32 [B, N, T, H])`."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    C = chunk_size(S, config.block_kv)
    N = -(-S // C)
    if N * C != S:
        k, v = (jnp.pad(x, ((0, 0), (0, N * C - S), (0, 0), (0, 0))) for x in (k, v))
    k = k.reshape(B, N, C, K, D)
    v = v.reshape(B, N, C, K, D)
    precision = dot_precision(q.dtype)

    q_pos = base.query_positions(lengths, T)[:, None, :, None]  # [B, 1, T, 1]
    kv_pos = jnp.arange(N * C, dtype=jnp.int32).reshape(1, N, 1, C)  # [1, N, 1, C]
    valid = kv_pos < lengths.astype(jnp.int32)[:, None, None, None]
    mask = masks.visible(config.attention, q_pos, kv_pos, valid=valid)  # [B, N, T, C]
    col_visible = jnp.any(mask, axis=2)[..., None, None]  # [B, N, C, 1, 1]
    v = jnp.where(col_visible, v, 0)

    qg = q.reshape(B, T, K, G, D)
    logits = jnp.einsum(
        "BTKGD,BNCKD->BNKGTC", qg, k, preferred_element_type=jnp.float32, precision=precision
    )
    logits = apply_softcap(logits * config.scale, config.logit_softcap)
    mask = mask[:, :, None, None]  # [B, N, 1, 1, T, C]
    row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(jnp.where(mask, logits - row_max, -jnp.inf))  # [B, N, K, G, T, C]
    denom = jnp.sum(p, axis=-1)  # [B, N, K, G, T]
    has_key = denom > 0
    safe_denom = jnp.where(has_key, denom, 1.0)
    out = jnp.einsum(
        "BNKGTC,BNCKD->BNTKGD",
        p.astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    out = out / safe_denom.transpose(0, 1, 4, 2, 3)[..., None]
    lse = jnp.where(has_key, row_max[..., 0] + jnp.log(safe_denom), -jnp.inf)
    return out.reshape(B, N, T, H, D), lse.transpose(0, 1, 4, 2, 3).reshape(B, N, T, H)


def decode_attention(config: base.DecodeConfig, q, k, v, lengths):
    """Chunked decode attention on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`.

    Example:
      >>> import jax
      >>> q = jax.random.normal(jax.random.key(0), (2, 1, 4, 16))
      >>> k = v = jax.random.normal(jax.random.key(1), (2, 100, 2, 16))
      >>> config = base.DecodeConfig(window=None, logit_softcap=None, scale=0.25, block_kv=32)
      >>> out, lse = decode_attention(config, q, k, v, jnp.array([100, 7]))
      >>> out.shape, lse.shape
      ((2, 1, 4, 16), (2, 4, 1))
    """
    out_part, lse_part = partials(config, q, k, v, lengths)
    return base.merge_partials(out_part, lse_part, q.dtype)
