"""Pipeline schedules as data: one table of actions per (tick, stage), simulated.

A schedule is, per pipeline stage, an ordered list of actions (the style of
`torch.distributed.pipelining`): `F` (forward of one microbatch through one
model chunk), `B` (its backward; with `split_backward` only the input
gradient) and `W` (the deferred weight gradient, zero-bubble schedules only).
`schedule_table` simulates those lists on a clock where every action takes one
tick and a result sent to the neighbouring stage arrives one tick later; each
stage runs its next action as soon as its inputs are there and idles otherwise.
The resulting `ScheduleTable` is what `shardfuse pipeline` prints and draws;
`lockstep.py` lays the same schedule out as the executor
(`shardfuse.parallel.pipeline.executor`) runs it, tick by tick, inside one
`lax.scan` (`lockstep_table`, checked against this table's dependencies and
work by the tests).

Schedules (`p` stages, `m` microbatches, `v` model chunks per stage):

- "gpipe" (Huang et al. 2019): all forwards, then all backwards; bubble
  `(p-1)/(m+p-1)`; every stage holds all `m` microbatches' inputs.
- "1f1b" (PipeDream-Flush, Narayanan et al. 2021): `p-1-s` warm-up forwards
  on stage `s`, then one forward one backward, then the cool-down; same
  bubble as GPipe, at most `p` microbatches in flight per stage.
- "interleaved" (Megatron-LM interleaved 1F1B, Narayanan et al. 2021): stage
  `s` holds chunks `s, s+p, ..., s+(v-1)p` of the `v*p` virtual stages;
  bubble `(p-1)/(v*m+p-1)`; needs `m % p == 0`.
- "zb-h1" (zero bubble, Qi et al. 2023): 1F1B with each backward split into
  the input gradient `B` (on the critical path) and the weight gradient `W`,
  deferred to fill the cool-down bubble: bubble `(p-1)/(3m+p-1)` with F, B
  and W one tick each; at most `p` microbatches in flight per stage, 1F1B's
  peak (stage 0's).
"""

import dataclasses
import functools

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
IDLE, F, B, W = 0, 1, 2, 3
HEAD = 4  # the head (unembedding, loss and their backward): a cost key of `lockstep_work`
ACTION_NAMES = {IDLE: ".", F: "F", B: "B", W: "W"}


