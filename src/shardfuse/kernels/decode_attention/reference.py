"""The decode-attention oracle: plain einsums over the whole `[T, S]` score matrix.

    q_pos[b, t] = lengths[b] - T + t
    visible[b, t, j] = j < lengths[b] and masks.visible(causal, window)(q_pos[b, t], j)
    s[b, t, h, j] = cap(scale * q[b, t, h] . k[b, j, h // G])
    out[b, t, h] = sum_j softmax_j(s[b, t, h, j] over visible j) v[b, j, h // G]

Float32 scores and statistics (`Precision.HIGHEST` for float32 inputs), no
chunking: the oracle of the split backends; the arithmetic is the attention
oracle's (`kernels/attention/reference.masked_attention`) under the decode
mask. Rows without a visible key give 0 and lse = -inf; keys no query sees are
zeroed first, so NaN or garbage in the unused part of the cache never reaches
an output. Forward only.
"""

import jax.numpy as jnp

from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.reference import masked_attention
from shardfuse.kernels.decode_attention import base


def visibility(config: base.DecodeConfig, lengths, T: int, S: int):
    """bool `[B, T, S]`: which cache rows each query sees (the one decode mask)."""
    q_pos = base.query_positions(lengths, T)[:, :, None]  # [B, T, 1]
    kv_pos = jnp.arange(S, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    valid = kv_pos < lengths.astype(jnp.int32)[:, None, None]
    return masks.visible(config.attention, q_pos, kv_pos, valid=valid)


def decode_attention(config: base.DecodeConfig, q, k, v, lengths):
    """Decode attention on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`."""
    mask = visibility(config, lengths, q.shape[1], k.shape[1])  # [B, T, S]
    return masked_attention(config.attention, q, k, v, mask)
