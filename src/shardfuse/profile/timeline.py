"""A step's time on one device, split into categories that sum to the step.

Every instant of a step window on a device gets exactly one label, so the
labels sum to the window (the step time) by construction:

1. matmul, attention or other, when a compute op runs (in that priority:
   an instant with a matmul and an elementwise op running is matmul time);
2. else a collective kind, when only communication runs: **exposed**
   communication (in `COLLECTIVES` order when several kinds run at once);
3. else "other" when only a control op (`while`, `conditional`) is open: its
   bookkeeping between the ops it runs;
4. else idle: the device runs nothing (waiting for the host, another device
   or the next launch).

Communication that runs while compute runs is **overlapped**: reported per
kind beside the table, not in the sum. A kind's total time is its exposed
plus overlapped time.
"""

import numpy as np

from shardfuse.profile.hlo import COLLECTIVES, COMPUTE, CONTROL

LABELS = COMPUTE + COLLECTIVES + ("idle",)


def split_window(intervals, start: float, end: float) -> tuple[dict, dict]:
    """`(exposed labels, overlapped collectives)`, seconds, of one device's step window.

    Args:
      intervals: `(start, end, category)` of the device's ops (any order; clipped
        to the window).
      start, end: the step window.

    Returns:
      `labels`: seconds per `LABELS` entry, summing to `end - start`;
      `overlapped`: seconds per collective kind that ran under compute.

    Example:
      >>> from shardfuse.profile.timeline import split_window
      >>> labels, hidden = split_window(
      ...     [(0.0, 2.0, "matmul"), (1.0, 3.0, "all-reduce")], 0.0, 4.0)
      >>> labels["matmul"], labels["all-reduce"], labels["idle"], hidden["all-reduce"]
      (2.0, 1.0, 1.0, 1.0)
    """
    labels = dict.fromkeys(LABELS, 0.0)
    overlapped = dict.fromkeys(COLLECTIVES, 0.0)
    clipped = [(max(s, start), min(e, end), c) for s, e, c in intervals if e > start and s < end]
    if end <= start:
        return labels, overlapped
    times = np.unique(np.array([start, end] + [t for s, e, _ in clipped for t in (s, e)]))
    widths = np.diff(times)
    kinds = COMPUTE + COLLECTIVES + (CONTROL,)
    active = {k: np.zeros(len(times), np.int64) for k in kinds}
    for s, e, c in clipped:
        if e > s:
            counts = active[c if c in active else "other"]
            counts[np.searchsorted(times, s)] += 1
            counts[np.searchsorted(times, e)] -= 1
    running = {k: np.cumsum(v)[:-1] > 0 for k, v in active.items()}  # per segment
    free = np.ones(len(widths), bool)
    compute_running = np.zeros(len(widths), bool)
    for kind in COMPUTE:
        mine = free & running[kind]
        labels[kind] += float(widths[mine].sum())
        free &= ~mine
        compute_running |= running[kind]
    for kind in COLLECTIVES:
        mine = free & running[kind]
        labels[kind] += float(widths[mine].sum())
        free &= ~mine
        overlapped[kind] = float(widths[compute_running & running[kind]].sum())
    control = free & running[CONTROL]
    labels["other"] += float(widths[control].sum())
    labels["idle"] = float(widths[free & ~control].sum())
    return labels, overlapped
