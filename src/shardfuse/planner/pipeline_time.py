"""Step time of a pipeline as shardfuse's executor runs it: one tick at a time, in lockstep.

`shardfuse.parallel.pipeline.executor` runs the schedule's `LockstepTable` as
scans over ticks with a `ppermute` between neighbouring stages every tick:
every stage runs the same slots in a tick (an F, the head where the last
stage needs it, a B), so the step lasts the table's lockstep work,
`lockstep.lockstep_work` (the sum over ticks of the largest stage's work),
which this module reads rather than a closed form of its own. An "async"
executor (Megatron's) pays the schedule's closed-form bubble,
`schedule.closed_form_bubble`.
"""

from shardfuse.parallel.pipeline.lockstep import lockstep_table, lockstep_work
from shardfuse.parallel.pipeline.schedule import HEAD, B, F, closed_form_bubble


def num_ticks(schedule: str, p: int, m: int, v: int = 1) -> int:
    """Ticks of the executor's lockstep table (idle ticks included).

    Example:
      >>> from shardfuse.planner.pipeline_time import num_ticks
      >>> num_ticks("1f1b", 4, 8)  # m + 2 (p - 1)
      14
    """
    return lockstep_table(schedule, p, m, v).num_ticks


# Time terms a pipeline stage runs per microbatch (the rest runs once per step).
PIPELINED = (
    "compute",
    "elementwise",
    "tensor_parallel",
    "context_parallel",
    "offload",
    "expert_parallel",
    "expert_imbalance",
    "moe_host",
)


def pipeline_terms(parallelism, a, terms, *, head_s, send_bytes, link, overlap):
    """`pipeline_recompute`, `pipeline_p2p` and `pipeline_bubble` `Term`s of a pipelined step.

    Args:
      parallelism, a: the parallelism (`pipeline > 1`) and the `Assumptions`.
      terms: the step's time terms so far (`PIPELINED` ones are the stage work).
      head_s: seconds of the head (logits, loss, their backward) per microbatch.
      send_bytes: bytes of one stage-boundary activation.
      link: `(bytes/s, latency, name)` of the pipeline axis.
      overlap: the hardware's overlap fraction.
    """
    from shardfuse.planner.terms import Term

    options = parallelism.options
    P, m, v, schedule = (
        parallelism.pipeline,
        options.num_microbatches,
        options.virtual_stages,
        options.schedule,
    )
    work = sum(t.value for t in terms if t.name in PIPELINED)
    # The forward's share of the stage work: one of three passes, one of four when
    # "full" remat already reruns it.
    forward = work / (4.0 if options.remat == "full" else 3.0)
    backward = work - forward
    out = []
    recompute = forward if a.pipeline_recompute else 0.0
    if recompute:
        out.append(Term(
            "pipeline_recompute", recompute,
            f"the executor reruns the stage forward in every backward "
            f"(residuals='recompute'): {recompute:.3g} s",
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
        cost = {F: forward * unit, B: (backward + recompute) * unit, HEAD: head_s}
        total = lockstep_work(schedule, P, m, v, cost=cost)
        why = (
            f"the lockstep work of the {schedule} table ({ticks:g} ticks, every stage one F "
            f"{cost[F]:.3g} s and one B {cost[B]:.3g} s per tick, the head {head_s:.3g} s in "
            f"the last stage's F ticks): {total:.3g} s"
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
        idle = closed_form_bubble(schedule, P, m, v)
        pipelined = work + recompute
        bubble = idle / (1 - idle) * pipelined
        why = (
            f"closed-form bubble {idle:.3g} of the ticks ({schedule}, async, P={P}, m={m}): "
            f"{idle:.3g} / (1 - {idle:.3g}) x {pipelined:.3g} s"
        )
    out.append(Term("pipeline_bubble", bubble, why))
    return out
