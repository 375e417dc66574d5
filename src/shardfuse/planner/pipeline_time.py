"""Step time of a pipeline as shardfuse's executor runs it: one tick at a time, in lockstep.

`shardfuse.parallel.pipeline.executor` runs the schedule table as one
`lax.scan` over ticks with a `ppermute` between neighbouring stages every
tick: a tick ends when its slowest stage's action ends, so the step lasts
`sum over ticks of max over stages of cost(action)`, not the closed-form
bubble of an asynchronous pipeline. In 1F1B's steady state the stages mix
forwards and backwards in the same tick: every tick costs a backward.

`tick_mix(schedule, p, m, v)` counts the ticks by the set of actions they hold
(F, B, W), read from the executor's own `schedule_table`; for many
microbatches it reads two small tables and extrapolates (the steady state
repeats: the counts are affine in m once m >= 2p), which tests/planner check
against the full table.
"""

import functools

from shardfuse.parallel.pipeline.schedule import B, F, W, schedule_table

_EXACT_LIMIT = 4096  # ticks x stages read from a full table; beyond: extrapolated


def _mix_of(table) -> dict:
    counts = {}
    for row in table.kind:
        kinds = frozenset(int(k) for k in row if int(k) in (F, B, W))
        counts[kinds] = counts.get(kinds, 0) + 1
    return counts


@functools.lru_cache(maxsize=4096)
def tick_mix(schedule: str, p: int, m: int, v: int = 1) -> tuple:
    """`((kinds, ticks), ...)`: how many ticks hold each set of actions (F=1, B=2, W=3).

    Example:
      >>> from shardfuse.planner.pipeline_time import tick_mix
      >>> sum(n for _, n in tick_mix("1f1b", 4, 8))  # 2 (m + p - 1) ticks
      22
    """
    ticks_estimate = (3 if schedule == "zb-h1" else 2) * (v * m + p)
    step = p if schedule == "interleaved" else 1
    lo, hi = 2 * p, 3 * p  # multiples of p: valid for every schedule
    if ticks_estimate * p <= _EXACT_LIMIT or m <= hi or m % step:
        return tuple(_mix_of(schedule_table(schedule, p, m, v)).items())
    a, b = dict(tick_mix(schedule, p, lo, v)), dict(tick_mix(schedule, p, hi, v))
    out = {}
    for kinds in set(a) | set(b):
        na, nb = a.get(kinds, 0), b.get(kinds, 0)
        out[kinds] = max(0.0, na + (nb - na) * (m - lo) / (hi - lo))
    return tuple(out.items())


def lockstep_time(schedule: str, p: int, m: int, v: int, cost: dict) -> float:
    """Seconds of the whole schedule: every tick lasts its most expensive action.

    Args:
      schedule, p, m, v: the schedule, stages, microbatches, virtual stages.
      cost: seconds of one action on one stage, `{F: ..., B: ..., W: ...}`.

    Example:
      >>> from shardfuse.parallel.pipeline.schedule import B, F, W
      >>> from shardfuse.planner.pipeline_time import lockstep_time
      >>> lockstep_time("gpipe", 2, 2, 1, {F: 1.0, B: 3.0, W: 0.0})  # 3 F ticks, 3 B ticks
      12.0
    """
    return sum(n * max((cost[k] for k in kinds), default=0.0)
               for kinds, n in tick_mix(schedule, p, m, v))  # fmt: skip


