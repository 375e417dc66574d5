"""The profile of a step: time by category, the top ops, the planner beside it, advice.

`Profile.table()` is what `shardfuse profile` prints; `Profile.to_json()` the
`--json` payload. Advice lines follow the rules of thumb of large-model
training guides (the "profile the training step" troubleshooting list):

- all-reduce above 20% of the step (`ALL_REDUCE_LIMIT`): the gradient
  all-reduce is not hidden; shard it (ZeRO-2/3 reduce-scatter) or grow the
  work per step;
- tensor parallelism across nodes: the `model` axis must stay inside a node,
  its collectives sit on the critical path of every layer;
- many tiny microbatches: a microbatch under `TINY_MICROBATCH_TOKENS` tokens
  per device runs small matmuls and pays fixed costs per microbatch;
- one slow pipeline stage: a stage busy `SLOW_STAGE_RATIO` x the fastest
  holds every other stage back (rebalance the layers);
- devices idle above `IDLE_LIMIT` of the step: the step is host- or
  launch-bound, or the devices wait on each other.
"""

import dataclasses
import json

from shardfuse.profile.hlo import COLLECTIVES, COMPUTE

ALL_REDUCE_LIMIT = 0.20
TINY_MICROBATCH_TOKENS = 2048
SLOW_STAGE_RATIO = 1.15
IDLE_LIMIT = 0.30

