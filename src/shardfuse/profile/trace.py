"""Read the trace `jax.profiler.trace` writes: the ops each device ran, and the step windows.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes, under
`dir/plugins/profile/<run>/`, the XPlane (`<host>.xplane.pb`, for
TensorBoard/xprof), the same events as trace-viewer JSON
(`<host>.trace.json.gz`) and a Perfetto copy (`perfetto_trace.json.gz`).
This module reads the JSON (Chrome trace event format, times in
microseconds): no xprof or TensorBoard needed.

What the events look like (jax 0.10, inspected on XLA CPU with 8 devices):
an executed HLO op is a complete event (`"ph": "X"`) whose `args` hold
`hlo_op` (the instruction name), `hlo_module` (`jit_<fn>`) and, on CPU,
`device_ordinal`; the threads are the runtime's thread pools, not devices
(one device's ops run on several threads, and a thread serves several
devices), so ops are grouped by `device_ordinal`. On GPU and TPU traces each
device is a process (`/device:GPU:0`) with an "XLA Ops" thread and no
`device_ordinal`; there the process is the device. Each op is followed by an
`end: <op>` marker event, which is skipped. A `StepTraceAnnotation` is an
event on the Python thread named after it with `args.step_num`.
"""

import dataclasses
import glob
import gzip
import json
import os


@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One executed op: `device` (ordinal or process name), `name` (HLO instruction), times in s."""

    device: str
    name: str
    module: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Trace:
    """The ops of a trace and the windows `(start, end)` (seconds) of the annotated steps."""

    ops: tuple[OpEvent, ...]
    steps: tuple[tuple[float, float], ...]
    path: str


def find_trace_file(trace_dir: str) -> str:
    """The newest trace-viewer JSON under `trace_dir` (the Perfetto copy if it is the only one).

    Raises:
      FileNotFoundError: no `*.trace.json.gz` or `perfetto_trace.json.gz` below `trace_dir`.
    """
    pattern = os.path.join(trace_dir, "**", "*.trace.json.gz")
    found = glob.glob(pattern, recursive=True)
    if not found:
        found = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"no *.trace.json.gz or perfetto_trace.json.gz below trace_dir={trace_dir!r}"
        )
    return max(found, key=os.path.getmtime)


def _device_names(events) -> dict:
    """pid -> process name ("/device:GPU:0", "/host:CPU")."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            names[e.get("pid")] = e.get("args", {}).get("name", str(e.get("pid")))
    return names


def load_trace(path: str, *, step_name: str) -> Trace:
    """The op events and the `step_name` annotation windows of the trace JSON at `path`.

    Args:
      path: a `*.trace.json.gz` (or `.json`) file, trace-viewer or Perfetto JSON.
      step_name: the name of the `jax.profiler.StepTraceAnnotation` around each step.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = _device_names(events)
    ops, steps = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start = float(e["ts"]) * 1e-6
        end = start + float(e["dur"]) * 1e-6
        args = e.get("args") or {}
        if e.get("name") == step_name and "step_num" in args:
            steps.append((start, end))
            continue
        op = args.get("hlo_op")
        if op is None:
            continue
        device = args.get("device_ordinal")
        if device is None:
            device = processes.get(e.get("pid"), str(e.get("pid")))
        ops.append(OpEvent(str(device), op, args.get("hlo_module", ""), start, end))
    return Trace(tuple(ops), tuple(sorted(steps)), path)