@dataclasses.dataclass(frozen=True)
class ScheduleTable:
    """Actions per (tick, stage) of one schedule, and the figures read from them.

    Attributes:
      schedule, num_stages (p), num_microbatches (m), virtual_stages (v),
        forward_only: what was asked for.
      split_backward: True when `B` is the input gradient only and `W` the
        weight gradient (zero-bubble schedules).
      kind, microbatch, chunk: int arrays `[ticks, p]`: the action
        (`IDLE`, `F`, `B`, `W`), its microbatch and its model chunk (-1 when
        idle). Chunk `c` of stage `s` is virtual stage `c * p + s`.
      buffer_slots: ring-buffer slots per chunk the executor needs (the most
        microbatches whose stage input or output gradient are held at once
        on any stage); microbatch `i` uses slot `i % buffer_slots`.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    virtual_stages: int
    forward_only: bool
    split_backward: bool
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    buffer_slots: int

    @property
    def num_ticks(self) -> int:
        return int(self.kind.shape[0])

    @property
    def bubble(self) -> float:
        """Idle fraction of the stage-ticks: `idle / (ticks * p)`."""
        return float(np.mean(self.kind == IDLE))

    def in_flight(self) -> np.ndarray:
        """Peak number of microbatches per stage whose stage input is held (F done, last use not).

        A forward at the last virtual stage with no backward to follow
        (forward-only) releases its microbatch in the same tick.
        """
        peak = np.zeros(self.num_stages, np.int64)
        last = W if self.split_backward else B
        for s in range(self.num_stages):
            live, best = set(), 0
            for t in range(self.num_ticks):
                k, i, c = self.kind[t, s], self.microbatch[t, s], self.chunk[t, s]
                if k == F:
                    live.add((i, c))
                best = max(best, len(live))
                if (k == last) or (k == F and self.forward_only):
                    live.discard((i, c))
            peak[s] = best
        return peak

    def grid(self) -> str:
        """The table as text: one row per stage, one column per tick (`F3`, `B0.1`, `.`)."""
        cells = [[self.label(t, s) for t in range(self.num_ticks)] for s in range(self.num_stages)]
        width = max(len(c) for row in cells for c in row)
        header = "tick    " + " ".join(f"{t:>{width}}" for t in range(self.num_ticks))
        rows = [
            f"stage {s} " + " ".join(f"{c:>{width}}" for c in row) for s, row in enumerate(cells)
        ]
        return "\n".join([header, *rows])

    def label(self, tick: int, stage: int) -> str:
        """`F3` (forward of microbatch 3), `B3.1` (chunk 1 when v > 1), `.` when idle."""
        k = int(self.kind[tick, stage])
        if k == IDLE:
            return "."
        text = f"{ACTION_NAMES[k]}{int(self.microbatch[tick, stage])}"
        return text + (f".{int(self.chunk[tick, stage])}" if self.virtual_stages > 1 else "")

    def to_dict(self) -> dict:
        """JSON-ready table and figures (`shardfuse pipeline --json`)."""
        return dict(
            schedule=self.schedule,
            p=self.num_stages,
            m=self.num_microbatches,
            v=self.virtual_stages,
            forward_only=self.forward_only,
            ticks=self.num_ticks,
            bubble=self.bubble,
            closed_form_bubble=closed_form_bubble(
                self.schedule, self.num_stages, self.num_microbatches, self.virtual_stages
            ),
            peak_in_flight=[int(n) for n in self.in_flight()],
            buffer_slots=self.buffer_slots,
            actions=[
                [self.label(t, s) for t in range(self.num_ticks)] for s in range(self.num_stages)
            ],
        )


def closed_form_bubble(schedule: str, p: int, m: int, v: int = 1):
    """Bubble fraction in this tick model: `(p-1)/(m+p-1)` (GPipe, 1F1B), `(p-1)/(v*m+p-1)`
    (interleaved), `(p-1)/(3m+p-1)` (zb-h1 with F, B and W one tick each, the
    paper's ZB-H1; 1F1B in the same units, B and W together two ticks, has
    `3(p-1)/(3m+3(p-1))`, a third of its ticks' idle time is what zb-h1 keeps)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * m + p - 1)


def closed_form_in_flight(schedule: str, p: int, m: int, v: int = 1) -> int:
    """Peak microbatch-chunks whose forward is done and backward not, on stage 0 (the most
    loaded): GPipe `m`, 1F1B and zb-h1 `min(m, p)`, interleaved `min(v m, 2 (p - 1) +
    (v - 1) p + 1)` (its warm-up and one more); `ScheduleTable.in_flight`'s peak without
    the simulation. Korthikanti et al. 2022 (sec. 4.2.3): interleaving keeps
    `1 + (p - 1) / (p v)` times 1F1B's activations.

    >>> closed_form_in_flight("1f1b", 4, 8), closed_form_in_flight("interleaved", 4, 8, 2)
    (4, 11)
    """
    if schedule == "gpipe":
        return m
    if schedule == "interleaved":
        return min(v * m, 2 * (p - 1) + (v - 1) * p + 1)
    return min(m, p)


class CountTypeError(TypeError, ValueError):
    """A count (`num_microbatches`, ...) that is not an int: a TypeError, and a ValueError
    as every count check raised for it before there was one check."""


def check_count(name: str, value) -> int:
    """`value` as an int; an error naming `name` unless it is an int >= 1.

    The one check of the run's counts: `num_microbatches` (of `sf.parallel.RunOptions`,
    `Pipeline` and `accumulate`), `virtual_stages`, the number of stages.

    Raises:
      CountTypeError: not an int (a bool neither); it is a TypeError and a ValueError.
      ValueError: an int < 1.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise CountTypeError(f"{name}={value!r} must be a positive integer (an int >= 1)")
    if value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (an int >= 1)")
    return int(value)


def check_schedule(schedule, num_stages, num_microbatches, virtual_stages=1):
    """ValueError naming the argument unless (schedule, p, m, v) is a valid combination."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {SCHEDULES}")
    p = check_count("num_stages", num_stages)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("virtual_stages", virtual_stages)
    if v != 1 and schedule != "interleaved":
        raise ValueError(
            f"virtual_stages={v} needs schedule='interleaved' (schedule={schedule!r} takes 1)"
        )
    if schedule == "interleaved" and v < 2 and p > 1:
        raise ValueError(
            f"virtual_stages={v}: schedule='interleaved' needs virtual_stages >= 2 "
            "(with 1 it is '1f1b')"
        )
    if schedule != "gpipe" and m < p:
        raise ValueError(
            f"num_microbatches={m} must be >= the number of pipeline stages p={p} for "
            f"schedule={schedule!r} (or use 'gpipe')"
        )
    if schedule == "interleaved" and m % p != 0:
        raise ValueError(
            f"num_microbatches={m} must be a multiple of the number of pipeline stages p={p} "
            f"for schedule='interleaved'; valid: {[p * k for k in range(1, 5)]}, ..."
        )