def num_ticks(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Ticks of the schedule (idle ticks included).

    Example:
      >>> from shardfuse.planner.pipeline_time import num_ticks
      >>> num_ticks("1f1b", 4, 8)
      22
    """
    return sum(n for _, n in tick_mix(schedule, p, m, v))


# Closed-form bubble of an asynchronous pipeline relative to GPipe/1F1B's (P - 1) / m.
ASYNC_BUBBLE = {"gpipe": 1.0, "1f1b": 1.0, "zb-h1": 1.0 / 3.0}
# Time terms a pipeline stage runs per microbatch (the rest runs once per step).
PIPELINED = ("compute", "elementwise", "tensor_parallel", "context_parallel", "offload")


def stage_communicates(layout, a) -> bool:
    """Whether the stage runs collectives (tensor, sequence, ZeRO-3): uniform ticks."""
    return layout.model > 1 or layout.sequence > 1 or (layout.zero == 3 and layout.fsdp > 1)


def pipeline_terms(layout, a, terms, *, head_s, send_bytes, link, overlap):
    """`pipeline_recompute`, `pipeline_p2p` and `pipeline_bubble` `Term`s of a pipelined step.

    Args:
      layout, a: the layout (`pipeline > 1`) and the `Assumptions`.
      terms: the step's time terms so far (`PIPELINED` ones are the stage work).
      head_s: seconds of the head (logits, loss, their backward) per microbatch.
      send_bytes: bytes of one stage-boundary activation.
      link: `(bytes/s, latency, name)` of the pipeline axis.
      overlap: the hardware's overlap fraction.
    """
    from shardfuse.planner.terms import Term

    P, m, v, schedule = (
        layout.pipeline,
        layout.num_microbatches,
        layout.virtual_stages,
        (layout.schedule),
    )
    work = sum(t.value for t in terms if t.name in PIPELINED)
    # The forward's share of the stage work: one of three passes, one of four when
    # "full" remat already reruns it.
    forward = work / (4.0 if layout.remat == "full" else 3.0)
    backward = work - forward
    zb = schedule == "zb-h1"
    out = []
    reruns = (2 if zb else 1) if a.pipeline_recompute else 0
    recompute = reruns * forward
    if reruns:
        out.append(Term(
            "pipeline_recompute", recompute,
            f"the executor reruns the stage forward in every {'B and W' if zb else 'backward'} "
            f"(residuals='recompute'): {reruns} x {forward:.3g} s",
        ))  # fmt: skip
    bw, lat, name = link
    per_send = send_bytes / bw + lat
    if a.pipeline_executor == "lockstep":
        ticks = num_ticks(schedule, P, m, v)
        p2p = 2 * ticks * per_send
        out.append(Term("pipeline_p2p", p2p, f"{ticks:g} ticks x 2 ppermutes of "
                        f"{send_bytes / 1e6:.3g} MB on {name}: {p2p:.3g} s, exposed (one per "
                        "tick, after its compute)", p2p))  # fmt: skip
        unit = 1.0 / (m * v)  # one action: one microbatch through one chunk
        if a.pipeline_uniform_ticks and stage_communicates(layout, a):
            tick = (work + forward) * unit + head_s
            total = ticks * tick
            why = (
                f"{ticks:g} ticks x {tick:.3g} s: with collectives in the stage every tick "
                "runs the stage forward, its VJP (recomputing the forward) and the head"
            )
        else:
            rerun = forward * unit if a.pipeline_recompute else 0.0
            if zb:
                cost = {F: forward * unit, B: backward / 2 * unit + rerun,
                        W: backward / 2 * unit + rerun}  # fmt: skip
            else:
                cost = {F: forward * unit, B: backward * unit + rerun, W: 0.0}
            total = lockstep_time(schedule, P, m, v, cost)
            why = (
                f"{ticks:g} lockstep ticks of the {schedule} table, each its slowest stage's "
                f"action (F {cost[F]:.3g} s, B {cost[B]:.3g} s"
                + (f", W {cost[W]:.3g} s" if zb else "")
                + f"): {total:.3g} s"
            )
        bubble = max(0.0, total - work - recompute)
        why += f", less the stage work {work + recompute:.3g} s"
    else:
        sends = 2 * v * m
        p2p = sends * per_send
        out.append(Term("pipeline_p2p", 0.0 if a.pp_overlap else p2p,
                        f"2 x {v} chunks x {m} microbatches ppermute of {send_bytes / 1e6:.3g} MB "
                        f"on {name}: {p2p:.3g} s" + (", overlapped" if a.pp_overlap else ""),
                        p2p))  # fmt: skip
        factor = 1.0 / v if schedule == "interleaved" else ASYNC_BUBBLE[schedule]
        pipelined = work + recompute
        bubble = (P - 1) / m * factor * pipelined
        why = f"({P} - 1) / {m} microbatches x {factor:.3g} ({schedule}, async) x {pipelined:.3g} s"
    out.append(Term("pipeline_bubble", bubble, why))
    return out
