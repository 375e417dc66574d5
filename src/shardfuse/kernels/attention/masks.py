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


def _block_stats(values, block):
    """Per-block `(min, max)` over real entries of `values [..., L]`, and whether it is whole."""
    length = values.shape[-1]
    n = -(-length // block)
    pad = [(0, 0)] * (values.ndim - 1) + [(0, n * block - length)]
    values = jnp.pad(values, pad).reshape(*values.shape[:-1], n, block)
    real = (jnp.arange(n * block) < length).reshape(n, block)
    return value_range(values, real), jnp.all(real, axis=-1)


def block_table(config, q_pos, kv_pos, q_seg, kv_seg, block_q, block_kv):
    """bool `[B | 1, nq, nk]`: may any query see any key (visible); do all see all (full).

    `block_visibility` on blocks of `block_q` queries and `block_kv` keys (the
    last ones padded; a block with padding is never full). Position ranges are
    `[1, nq, 1]` against `[1, 1, nk]`, segment-id ranges `[B, nq, 1]` against
    `[B, 1, nk]`, so the leading axis is B only with segment ids.

    Example:
      >>> from shardfuse.kernels.attention.base import AttentionConfig
      >>> config = AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0)
      >>> pos = jnp.arange(8)
      >>> visible, full = block_table(config, pos, pos, None, None, 4, 4)
      >>> visible[0].astype(int).tolist(), full[0].astype(int).tolist()
      ([[1, 0], [1, 1]], [[0, 0], [1, 0]])
    """
    q_range, q_whole = _block_stats(q_pos, block_q)
    kv_range, kv_whole = _block_stats(kv_pos, block_kv)
    q_range = [x[None, :, None] for x in q_range]
    kv_range = [x[None, None] for x in kv_range]
    seg_ranges = ()
    if q_seg is not None:
        qs, _ = _block_stats(q_seg, block_q)  # [B, nq]
        ks, _ = _block_stats(kv_seg, block_kv)  # [B, nk]
        seg_ranges = ([x[:, :, None] for x in qs], [x[:, None] for x in ks])
    visible, full = block_visibility(config, q_range, kv_range, *seg_ranges)
    return visible, full & (q_whole[:, None] & kv_whole[None, :])[None]


def visit_ranges(visible, full, batch):
    """int32 `[B, n_outer, 4]`: `(lo, full_lo, full_hi, hi)` over the inner blocks of each row.

    `[lo, hi)` spans every visible inner block; `[full_lo, full_hi)` is the
    first run of fully visible ones (empty, at lo, if there is none). A kernel
    walking a row visits `[lo, hi)` and evaluates the mask outside the full run.
    Pass `block_table`'s arrays (transposed for key-major kernels).

    Example:
      >>> visible = jnp.array([[[True, True, True, False]]])
      >>> full = jnp.array([[[False, True, False, False]]])
      >>> visit_ranges(visible, full, 1).tolist()
      [[[0, 1, 2, 3]]]
    """
    visible = jnp.broadcast_to(visible, (batch, *visible.shape[1:]))
    full = jnp.broadcast_to(full, visible.shape) & visible
    n = visible.shape[-1]
    index = jnp.arange(n)
    any_visible = jnp.any(visible, axis=-1)
    lo = jnp.where(any_visible, jnp.argmax(visible, axis=-1), 0)
    hi = jnp.where(any_visible, n - jnp.argmax(visible[..., ::-1], axis=-1), 0)
    any_full = jnp.any(full, axis=-1)
    full_lo = jnp.where(any_full, jnp.argmax(full, axis=-1), lo)
    run = full | (index < full_lo[..., None])
    full_hi = jnp.where(any_full, jnp.sum(jnp.cumprod(run.astype(jnp.int32), axis=-1), -1), lo)
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def visibility_flags(config, q_pos, kv_pos, q_seg=None, kv_seg=None):
    """`(sees [B | 1, T], seen [B | 1, S])`: does each query see some key, is each key seen.

    Exact (the elementwise rule, reduced), for kernels that must keep NaN in
    rows or keys nobody uses away from their matmuls. Without masks every pair
    is visible and no work is done.

    Example:
      >>> from shardfuse.kernels.attention.base import AttentionConfig
      >>> config = AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0)
      >>> sees, seen = visibility_flags(config, jnp.arange(2), jnp.arange(3))
      >>> sees.tolist(), seen.tolist()
      ([[True, True]], [[True, True, False]])
    """
    T, S = q_pos.shape[-1], kv_pos.shape[-1]
    if not config.causal and config.window is None and q_seg is None:
        return jnp.ones((1, T), jnp.bool_), jnp.ones((1, S), jnp.bool_)
    mask = visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg)  # [T, S] or [B, T, S]
    mask = mask.reshape(-1, T, S)
    return jnp.any(mask, axis=2), jnp.any(mask, axis=1)
