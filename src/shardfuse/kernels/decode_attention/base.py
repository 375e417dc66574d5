"""Shared pieces of decode attention: validation, the static config, chunk bounds, the lse merge.

Decode attention is attention of a few new queries against a KV cache whose
first `lengths[b]` rows are valid. The queries are the last `T` tokens of the
valid prefix (their own keys already written to the cache), so query `t` of
batch row `b` sits at position

    q_pos[b, t] = lengths[b] - T + t

and key `j` is visible to it iff `j < lengths[b]` and the attention rules of
`kernels/attention/masks.py` hold with `causal=True` (and the window, if any):
`j <= q_pos` and `q_pos - j <= left`. A query with no visible key (a length
below T, length 0) returns 0 and lse = -inf, as in flash attention.

Flash-decoding (Dao, Haziza, Massa, Sizov 2023): the cache length is cut into
chunks of `block_kv` rows, each chunk gives a partial `(out, lse)` per query
and head, computed in parallel, and `merge_partials` combines them exactly:

    lse = log sum_c exp(lse_c),   out = sum_c exp(lse_c - lse) out_c

Every backend (xla, pallas_tpu, triton) produces partials in one layout,
`out_part` float32 `[B, N, T, H, D]` and `lse_part` float32 `[B, N, T, H]`
(N chunks), and shares this merge.

Axis glossary: B batch, T queries per row, S cache length, H query heads,
K kv heads, G = H // K, D head dim, N chunks, C rows per chunk.
"""

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse.kernels.attention import base as attention_base


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static (hashable) decode-attention options after validation and defaulting.

    Attributes:
      window: `(left, right)` as in `flash_attention`, or None; causal always
        applies, so only `left` narrows what a query sees.
      logit_softcap: `softcap * tanh(x / softcap)` on the scaled logits, or None.
      scale: the logit scale.
      block_kv: cache rows per chunk (one parallel split), or None for the backend's default.
    """

    window: attention_base.Window | None
    logit_softcap: float | None
    scale: float
    block_kv: int | None = None

    @property
    def attention(self) -> attention_base.AttentionConfig:
        """The equivalent causal `AttentionConfig` (for `masks.visible`)."""
        return attention_base.AttentionConfig(
            causal=True, window=self.window, logit_softcap=self.logit_softcap, scale=self.scale
        )

    @property
    def window_left(self) -> int | None:
        """How far back a query sees (None: unbounded)."""
        return None if self.window is None else self.window[0]


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate(q, k, v, lengths, *, window, logit_softcap, scale, block_kv) -> DecodeConfig:
    """Checks a decode-attention call; returns its `DecodeConfig`.

    q, k, v follow `flash_attention`'s rules (rank 4, one supported dtype,
    matching batch and head dim, `H % K == 0`). `lengths` must be an integer
    array `[B]`; when its values are known (not traced) they must lie in
    `[0, S]`.

    Raises:
      ValueError: shapes, head counts, lengths' shape or values, window,
        softcap, scale or block_kv are invalid.
      TypeError: dtypes are invalid (float64 or integer q/k/v, float lengths).
    """
    config = attention_base.validate(
        q,
        k,
        v,
        causal=True,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        window=window,
        logit_softcap=logit_softcap,
        scale=scale,
    )
    B = q.shape[0]
    S = k.shape[1]
    if not hasattr(lengths, "shape") or not hasattr(lengths, "dtype"):
        raise TypeError(
            f"lengths must be an integer array [B] = ({B},), got {type(lengths).__name__}"
        )
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths has dtype {lengths.dtype}; expected an integer dtype (int32)")
    if tuple(lengths.shape) != (B,):
        raise ValueError(
            f"lengths has shape {tuple(lengths.shape)}; expected [B] = ({B},), one valid "
            "cache length per batch row"
        )
    if _is_concrete(lengths) and B:
        values = np.asarray(lengths)
        if values.min() < 0 or values.max() > S:
            raise ValueError(
                f"lengths={values.tolist()} must lie in [0, S] = [0, {S}] (S: the cache length "
                "k.shape[1])"
            )
    if block_kv is not None and (
        isinstance(block_kv, bool) or not isinstance(block_kv, numbers.Integral) or block_kv < 1
    ):
        raise ValueError(f"block_kv={block_kv!r} must be a positive int or None")
    return DecodeConfig(
        window=config.window,
        logit_softcap=config.logit_softcap,
        scale=config.scale,
        block_kv=None if block_kv is None else int(block_kv),
    )


def query_positions(lengths, T: int):
    """int32 `[B, T]`: `lengths[b] - T + t`, the queries' absolute positions.

    Example:
      >>> query_positions(jnp.array([5, 1]), 2).tolist()
      [[3, 4], [-1, 0]]
    """
    return lengths.astype(jnp.int32)[:, None] - T + jnp.arange(T, dtype=jnp.int32)


def chunk_bounds(config: DecodeConfig, lengths, T: int, block_kv: int, num_chunks: int):
    """int32 `(first, last)` `[B]`: the chunks that hold a key some query of the row sees.

    Keys `[lengths - T - left, lengths - 1]` are the only ones visible (left:
    the window); chunks outside `[first, last]` hold none. A row with length
    0 gets `first = 1 > last = 0`, an empty range.

    Example:
      >>> config = DecodeConfig(window=(3, 0), logit_softcap=None, scale=1.0)
      >>> first, last = chunk_bounds(config, jnp.array([10, 0]), 1, 4, 3)
      >>> first.tolist(), last.tolist()
      ([1, 1], [2, 0])
    """
    lengths = lengths.astype(jnp.int32)
    last = jnp.clip((lengths - 1) // block_kv, 0, num_chunks - 1)
    lo = jnp.zeros_like(lengths)
    if config.window_left is not None:
        lo = jnp.maximum(lengths - T - config.window_left, 0)
    first = jnp.where(lengths > 0, jnp.minimum(lo // block_kv, last), last + 1)
    return first.astype(jnp.int32), last.astype(jnp.int32)


def merge_partials(out_part, lse_part, dtype):
    """Merges chunk partials by their lse: `(out [B, T, H, D] in dtype, lse float32 [B, H, T])`.

    Args:
      out_part: float32 `[B, N, T, H, D]`, each chunk's normalised output (0
        where the chunk has no visible key).
      lse_part: float32 `[B, N, T, H]`, each chunk's log-sum-exp (-inf there).
      dtype: the output dtype.

    Example:
      >>> out_part = jnp.array([1.0, 3.0]).reshape(1, 2, 1, 1, 1)
      >>> lse_part = jnp.log(jnp.array([1.0, 3.0])).reshape(1, 2, 1, 1)
      >>> out, lse = merge_partials(out_part, lse_part, jnp.float32)
      >>> round(float(out[0, 0, 0, 0]), 4), round(float(jnp.exp(lse[0, 0, 0])), 4)
      (2.5, 4.0)
    """
    top = jnp.max(lse_part, axis=1, keepdims=True)  # [B, 1, T, H]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp(lse_part - top)  # exp(-inf) = 0 for empty chunks
    total = jnp.sum(weight, axis=1)  # [B, T, H]
    has_key = total > 0
    safe_total = jnp.where(has_key, total, 1.0)
    # Empty chunks have weight 0 and output 0; `where` keeps 0 * (anything) out entirely.
    weighted = jnp.where(weight[..., None] > 0, weight[..., None] * out_part, 0.0)
    out = jnp.sum(weighted, axis=1) / safe_total[..., None]
    lse = jnp.where(has_key, top[:, 0] + jnp.log(safe_total), -jnp.inf)
    return out.astype(dtype), lse.transpose(0, 2, 1)


def empty_result(q, return_lse):
    """The result where no key can be visible (B, T or S == 0): zeros and lse = -inf."""
    return attention_base.empty_result(q, return_lse)