def _stage_orders(schedule, p, m, v, forward_only):
    """Per stage, the ordered list of (kind, microbatch, chunk)."""
    group = p * v  # interleaved: microbatches go through the chunks in groups of p

    def interleaved(kind, k):
        chunk = (k % group) // p
        return (kind, (k // group) * p + k % p, v - 1 - chunk if kind == B else chunk)

    orders = []
    for s in range(p):
        if schedule == "interleaved":
            total = v * m
            warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
            fwd = functools.partial(interleaved, F)
            bwd = functools.partial(interleaved, B)
        else:
            total = m
            warmup = min(p - s - 1, m) if schedule in ("1f1b", "zb-h1") else m
            fwd = functools.partial(lambda kind, k: (kind, k, 0), F)
            bwd = functools.partial(lambda kind, k: (kind, k, 0), B)
        if forward_only:
            warmup = total
        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [fwd(warmup + k), bwd(k)]
        order += [bwd(k) for k in range(total - warmup, total)]
        if forward_only:
            order = [a for a in order if a[0] == F]
        orders.append(order)
    return orders


def _simulate_in_order(orders, p, v, deps):
    """Runs each stage's list in order, an action as soon as `deps` says it may."""
    done = {}  # (kind, mb, chunk, stage) -> tick
    position = [0] * p
    rows = []
    while any(position[s] < len(orders[s]) for s in range(p)):
        t = len(rows)
        row = []
        for s in range(p):
            action = orders[s][position[s]] if position[s] < len(orders[s]) else None
            if action is not None and deps(action, s, t, done):
                row.append(action)
            else:
                row.append((IDLE, -1, -1))
        for s, action in enumerate(row):
            if action[0] != IDLE:
                done[(*action, s)] = t
                position[s] += 1
        rows.append(row)
        if t > 10 * sum(len(o) for o in orders) + 10:  # pragma: no cover - a schedule bug
            raise RuntimeError("pipeline schedule simulation does not progress")
    return rows


def _zero_bubble_rows(p, m, deps):
    """ZB-H1 by list scheduling, per stage `s` and tick, the first of:

    - F, while stage `s` holds fewer than `p - s` microbatches awaiting their B
      and fewer than `p` awaiting their W (the memory bound of 1F1B's stage 0);
    - B, the input gradient (on the critical path back to stage 0);
    - W, the oldest deferred weight gradient (fills what 1F1B leaves idle).

    With F, B and W one tick each this reaches the paper's ZB-H1 bubble,
    `p - 1` idle ticks per stage in `3m + p - 1` (Qi et al. 2023, section 3:
    `(p-1)(T_F + T_B - T_W)`), for every `m >= p` (checked for p <= 8, m <= 5p).
    """
    done = {}
    next_f, next_b, next_w = [0] * p, [0] * p, [0] * p
    rows = []
    while any(next_w[s] < m for s in range(p)):
        t = len(rows)
        row = []
        for s in range(p):
            choice = (IDLE, -1, -1)
            if (
                next_f[s] < m
                and next_f[s] - next_b[s] < p - s
                and next_f[s] - next_w[s] < p
                and deps((F, next_f[s], 0), s, t, done)
            ):
                choice = (F, next_f[s], 0)
            elif next_b[s] < m and deps((B, next_b[s], 0), s, t, done):
                choice = (B, next_b[s], 0)
            elif next_w[s] < next_b[s]:
                choice = (W, next_w[s], 0)
            row.append(choice)
        for s, (k, i, c) in enumerate(row):
            if k != IDLE:
                done[(k, i, c, s)] = t
                counter = {F: next_f, B: next_b, W: next_w}[k]
                counter[s] += 1
        rows.append(row)
        if t > 10 * 3 * m + 10 * p:  # pragma: no cover - a schedule bug
            raise RuntimeError("zero-bubble schedule simulation does not progress")
    return rows


def _dependencies(p, v):
    """`deps(action, stage, tick, done)`: whether the action's inputs have arrived by `tick`."""
    last_stage = p * v - 1

    def before(key, t, done, lag):
        return key in done and done[key] + lag <= t

    def deps(action, s, t, done):
        kind, i, c = action
        k = c * p + s  # virtual stage
        if kind == F:
            if k == 0:
                return True
            prev_c, prev_s = divmod(k - 1, p)
            return before((F, i, prev_c, prev_s), t, done, 1)
        if kind == B:
            if not before((F, i, c, s), t, done, 1):
                return False
            if k == last_stage:
                return True
            next_c, next_s = divmod(k + 1, p)
            return before((B, i, next_c, next_s), t, done, 1)
        return before((B, i, c, s), t, done, 1)  # W

    return deps


def _buffer_slots(kind, microbatch, chunk, p, v, split_backward, forward_only):
    """Most microbatches of one chunk whose received input or output gradient one stage holds
    at once (the ring buffers' size): each is held from its arrival to its last use."""
    when = {}  # (kind, virtual stage, microbatch) -> tick
    for t, s in zip(*np.nonzero(kind != IDLE), strict=True):
        when[(int(kind[t, s]), int(chunk[t, s]) * p + s, int(microbatch[t, s]))] = int(t)
    last = W if split_backward else B
    intervals = {}  # virtual stage -> list of (start, end)
    for (k, vs, i), t in when.items():
        if k != F:
            continue
        arrive = when[(F, vs - 1, i)] + 1 if vs > 0 else t
        end = t if forward_only else when[(last, vs, i)]
        intervals.setdefault(vs, []).append((arrive, end))
        if not forward_only:
            grad = t if vs == p * v - 1 else when[(B, vs + 1, i)] + 1
            intervals.setdefault(-1 - vs, []).append((grad, end))
    best = 1
    for spans in intervals.values():
        for start, _ in spans:
            best = max(best, sum(1 for a, b in spans if a <= start <= b))
    return best


@functools.lru_cache(maxsize=256)
def schedule_table(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    *,
    forward_only: bool = False,
) -> ScheduleTable:
    """The action table of `schedule` for `p` stages, `m` microbatches and `v` chunks per stage.

    Each stage's ordered action list is simulated with one tick per action
    and one tick of latency between neighbouring stages; see the module
    docstring for the schedules. `forward_only` keeps the forwards only
    (evaluation).

    Args:
      schedule: "gpipe", "1f1b", "interleaved" or "zb-h1".
      num_stages: p, the size of the pipeline mesh axis.
      num_microbatches: m.
      virtual_stages: v, model chunks per stage ("interleaved" only; else 1).
      forward_only: forwards only.

    Returns:
      A `ScheduleTable`.

    Raises:
      ValueError: an unknown schedule, or (p, m, v) the schedule cannot run
        (m < p for 1F1B-style schedules, m not a multiple of p for
        interleaved, v != 1 outside interleaved).

    Example usage::

      >>> from shardfuse.parallel.pipeline.schedule import schedule_table
      >>> table = schedule_table("1f1b", 2, 4)
      >>> table.num_ticks, round(table.bubble, 4)
      (10, 0.2)
      >>> print(table.grid())
      tick     0  1  2  3  4  5  6  7  8  9
      stage 0 F0 F1  . B0 F2 B1 F3 B2  . B3
      stage 1  . F0 B0 F1 B1 F2 B2 F3 B3  .
    """
    check_schedule(schedule, num_stages, num_microbatches, virtual_stages)
    p, m, v = int(num_stages), int(num_microbatches), int(virtual_stages)
    split = schedule == "zb-h1" and not forward_only
    deps = _dependencies(p, v)
    if split:
        rows = _zero_bubble_rows(p, m, deps)
    else:
        rows = _simulate_in_order(_stage_orders(schedule, p, m, v, forward_only), p, v, deps)
    table = np.asarray(rows, np.int32).reshape(len(rows), p, 3)
    kind, microbatch, chunk = (np.ascontiguousarray(table[..., j]) for j in range(3))
    for array in (kind, microbatch, chunk):
        array.setflags(write=False)
    slots = _buffer_slots(kind, microbatch, chunk, p, v, split, forward_only)
    return ScheduleTable(
        schedule=schedule,
        num_stages=p,
        num_microbatches=m,
        virtual_stages=v,
        forward_only=bool(forward_only),
        split_backward=split,
        kind=kind,
        microbatch=microbatch,
        chunk=chunk,
        buffer_slots=slots,
    )
