"""How evenly a ring layout spreads the attention work over the devices.

A ring runs in lock step: every step waits for its slowest device, so the
time goes with the largest per-device work, not the mean. Under a causal
mask, query position p sees p + 1 keys, so with the contiguous layout the
last device holds the most expensive queries: device r does
`(r + 1/2) L^2` of pair work (L = local length), max / mean -> 2N / (N + 1)
(1.875 at N = 8). Zigzag pairs an early chunk with a late one and is exactly
balanced; striped is balanced up to O(1 / L) (Brandon et al. 2023).

`ring_balance` counts, per device, the (query, key) pairs its blocks must
compute (visible under the masks: `shardfuse.flops.visible_key_counts`, the one
host-side count) and the ring steps it cannot skip.
"""

import dataclasses

import numpy as np

from shardfuse import flops
from shardfuse.collectives.ring_attention import layouts
from shardfuse.kernels.attention import base, masks


@dataclasses.dataclass(frozen=True)
class RingBalance:
    """Per-device work of one ring configuration.

    Attributes:
      layout: the layout measured.
      ring_size: N.
      pairs: int64 `[N]`, visible (query, key) pairs each device computes over all steps.
      steps: int64 `[N]`, ring steps each device computes (not skipped by the ring's
        position-range test).
    """

    layout: str
    ring_size: int
    pairs: np.ndarray
    steps: np.ndarray

    @property
    def max_over_mean(self) -> float:
        """Largest device's pair work over the mean (1.0 = perfectly balanced)."""
        mean = float(np.mean(self.pairs))
        return float(np.max(self.pairs)) / mean if mean else 1.0


def _step_computed(config, q_pos, kv_pos) -> bool:
    """The ring's skip test (`ring.step_visible`, masks.block_visibility) on position ranges."""
    q_range, kv_range = (q_pos.min(), q_pos.max()), (kv_pos.min(), kv_pos.max())
    some, _ = masks.block_visibility(config, q_range, kv_range)
    return bool(some)


def ring_balance(
    seq_len: int, ring_size: int, layout: str, *, causal: bool = True, window=None
) -> RingBalance:
    """Each device's attention work for self-attention over a ring in `layout`.

    Args:
      seq_len: global sequence length (a multiple of `ring_size`, `2 * ring_size` for zigzag).
      ring_size: N, devices in the ring.
      layout: "contiguous", "zigzag" or "striped".
      causal: count only keys at or before the query (default True).
      window: optional `(left, right)` window, as in `sf.flash_attention`.

    Returns:
      A `RingBalance` with per-device pair counts and computed steps.

    Raises:
      ValueError: unknown layout, bad window, or `seq_len` not divisible.

    Example:
      >>> from shardfuse.collectives.ring_attention import ring_balance
      >>> round(ring_balance(4096, 8, "contiguous").max_over_mean, 3)
      1.875
      >>> ring_balance(4096, 8, "zigzag").max_over_mean
      1.0
    """
    positions = np.asarray(layouts.ring_positions(seq_len, ring_size, layout), np.int64)
    window = base.check_window(window)  # same rules as attention's window argument
    config = base.AttentionConfig(causal=bool(causal), window=window, logit_softcap=None, scale=1)
    pairs = np.zeros(ring_size, np.int64)
    steps = np.zeros(ring_size, np.int64)
    if positions.size == 0:
        return RingBalance(layout, ring_size, pairs, steps)
    for r in range(ring_size):
        q_pos = positions[r]
        for s in range(ring_size):
            kv = positions[(r - s) % ring_size]
            counts = flops.visible_key_counts(q_pos, kv, causal=config.causal, window=config.window)
            pairs[r] += int(counts.sum())
            steps[r] += _step_computed(config, q_pos, kv)
    return RingBalance(layout, ring_size, pairs, steps)
