"""`sf.profile(step, *args)`: run a step under `jax.profiler` and say where its time goes."""

import collections
import statistics
import tempfile
import time

import jax

from shardfuse._keywords import renamed_keywords
from shardfuse.profile import hlo, report, timeline, trace

STEP_NAME = "shardfuse_profile_step"


def _program_text(step, args, kwargs) -> str | None:
    """The compiled program's text (`step.lower(...).compile().as_text()`), None if unavailable."""
    lower = getattr(step, "lower", None)
    if lower is None:
        return None
    try:
        return lower(*args, **kwargs).compile().as_text()
    except Exception:  # any step that cannot be lowered again: attribute ops by name
        return None


def _predicted_terms(predicted) -> dict | None:
    """planner term -> seconds from an `Estimate`/`Plan` (their `.time` terms) or a mapping."""
    if predicted is None:
        return None
    estimate = getattr(predicted, "estimate", predicted)
    terms = getattr(estimate, "time", None)
    if terms is not None:
        return {t.name: float(t.value) for t in terms}
    return {str(k): float(v) for k, v in dict(predicted).items()}


@renamed_keywords(layout="parallelism")  # its name in earlier releases
def profile(
    step,
    *args,
    steps: int = 5,
    warmup: int = 2,
    trace_dir: str | None = None,
    predicted=None,
    predicted_label: str = "",
    parallelism=None,
    devices_per_node: int | None = None,
    seq_len: int | None = None,
    top: int = 10,
    hlo_text: str | None = None,
    **kwargs,
) -> report.Profile:
    """Runs `warmup + steps` calls of `step(*args, **kwargs)`, the last `steps` under a trace.

    Each measured call runs inside `jax.profiler.StepTraceAnnotation` and is
    waited for (`jax.block_until_ready`), so one step's ops lie in its window.
    The trace (`jax.profiler.trace(trace_dir, create_perfetto_trace=True)`) is
    parsed from its JSON; each op is attributed from the compiled program
    (`step.lower(*args).compile().as_text()`, when `step` is jitted) or from
    its name; then every instant of every device's step window is labelled
    (`shardfuse.profile.timeline`), so the categories sum to the step.

    `step` is called with the same arguments every time: a step that updates
    state in place (an NNX model and optimizer) trains on; one whose inputs are
    donated must be wrapped to make fresh ones.

    Args:
      step: the function to profile, usually jitted (`jax.jit`, `nnx.jit`).
      *args, **kwargs: its arguments.
      steps: measured steps (>= 1).
      warmup: calls before the trace (compilation, caches), >= 0.
      trace_dir: where the trace goes (default: a new temporary directory).
      predicted: the planner's prediction for this configuration (an
        `sf.planner` `Estimate` or `Plan`, or term name -> seconds), printed
        beside the measurement.
      predicted_label: what the prediction is for (cluster, parallelism).
      parallelism: the step's `sf.planner.Parallelism`, for the advice rules.
      devices_per_node, seq_len: for the advice rules.
      top: how many ops the report lists.
      hlo_text: the compiled program's text, if `step` cannot be lowered.

    Returns:
      A `Profile` (`print(p.table())`, `p.to_json()`).

    Raises:
      ValueError: `steps < 1`, `warmup < 0`, or a trace with no op of the steps.

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> step = jax.jit(lambda x: jnp.tanh(x @ x).sum())
      >>> p = sf.profile(step, jnp.ones((64, 64)), steps=2, warmup=1)
      >>> abs(p.total_s - p.trace_step_time_s) < 1e-9
      True
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0")
    for _ in range(warmup):
        jax.block_until_ready(step(*args, **kwargs))
    trace_dir = trace_dir or tempfile.mkdtemp(prefix="shardfuse-profile-")
    walls = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                start = time.perf_counter()
                jax.block_until_ready(step(*args, **kwargs))
                walls.append(time.perf_counter() - start)
    if hlo_text is None:
        hlo_text = _program_text(step, args, kwargs)
    parsed = trace.load_trace(trace.find_trace_file(trace_dir), step_name=STEP_NAME)
    return summarize(
        parsed,
        hlo.classify_program(hlo_text) if hlo_text else None,
        scopes=hlo.op_scopes(hlo_text) if hlo_text else None,
        step_time_s=statistics.mean(walls),
        trace_dir=trace_dir,
        predicted=_predicted_terms(predicted),
        predicted_label=predicted_label,
        parallelism=parallelism,
        devices_per_node=devices_per_node,
        seq_len=seq_len,
        top=top,
    )


@renamed_keywords(layout="parallelism")
def summarize(
    parsed: trace.Trace,
    categories_of: dict | None,
    *,
    step_time_s: float,
    trace_dir: str,
    scopes: dict | None = None,
    predicted: dict | None = None,
    predicted_label: str = "",
    parallelism=None,
    devices_per_node=None,
    seq_len=None,
    top: int = 10,
) -> report.Profile:
    """A `Profile` from a parsed trace and the op -> category (and -> scope) maps of its program."""
    if not parsed.steps:
        raise ValueError(f"the trace {parsed.path} has no {STEP_NAME!r} step annotation")

    def category(name):
        if categories_of is not None and name in categories_of:
            return categories_of[name]
        return hlo.classify_name(name)

    by_device = collections.defaultdict(list)
    for op in parsed.ops:
        by_device[op.device].append((op.start, op.end, category(op.name), op.name))
    in_steps = {
        device: [o for o in ops if any(o[1] > s and o[0] < e for s, e in parsed.steps)]
        for device, ops in by_device.items()
    }
    in_steps = {d: ops for d, ops in in_steps.items() if ops}
    if not in_steps:
        raise ValueError(f"the trace {parsed.path} has no device op inside the annotated steps")
    n_devices, n_steps = len(in_steps), len(parsed.steps)
    totals = dict.fromkeys(timeline.LABELS, 0.0)
    hidden = dict.fromkeys(hlo.COLLECTIVES, 0.0)
    busy = {}
    for device, ops in in_steps.items():
        busy[device] = 0.0
        for s, e in parsed.steps:
            labels, overlapped = timeline.split_window([o[:3] for o in ops], s, e)
            for k, v in labels.items():
                totals[k] += v
            for k, v in overlapped.items():
                hidden[k] += v
            busy[device] += (e - s - labels["idle"]) / n_steps
    scale = 1.0 / (n_devices * n_steps)
    categories = {k: v * scale for k, v in totals.items()}
    overlapped = {k: v * scale for k, v in hidden.items()}
    op_time, op_calls, op_category = collections.Counter(), collections.Counter(), {}
    for ops in in_steps.values():
        for start, end, cat, name in ops:
            op_time[name] += (end - start) * scale
            op_calls[name] += scale
            op_category[name] = cat
    collectives = {}
    for kind in hlo.COLLECTIVES:
        names = [n for n, c in op_category.items() if c == kind]
        if names:
            collectives[kind] = dict(
                calls=round(sum(op_calls[n] for n in names), 3),
                seconds=categories[kind] + overlapped[kind],
            )
    ranked = [n for n, _ in op_time.most_common() if op_category[n] != hlo.CONTROL][:top]
    top_ops = tuple(
        dict(
            name=n,
            category=op_category[n],
            seconds=op_time[n],
            calls=round(op_calls[n], 3),
            scope=(scopes or {}).get(n, ""),
        )
        for n in ranked
    )
    window = sum(e - s for s, e in parsed.steps) / n_steps
    measured = dict(
        categories=categories,
        overlapped=overlapped,
        collectives=collectives,
        device_busy_s=busy,
        trace_step_time_s=window,
    )
    return report.Profile(
        steps=n_steps,
        devices=n_devices,
        step_time_s=step_time_s,
        trace_step_time_s=window,
        categories=categories,
        overlapped=overlapped,
        collectives=collectives,
        top_ops=top_ops,
        device_busy_s=busy,
        predicted=predicted,
        predicted_label=predicted_label,
        advice=report.advice(
            measured, parallelism, devices_per_node=devices_per_node, seq_len=seq_len
        ),
        trace_dir=trace_dir,
        trace_file=parsed.path,
        attributed_by="program" if categories_of is not None else "name",
    )