# planner term -> the measured labels it predicts
PLANNER_COUNTERPARTS = (
    ("compute", ("compute", "pipeline_recompute"), ("matmul", "attention")),
    ("elementwise", ("elementwise", "offload"), ("other",)),
    (
        "communication (exposed)",
        ("tensor_parallel", "context_parallel", "fsdp_gather", "data_parallel", "pipeline_p2p"),
        COLLECTIVES,
    ),
    ("bubble / idle", ("pipeline_bubble",), ("idle",)),
)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Where one training step's time goes, measured from a `jax.profiler` trace.

    Attributes:
      steps: measured steps (after the warm-up).
      devices: devices seen in the trace.
      step_time_s: wall time of one step (mean over the measured steps).
      trace_step_time_s: the step's window in the trace (mean); `categories` sum to it.
      categories: seconds per step by label (mean over devices and steps):
        "matmul", "attention", "other" (compute), each collective kind (exposed
        communication only), "idle".
      overlapped: seconds per step of each collective kind hidden under compute.
      collectives: kind -> `{"calls": per device and step, "seconds": exposed + overlapped}`
        for every kind seen.
      top_ops: the ops taking the most time, `{"name", "category", "seconds", "calls",
        "scope"}` per device and step (scope: where the op comes from, its `op_name`).
      device_busy_s: device -> seconds per step it was not idle.
      predicted: planner term -> predicted seconds (None without a configuration).
      predicted_label: what the prediction is for (the cluster and parallelism).
      advice: advice lines from the rules of the module docstring.
      trace_dir: the directory `jax.profiler.trace` wrote (TensorBoard/xprof, Perfetto).
      trace_file: the trace JSON that was parsed.
      attributed_by: "program" (categories from the compiled HLO) or "name" (guessed).
    """

    steps: int
    devices: int
    step_time_s: float
    trace_step_time_s: float
    categories: dict
    overlapped: dict
    collectives: dict
    top_ops: tuple
    device_busy_s: dict
    predicted: dict | None
    predicted_label: str
    advice: tuple
    trace_dir: str
    trace_file: str
    attributed_by: str

    @property
    def total_s(self) -> float:
        """The sum of `categories` (equals `trace_step_time_s`)."""
        return sum(self.categories.values())

    @property
    def exposed_communication_s(self) -> float:
        return sum(self.categories[k] for k in COLLECTIVES)

    @property
    def overlapped_communication_s(self) -> float:
        return sum(self.overlapped.values())

    def to_json(self) -> dict:
        """A JSON-serialisable dict of every field, plus the totals."""
        payload = dataclasses.asdict(self)
        payload.update(
            total_s=self.total_s,
            exposed_communication_s=self.exposed_communication_s,
            overlapped_communication_s=self.overlapped_communication_s,
        )
        return json.loads(json.dumps(payload, default=str))

    def table(self) -> str:
        """The report `shardfuse profile` prints."""
        step = self.trace_step_time_s or 1e-30
        ms = 1e3
        out = [
            f"step time {self.step_time_s * ms:.2f} ms (wall, mean of {self.steps} steps), "
            f"{self.trace_step_time_s * ms:.2f} ms in the trace; {self.devices} devices; "
            f"ops attributed by {self.attributed_by}",
            "",
            f"{'category':<30}{'ms/step':>10}{'% step':>9}",
        ]

        def row(label, seconds):
            out.append(f"{label:<30}{seconds * ms:>10.3f}{100 * seconds / step:>8.1f}%")

        for kind in COMPUTE:
            row(f"compute: {kind}", self.categories[kind])
        for kind in COLLECTIVES:
            if kind in self.collectives or self.categories[kind]:
                row(f"comm exposed: {kind}", self.categories[kind])
        row("idle", self.categories["idle"])
        row("total (sum of the above)", self.total_s)
        out.append("")
        exposed, hidden = self.exposed_communication_s, self.overlapped_communication_s
        out.append(
            f"communication: {exposed * ms:.3f} ms exposed, {hidden * ms:.3f} ms overlapped "
            "with compute"
        )
        seen = ", ".join(
            f"{kind} ({c['calls']:g} calls, {c['seconds'] * ms:.3f} ms, "
            f"{self.overlapped.get(kind, 0.0) * ms:.3f} ms overlapped)"
            for kind, c in self.collectives.items()
        )
        out.append(f"collectives seen: {seen or 'none'}")
        out.append("")
        out.append(f"top ops (per device and step){'':<6}{'ms':>9}{'calls':>7}  category: scope")
        for op in self.top_ops:
            scope = f": {op['scope']}" if op.get("scope") else ""
            out.append(
                f"  {op['name'][:32]:<32}{op['seconds'] * ms:>9.3f}{op['calls']:>7g}  "
                f"{op['category']}{scope}"
            )
        if self.predicted is not None:
            out += ["", *self._planner_lines()]
        out.append("")
        out += [f"advice: {line}" for line in self.advice] or ["advice: none (no rule fired)"]
        out.append(f"trace: {self.trace_dir} (TensorBoard/xprof: the .xplane.pb; Perfetto: ")
        out[-1] += "perfetto_trace.json.gz)"
        return "\n".join(out)

    def _planner_lines(self) -> list[str]:
        ms = 1e3
        predicted_step = sum(self.predicted.values()) or 1e-30
        step = self.trace_step_time_s or 1e-30
        lines = [
            f"planner prediction ({self.predicted_label}) beside the measurement:",
            f"{'term':<26}{'predicted ms':>13}{'share':>8}{'measured ms':>13}{'share':>8}"
            "  measured as",
        ]
        for label, terms, measured_as in PLANNER_COUNTERPARTS:
            p = sum(self.predicted.get(t, 0.0) for t in terms)
            m = sum(self.categories[k] for k in measured_as)
            lines.append(
                f"{label:<26}{p * ms:>13.4g}{100 * p / predicted_step:>7.1f}%"
                f"{m * ms:>13.4g}{100 * m / step:>7.1f}%  {' + '.join(measured_as)}"
            )
        lines.append(
            f"{'step':<26}{predicted_step * ms:>13.4g}{'':>8}{self.trace_step_time_s * ms:>13.4g}"
        )
        terms = ", ".join(f"{k} {v * ms:.4g} ms" for k, v in self.predicted.items())
        lines.append(f"planner terms: {terms}")
        return lines


def advice(profile_fields: dict, parallelism=None, *, devices_per_node=None, seq_len=None) -> tuple:
    """Advice lines from the module docstring's rules.

    Args:
      profile_fields: `categories`, `overlapped`, `collectives`, `device_busy_s`,
        `trace_step_time_s` (the measured parts of a `Profile`).
      parallelism: the step's `sf.planner.Parallelism` if known (mesh sizes, microbatches).
      devices_per_node: devices of one node (tensor parallelism across nodes).
      seq_len: tokens per sequence (microbatch size in tokens).
    """
    lines = []
    step = profile_fields["trace_step_time_s"] or 1e-30
    all_reduce = profile_fields["collectives"].get("all-reduce", {}).get("seconds", 0.0)
    if all_reduce > ALL_REDUCE_LIMIT * step:
        lines.append(
            f"all-reduce takes {100 * all_reduce / step:.0f}% of the step (rule: under "
            f"{100 * ALL_REDUCE_LIMIT:.0f}%): shard the gradient reduction (ZeRO-2/3 "
            "reduce-scatter), overlap it with the backward pass, or do more work per step"
        )
    if parallelism is not None and devices_per_node and parallelism.model > 1:
        if parallelism.model > devices_per_node:  # innermost axis: consecutive devices
            lines.append(
                f"tensor parallelism model={parallelism.model} spans more than one node of "
                f"{devices_per_node} devices: keep the model axis inside a node"
            )
    if parallelism is not None and seq_len and parallelism.options.num_microbatches > 1:
        tokens = parallelism.microbatch_size * seq_len / (parallelism.sequence * parallelism.model)
        if tokens < TINY_MICROBATCH_TOKENS:
            lines.append(
                f"{parallelism.options.num_microbatches} microbatches of {tokens:g} tokens per "
                "device "
                f"(under {TINY_MICROBATCH_TOKENS}): fewer, larger microbatches run larger "
                "matmuls and pay the per-microbatch costs less often"
            )
    busy = profile_fields["device_busy_s"]
    if parallelism is not None and parallelism.pipeline > 1 and busy:
        per_stage = len(busy) // parallelism.pipeline
        ordered = [busy[d] for d in sorted(busy, key=_device_order)]
        stages = [
            sum(ordered[i * per_stage : (i + 1) * per_stage]) / max(per_stage, 1)
            for i in range(parallelism.pipeline)
        ]
        slow = max(range(len(stages)), key=stages.__getitem__)
        if min(stages) > 0 and stages[slow] > SLOW_STAGE_RATIO * min(stages):
            lines.append(
                f"pipeline stage {slow} is busy {stages[slow] / min(stages):.2f}x the least "
                "busy stage: move layers off it (uneven stages) or rebalance the head/embedding"
            )
    idle = profile_fields["categories"]["idle"]
    if idle > IDLE_LIMIT * step:
        lines.append(
            f"devices idle {100 * idle / step:.0f}% of the step (over {100 * IDLE_LIMIT:.0f}%): "
            "host-bound or launch-bound, or devices waiting on each other (on CPU the "
            "simulated devices share the cores)"
        )
    return tuple(lines)


def _device_order(device: str):
    return (0, int(device)) if device.isdigit() else (1, device)
