"""One home per concept: the visible (query, key) pairs and the ring cost.

Each concept is computed by one function at the bottom of the package and
read by every caller. The tests check the one function against an
independent oracle (the kernels' mask on a `[T, S]` matrix, a formula worked
by hand) and pin numbers the callers printed before their copies were merged,
so that a later change to the one home that moves them fails here.
"""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse import flops
from shardfuse.collectives.ring_attention import ring_balance, ring_positions
from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.base import AttentionConfig

WINDOWS = (None, (3, 0), (0, 2), (None, 5), (10, None), (2, 2))

# ---- visible pairs ------------------------------------------------------------


@pytest.mark.parametrize("causal, window", list(itertools.product((False, True), WINDOWS)))
def test_visible_key_counts_equal_the_kernels_mask(causal, window):
    """Host-side counts == the sum over keys of `masks.visibility_mask` (the kernels' rule),
    on unsorted, gapped positions like a ring layout's."""
    rng = np.random.default_rng(0)
    q_pos = rng.permutation(40)[:17]
    kv_pos = rng.permutation(50)[:23] - 5
    config = AttentionConfig(causal=causal, window=window, logit_softcap=None, scale=1.0)
    mask = masks.visibility_mask(config, jnp.asarray(q_pos), jnp.asarray(kv_pos))
    expected = np.asarray(mask).sum(axis=1)
    counts = flops.visible_key_counts(q_pos, kv_pos, causal=causal, window=window)
    np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize("s", [1, 2, 8, 100, 4096, 131072])
@pytest.mark.parametrize("window", [None, 0, 1, 3, 64, 4096, 200000])
def test_mean_visible_keys_equals_its_closed_form(s, window):
    """The planner's mean keys per query, now the causal pair count / s, is bitwise the
    closed form it used to compute: `(s + 1) / 2`, or `sum_i min(i + 1, W) / s`."""
    if window is None or window >= s:
        closed = (s + 1) / 2
    else:
        closed = (window * (window + 1) / 2 + (s - window) * window) / s
    assert flops.mean_visible_keys(s, window, True) == closed
    assert flops.mean_visible_keys(s, window, False) == s


@pytest.mark.parametrize(
    "layout, n, causal, window, pairs",
    [
        ("contiguous", 4, True, None, [136, 392, 648, 904]),
        ("zigzag", 4, True, (5, 0), [81, 96, 96, 96]),
        ("striped", 8, False, (3, 2), [93, 94, 95, 96, 96, 96, 95, 94]),
    ],
)
def test_ring_balance_reads_the_one_count(layout, n, causal, window, pairs):
    """`ring_balance`'s pair work: the numbers it gave with its own copy of the count, and
    the kernels' mask summed per device."""
    report = ring_balance(16 * n, n, layout, causal=causal, window=window)
    np.testing.assert_array_equal(report.pairs, pairs)
    positions = np.arange(16 * n)
    config = AttentionConfig(causal=causal, window=window, logit_softcap=None, scale=1.0)
    shards = np.asarray(ring_positions(16 * n, n, layout))
    mask = np.asarray(masks.visibility_mask(config, jnp.asarray(shards), jnp.asarray(positions)))
    np.testing.assert_array_equal(report.pairs, mask.sum(axis=(1, 2)))
