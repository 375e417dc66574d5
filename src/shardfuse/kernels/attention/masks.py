"""Which keys a query sees: the one definition of attention visibility.

Masks are defined on absolute positions (DESIGN.md, Conventions):

    visible(i, j) = (not causal or kv_pos[j] <= q_pos[i])
                    and (left is None or q_pos[i] - kv_pos[j] <= left)
                    and (right is None or kv_pos[j] - q_pos[i] <= right)
                    and (no segment ids or q_seg[i] == kv_seg[j])

written on differences `q_pos - kv_pos` (never sums), so that huge windows
cannot overflow int32. `visible` is that rule elementwise; `block_visibility`
is its consequence for blocks of queries and keys, from their position
(and segment id) ranges: may any query see any key (`some`, else the block is
skipped), and does every query see every key (`every`, the block needs no
mask). Both are plain jnp expressions, so the reference, the XLA blockwise
kernel, the Pallas TPU kernel bodies (traced as jnp ops), the Triton
wrappers and the ring schedule all call these; the Triton kernel bodies
(`tl.*`, triton_kernels.py) cannot, and restate `visible` citing this module.
Host-side counts of visible pairs (FLOPs, the planner, ring balance) live
at the bottom of the package, in `shardfuse.flops.visible_key_counts`, where
the data modules that need them can read them; a test checks that it counts
exactly the pairs `visible` lets through.
"""

import functools
import operator

import jax.numpy as jnp

_I32_MAX = jnp.iinfo(jnp.int32).max
_I32_MIN = jnp.iinfo(jnp.int32).min


def visible(config, q_pos, kv_pos, q_seg=None, kv_seg=None, *, valid=None):
    """Elementwise visibility of key `kv_pos` to query `q_pos` (broadcast against each other).

    Args:
      config: an `AttentionConfig` (its `causal` and `window` are read).
      q_pos, kv_pos: int32 positions, already shaped to broadcast (`[T, 1]` and
        `[1, S]` for a `[T, S]` mask).
      q_seg, kv_seg: optional segment ids, shaped likewise (None: no segments).
      valid: optional bool mask to start from (e.g. padding); default all True.

    Returns:
      bool, the broadcast shape of the arguments.

    Example:
      >>> from shardfuse.kernels.attention.base import AttentionConfig
      >>> config = AttentionConfig(causal=True, window=(1, None), logit_softcap=None, scale=1.0)
      >>> pos = jnp.arange(3)
      >>> visible(config, pos[:, None], pos[None, :]).astype(int).tolist()
      [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    diff = q_pos - kv_pos  # [.., T, S] = q_pos - kv_pos
    mask = jnp.ones(jnp.shape(diff), jnp.bool_) if valid is None else valid
    if config.causal:
        mask = mask & (diff >= 0)
    if config.window is not None:
        left, right = config.window
        if left is not None:
            mask = mask & (diff <= left)
        if right is not None:
            mask = mask & (-diff <= right)
    if q_seg is not None:
        mask = mask & (q_seg == kv_seg)
    return mask


def visibility_mask(config, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """Which keys each query sees: bool `[T, S]`, or `[B, T, S]` with segment ids.

    Args:
      config: an `AttentionConfig`.
      q_pos: int32 `[..., T]` absolute query positions.
      kv_pos: int32 `[..., S]` absolute key positions.
      q_seg, kv_seg: optional int `[B, T]` / `[B, S]` segment ids.
    """
    seg = () if q_seg is None else (q_seg[:, :, None], kv_seg[:, None, :])
    return visible(config, q_pos[..., :, None], kv_pos[..., None, :], *seg)


def value_range(values, valid=None, *, axis=-1):
    """`(min, max)` of `values` along `axis` over the entries where `valid` (default all).

    A slice with no valid entry gives `(int32 max, int32 min)`, an empty range.
    """
    if valid is None:
        return jnp.min(values, axis=axis), jnp.max(values, axis=axis)
    lo = jnp.min(jnp.where(valid, values, _I32_MAX), axis=axis)
    hi = jnp.max(jnp.where(valid, values, _I32_MIN), axis=axis)
    return lo, hi


def block_visibility(config, q_range, kv_range, q_seg_range=None, kv_seg_range=None):
    """`(some, every)` for blocks of queries and keys given as `(lo, hi)` ranges.

    `some` is False only where no query of the block can see any key of it
    (the block can be skipped); `every` is True only where every query sees
    every key (the block needs no mask). Ranges broadcast against each other
    (`[nq, 1]` against `[1, nk]` gives `[nq, nk]`); segment-id ranges too. A
    block with no real entry (an empty range) is not handled here: callers
    and their padding masks do that.

    Args:
      config: an `AttentionConfig` (`causal`, `window`).
      q_range, kv_range: `(lo, hi)` int32 position ranges.
      q_seg_range, kv_seg_range: optional `(lo, hi)` segment-id ranges.

    Example:
      >>> from shardfuse.kernels.attention.base import AttentionConfig
      >>> config = AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0)
      >>> some, every = block_visibility(config, (jnp.int32(0), jnp.int32(7)), (8, 15))
      >>> bool(some), bool(every)
      (False, False)
    """
    (q_lo, q_hi), (kv_lo, kv_hi) = q_range, kv_range
    some, every = [], []
    if config.causal:
        some.append(kv_lo <= q_hi)
        every.append(kv_hi <= q_lo)
    if config.window is not None:
        left, right = config.window
        if left is not None:
            some.append(q_lo - kv_hi <= left)
            every.append(q_hi - kv_lo <= left)
        if right is not None:
            some.append(kv_lo - q_hi <= right)
            every.append(kv_hi - q_lo <= right)
    if q_seg_range is not None:
        (qs_lo, qs_hi), (ks_lo, ks_hi) = q_seg_range, kv_seg_range
        some.append((qs_lo <= ks_hi) & (ks_lo <= qs_hi))  # the id ranges overlap
        every.append((qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo))  # one shared id
    return _all(some, q_lo, kv_lo), _all(every, q_lo, kv_lo)


def _all(conditions, *likes):
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (*likes, *conditions)))
    return functools.reduce(operator.and_, conditions, jnp.ones(shape, jnp.bool_))
