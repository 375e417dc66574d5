"""The lockstep table: a pipeline schedule as the SPMD executor runs it, and its work.

`schedule.py` defines the schedules as data (`schedule_table`: one action per
stage and tick, as drawn and simulated); this module lays a schedule out for
lockstep execution (`lockstep_table`: every tick one F slot and one B slot on
every stage, what `executor.py` runs) and prices it (`lockstep_work`: the sum
over ticks of the busiest stage's work, what the planner charges a lockstep
pipeline, `planner.pipeline_time`).
"""

import dataclasses
import functools

import numpy as np

from shardfuse.parallel.pipeline.schedule import HEAD, B, F, W, check_schedule


@dataclasses.dataclass(frozen=True)
class LockstepTable:
    """A schedule laid out for lockstep SPMD execution: per tick, one F slot and one B slot.

    The executor (`shardfuse.parallel.pipeline.executor`) runs every tick
    with the same code on every stage (so that collectives inside a stage,
    tensor or sequence parallel, are legal): a tick runs the F slot, then
    the head where the last virtual stage's F is in it, then the B slot, each
    only in the ticks where some stage uses it; a stage with nothing in a
    slot computes on a masked dummy. In the steady state every stage runs one
    forward and one backward of real microbatches per tick; only the fill and
    drain are masked. Microbatch `i` (group `g, j = divmod(i, p)`) runs at
    virtual stage `k = c p + s` (chunk `c` of stage `s`):

    - F at tick `k + g v p + j` (one tick per virtual stage: the activation
      sent in tick t is used in tick t + 1);
    - B at tick `(v p - 1) + (p - 1 - s) + g v p + (v - 1 - c) p + j`: on the
      last virtual stage in the same tick as its F and head, then one virtual
      stage back per tick (1F1B and interleaved; zb-h1 runs as 1F1B, its W
      fused into B: see `lockstep_work`); GPipe: all forwards, then B at
      `(m + p - 1) + i + (p - 1 - s)`.

    The F slot is busy from tick 0 to `v m + p - 2`, the B slot `v m + p - 1`
    ticks too, so the lockstep work is `(v m + p - 1) (f + b)` per chunk
    (`f`, `b`: one chunk's forward and backward) plus `m` heads: the bubble
    `(p - 1) / (v m)` of GPipe / 1F1B (v = 1) and interleaved. In flight:
    stage `s` holds a microbatch from its F to its B, `2 (p - 1 - s) + 1`
    ticks for v = 1 (1F1B's `p - s` doubled: a tick holds an F and a B).

    Attributes:
      schedule, num_stages (p), num_microbatches (m), virtual_stages (v),
        forward_only: what was asked for.
      forward, backward: int arrays `[ticks, p, 2]`, the `(microbatch, chunk)`
        of each stage's F and B in each tick, `-1` when the slot is empty
        (`backward` all `-1` when forward-only).
      buffer_slots: ring-buffer slots per chunk (microbatch `i` in slot
        `i % buffer_slots`): the most microbatches whose received input or
        output gradient a stage holds at once.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    forward_only: bool
    forward: np.ndarray
    backward: np.ndarray
    buffer_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.forward.shape[0])

    def active(self) -> np.ndarray:
        """Bool `[ticks, 3]`: whether any stage runs an F, the head, a B in each tick."""
        p, v = self.num_stages, self.virtual_stages
        has_f = self.forward[..., 0] >= 0
        head = has_f[:, p - 1] & (self.forward[:, p - 1, 1] == v - 1) & (not self.forward_only)
        return np.stack([has_f.any(1), head, (self.backward[..., 0] >= 0).any(1)], axis=1)

    def in_flight(self) -> np.ndarray:
        """Peak microbatch-chunks per stage held from their F to their B (F only: 1)."""
        if self.forward_only:
            return np.ones(self.num_stages, np.int64)
        started = np.cumsum(self.forward[..., 0] >= 0, axis=0)
        ended = np.cumsum(self.backward[..., 0] >= 0, axis=0)
        live = started - np.concatenate([np.zeros_like(ended[:1]), ended[:-1]])
        return live.max(axis=0).astype(np.int64)

    def grid(self) -> str:
        """One row per stage, one column per tick: `F3/B0` (F of 3 and B of 0), `F3/.`, `./B0`."""

        def cell(t, s):
            parts = []
            for name, slot in (("F", self.forward), ("B", self.backward)):
                i, c = (int(a) for a in slot[t, s])
                text = "." if i < 0 else f"{name}{i}"
                parts.append(text + (f".{c}" if i >= 0 and self.virtual_stages > 1 else ""))
            return parts[0] if self.forward_only else "/".join(parts)

        cells = [[cell(t, s) for t in range(self.num_ticks)] for s in range(self.num_stages)]
        width = max(len(c) for row in cells for c in row)
        header = "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))
        rows = [
            f"stage {s} " + " ".join(f"{c:>{width}}" for c in row) for s, row in enumerate(cells)
        ]
        return "\n".join([header, *rows])

    def work(self, cost: dict) -> float:
        """Lockstep work: the sum over ticks of the largest stage's work in the tick.

        `cost` maps `F`, `B` (and optionally `W`, `HEAD`) to one action's cost:
        one microbatch through one chunk (`HEAD`: the head's forward and
        backward for one microbatch, on the last virtual stage's F tick). A B
        slot costs `cost[B] + cost[W]` (the weight gradient runs with the
        input gradient). Because every stage runs the same code, this is also
        what each device executes: the sum over ticks of the slots in use.
        """
        return _work(self.forward, self.backward, self.num_stages, self.virtual_stages, cost)

    def ideal(self, cost: dict) -> float:
        """The busiest stage's work without a bubble: `m v (f + b) + m head`."""
        f, b, h = _costs(cost)
        m, v = self.num_microbatches, self.virtual_stages
        return float(
            m * v * (f + (0.0 if self.forward_only else b)) + m * h * (not self.forward_only)
        )


def _work(forward, backward, p, v, cost):
    """Sum over ticks of the largest stage's work; `forward`, `backward` `[ticks, p, 2]`."""
    f, b, h = _costs(cost)
    has_f = forward[..., 0] >= 0
    has_b = backward[..., 0] >= 0
    head = np.zeros_like(has_f)
    head[:, p - 1] = has_f[:, p - 1] & (forward[:, p - 1, 1] == v - 1) & has_b.any()
    per_stage = f * has_f + h * head + b * has_b
    return float(per_stage.max(axis=1).sum())


def _costs(cost):
    for key in (F, B):
        if key not in cost:
            raise ValueError(f"cost={cost!r} must give the cost of F ({F}) and B ({B})")
    return float(cost[F]), float(cost[B]) + float(cost.get(W, 0.0)), float(cost.get(HEAD, 0.0))


def _lockstep_ticks(schedule, p, m, v, forward_only):
    """`(tick_f, tick_b)`: `[m, v p]` ticks of each microbatch's F and B per virtual stage."""
    i = np.arange(m)[:, None]
    k = np.arange(v * p)[None, :]
    c, s = np.divmod(k, p)
    g, j = np.divmod(i, p)
    tick_f = k + g * v * p + j
    if forward_only:
        return tick_f, None
    if schedule == "gpipe":
        tick_b = (m + p - 1) + i + (p - 1 - s)
    else:
        tick_b = (v * p - 1) + (p - 1 - s) + g * v * p + (v - 1 - c) * p + j
    return tick_f, np.broadcast_to(tick_b, tick_f.shape)


def _slot_arrays(tick_f, tick_b, p):
    """`[ticks, p, 2]` `(microbatch, chunk)` of each stage's F and B per tick (-1: empty)."""
    m, vp = tick_f.shape
    ticks = int((tick_f if tick_b is None else tick_b).max()) + 1
    forward = np.full((ticks, p, 2), -1, np.int32)
    backward = np.full((ticks, p, 2), -1, np.int32)
    i, k = np.meshgrid(np.arange(m), np.arange(vp), indexing="ij")
    c, s = np.divmod(k, p)
    forward[tick_f, s] = np.stack([i, c], -1)
    if tick_b is not None:
        backward[tick_b, s] = np.stack([i, c], -1)
    return forward, backward


def _lockstep_slots(tick_f, tick_b, p):
    """Most microbatches one stage holds at once per chunk (stage inputs and output gradients)."""
    m, vp = tick_f.shape
    spans = []
    for k in range(vp):
        arrive = tick_f[:, k - 1] + 1 if k > 0 else tick_f[:, 0]
        end = tick_f[:, k] if tick_b is None else tick_b[:, k]
        spans.append((arrive, end))
        if tick_b is not None:
            grad = tick_b[:, k + 1] + 1 if k < vp - 1 else tick_f[:, k]
            spans.append((grad, end))
    best = 1
    for start, end in spans:  # both increase with the microbatch: count the spans still open
        open_before = np.arange(m) - np.searchsorted(end, start, side="left")
        best = max(best, int(open_before.max()) + 1)
    return best


@functools.lru_cache(maxsize=256)
def lockstep_table(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    *,
    forward_only: bool = False,
) -> LockstepTable:
    """The `LockstepTable` the executor runs for `schedule` (see `LockstepTable`).

    Args:
      schedule: "gpipe", "1f1b", "interleaved" or "zb-h1".
      num_stages: p.
      num_microbatches: m.
      virtual_stages: v ("interleaved" only).
      forward_only: forwards only (evaluation).

    Raises:
      ValueError: as `schedule_table`.

    Example usage::

      >>> from shardfuse.parallel.pipeline.lockstep import lockstep_table
      >>> print(lockstep_table("1f1b", 2, 3).grid())
      tick        0     1     2     3     4
      stage 0  F0/.  F1/. F2/B0  ./B1  ./B2
      stage 1   ./. F0/B0 F1/B1 F2/B2   ./.
    """
    check_schedule(schedule, num_stages, num_microbatches, virtual_stages)
    p, m, v = int(num_stages), int(num_microbatches), int(virtual_stages)
    tick_f, tick_b = _lockstep_ticks(schedule, p, m, v, forward_only)
    forward, backward = _slot_arrays(tick_f, tick_b, p)
    for array in (forward, backward):
        array.setflags(write=False)
    return LockstepTable(
        schedule=schedule,
        num_stages=p,
        num_microbatches=m,
        virtual_stages=v,
        forward_only=bool(forward_only),
        forward=forward,
        backward=backward,
        buffer_slots=_lockstep_slots(tick_f, tick_b, p),
    )


def lockstep_work(
    schedule: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1, *, cost
) -> float:
    """Work of one training step as the executor runs it: `lockstep_table(...).work(cost)`.

    The planner's pipeline time (`shardfuse.planner.pipeline_time`) and the
    tests that count the compiled program's FLOPs both call this.

    Args:
      schedule, num_stages, num_microbatches, virtual_stages: as `lockstep_table`.
      cost: `{F: ..., B: ..., W: ..., HEAD: ...}`, one action's cost (one
        microbatch through one chunk; the head per microbatch); W and HEAD
        default to 0.

    Example usage::

      >>> from shardfuse.parallel.pipeline.lockstep import lockstep_work
      >>> from shardfuse.parallel.pipeline.schedule import B, F
      >>> lockstep_work("1f1b", 4, 8, cost={F: 1.0, B: 2.0})  # (m + p - 1) (F + B)
      33.0
    """
    check_schedule(schedule, num_stages, num_microbatches, virtual_stages)
    f, b, h = _costs(cost)
    mix = _tick_mix(schedule, int(num_stages), int(num_microbatches), int(virtual_stages))
    return float(sum(n * max(f * kf + h * kh + b * kb for kf, kh, kb in kinds) for kinds, n in mix))


@functools.lru_cache(maxsize=4096)
def _tick_mix(schedule, p, m, v):
    """`((kinds, ticks), ...)`: how many ticks hold each set of per-stage (F, head, B) uses."""
    forward, backward = _slot_arrays(*_lockstep_ticks(schedule, p, m, v, False), p)
    has_f = forward[..., 0] >= 0
    head = np.zeros_like(has_f)
    head[:, p - 1] = has_f[:, p - 1] & (forward[:, p - 1, 1] == v - 1)
    codes = has_f * 4 + head * 2 + (backward[..., 0] >= 0)
    counts = {}
    rows, n = np.unique(codes, axis=0, return_counts=True)
    for row, count in zip(rows, n, strict=True):
        kinds = frozenset((int(c) >> 2 & 1, int(c) >> 1 & 1, int(c) & 1) for c in row)
        counts[kinds] = counts.get(kinds, 0) + int(count)
    return tuple(counts.items())
