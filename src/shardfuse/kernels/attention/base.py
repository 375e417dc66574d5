"""Shared pieces of the attention op: validation, the static config (masks: masks.py).

Every backend receives inputs that `validate` has already checked and an
`AttentionConfig` holding the static options, so a backend only ever raises
`NotImplementedError` (valid input it cannot handle), never `ValueError`.

Axis glossary: B batch, T query length, S key length, H query heads,
K kv heads, G = H // K query heads per kv head, D head dim.
"""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse._keywords import passes_keywords
from shardfuse.kernels.precision import SUPPORTED_DTYPES

Window = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the blockwise attention paths.

    Attributes:
      block_q: query rows per tile.
      block_kv: key/value rows per tile.

    A backend may refuse sizes it cannot tile with (NotImplementedError).
    `None` fields take the backend's default.
    """

    block_q: int | None = None
    block_kv: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or value < 1):
                raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int or None")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static (hashable) attention options after validation and defaulting.

    `default_positions` is a fact of the call, not an option: True when neither
    `q_positions` nor `kv_positions` was given (the bottom-right aligned aranges),
    which backends that cannot take positions (cudnn) need to know statically.
    """

    causal: bool
    window: Window | None
    logit_softcap: float | None
    scale: float
    block_sizes: BlockSizes = BlockSizes()
    default_positions: bool = False


def _shape_error(name, value, expected):
    return ValueError(f"{name} has shape {tuple(value.shape)}; expected {expected}")


def _check_int_array(name, x, expected_shape, expected_text):
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} has dtype {x.dtype}; expected an integer dtype (int32)")
    if tuple(x.shape) != tuple(expected_shape):
        raise _shape_error(name, x, expected_text)


def check_window(window) -> Window | None:
    """`window` as `(left, right)` (ints >= 0 or None), or None when unbounded both ways.

    The rule of the `window=` argument of every attention entry point (`validate`, the
    ring's load-balance report). Raises ValueError naming the offending side.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"window={window!r} must be None or a pair (left, right) of ints >= 0 or None"
        )
    out = []
    for side, value in zip(("left", "right"), window, strict=True):
        if value is None:
            out.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise ValueError(
                f"window {side}={value!r} in window={window!r} must be an int >= 0 or None"
            )
        # Larger windows cover every int32 position difference anyway.
        out.append(int(min(int(value), 2**31 - 1)))
    if out == [None, None]:
        return None
    return tuple(out)


def _check_scalar(name, value, *, positive):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a Python float")
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name}={value!r} must be a finite number{' > 0' if positive else ''}")
    return value


def validate(
    q,
    k,
    v,
    *,
    causal: bool = False,
    q_positions=None,
    kv_positions=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    window: Window | None = None,
    logit_softcap: float | None = None,
    scale: float | None = None,
    block_sizes: BlockSizes | None = None,
):
    """Checks the inputs of an attention call and returns its `AttentionConfig`.

    The keywords are those of `sf.flash_attention`, with its defaults.

    Raises:
      ValueError: shapes, ranks, head counts, window, softcap or scale are invalid.
      TypeError: dtypes are invalid (integer or float64 inputs, mismatched dtypes).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            layout = "[B, T, H, D]" if name == "q" else "[B, S, K, D]"
            raise ValueError(
                f"{name} has rank {x.ndim} (shape {tuple(x.shape)}); expected {layout}"
            )
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {x.dtype}; supported dtypes are float32, bfloat16 and float16"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, D = q.shape
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape; got k {k.shape} and v {v.shape}")
    Bk, S, K, Dk = k.shape
    if Bk != B:
        raise ValueError(f"batch sizes differ: q has B={B}, k and v have B={Bk}")
    if Dk != D:
        raise ValueError(f"head dims differ: q has D={D}, k and v have D={Dk}")
    if K == 0 or H % K != 0:
        raise ValueError(f"num query heads H={H} must be a multiple of num kv heads K={K}")
    if q_positions is not None:
        _check_int_array("q_positions", q_positions, (T,), f"[T] = ({T},)")
    if kv_positions is not None:
        _check_int_array("kv_positions", kv_positions, (S,), f"[S] = ({S},)")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError(
            "pass both q_segment_ids and kv_segment_ids or neither; got "
            f"q_segment_ids={'None' if q_segment_ids is None else 'array'}, "
            f"kv_segment_ids={'None' if kv_segment_ids is None else 'array'}"
        )
    if q_segment_ids is not None:
        _check_int_array("q_segment_ids", q_segment_ids, (B, T), f"[B, T] = ({B}, {T})")
        _check_int_array("kv_segment_ids", kv_segment_ids, (B, S), f"[B, S] = ({B}, {S})")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal={causal!r} must be a bool")
    window = check_window(window)
    logit_softcap = _check_scalar("logit_softcap", logit_softcap, positive=True)
    scale = _check_scalar("scale", scale, positive=False)
    if scale is None:
        scale = 1.0 / math.sqrt(D) if D else 1.0
    if block_sizes is None:
        block_sizes = BlockSizes()
    elif not isinstance(block_sizes, BlockSizes):
        raise TypeError(
            f"block_sizes must be a BlockSizes or None, got {type(block_sizes).__name__}"
        )
    return AttentionConfig(
        causal=bool(causal),
        window=window,
        logit_softcap=logit_softcap,
        scale=scale,
        block_sizes=block_sizes,
    )


# The static options of every public attention function, as `validate` takes them (its
# keywords and defaults: the one list); `AttentionConfig` holds their validated form.
CONFIG_OPTIONS = ("causal", "window", "logit_softcap", "scale", "block_sizes")

# Decorator of `sf.flash_attention` and both ring attentions, which take `CONFIG_OPTIONS`
# as `**options` and hand them to `validate` unread: their signatures list them.
config_options = passes_keywords(validate, CONFIG_OPTIONS)


def validate_arrays(q, k, v, **options):
    """`validate`, then q, k and v as `jax.Array`s: returns `(config, q, k, v)`.

    The one entry check of `sf.flash_attention`, the per-shard ring attention and
    `sf.ring_attention`. Converting after validating refuses float64 NumPy inputs
    instead of silently turning them into float32.

    Example:
      >>> import numpy as np
      >>> q = k = v = np.zeros((1, 4, 2, 8), np.float32)
      >>> config, q, k, v = validate_arrays(q, k, v, causal=True)
      >>> config.causal, type(q).__name__
      (True, 'ArrayImpl')
    """
    config = validate(q, k, v, **options)
    q, k, v = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (q, k, v))
    return config, q, k, v


def default_positions(T: int, S: int, q_positions=None, kv_positions=None):
    """Returns int32 positions, bottom-right aligned by default (`q = arange(T) + S - T`)."""
    if q_positions is None:
        q_positions = jnp.arange(T, dtype=jnp.int32) + (S - T)
    if kv_positions is None:
        kv_positions = jnp.arange(S, dtype=jnp.int32)
    return jnp.asarray(q_positions, jnp.int32), jnp.asarray(kv_positions, jnp.int32)


def apply_softcap(logits, softcap):
    """`softcap * tanh(logits / softcap)`, the Gemma-2 logit cap (identity for None)."""
    if softcap is None:
        return logits
    return softcap * jnp.tanh(logits / softcap)


def empty_result(q, return_lse):
    """The result for B, T or S == 0: zeros and lse = -inf (every row has no visible key)."""
    B, T, H, _ = q.shape
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.full((B, H, T), -jnp.inf, jnp.float32)
    return (out, lse) if return_lse else out
