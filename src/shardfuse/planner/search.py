"""The search: every mesh and options that keep the model's divisibility, ranked by step time.

Enumerates mesh shapes `(pipeline, data, fsdp, expert, sequence, model)` whose
product is the device count (model divides the heads and MLP; sequence
divides the sequence; pipeline x virtual stages divides the layers; data x
fsdp x expert divides the batch; expert divides a mixture of experts' experts),
then per shape the ZeRO stage (1-3 over a real fsdp
axis, 0 without one), the remat policy, the microbatch size, the pipeline
schedule and virtual stages, and the context-parallel strategy. A `Parallelism`
whose predicted memory exceeds the device's is dropped (checked once per
shape, ZeRO stage, remat and microbatch size with the schedule that keeps
the fewest microbatches in flight, before the schedules are tried). What
remains is ranked by predicted step time, then memory.
"""

import heapq
import math

from shardfuse.hardware import Cluster
from shardfuse.hardware import cluster as make_cluster
from shardfuse.model_spec import ModelSpec
from shardfuse.model_spec import get as get_model
from shardfuse.parallel.options import RunOptions
from shardfuse.parallel.pipeline.schedule import closed_form_bubble
from shardfuse.planner.choices import (
    REMAT_ORDER,
    Choices,
    divisors,
    mesh_shapes,
)
from shardfuse.planner.constraints import parallelism_constraints
from shardfuse.planner.cost import compute_term, estimate, step_estimate, step_memory
from shardfuse.planner.memory import state_bytes
from shardfuse.planner.options import MESH_AXES, Assumptions, Parallelism, check_positive_int
from shardfuse.planner.plans import Plan
from shardfuse.planner.step import Step

MAX_VIRTUAL_STAGES = 8  # interleaved: virtual stages searched (2..8 that divide); pins: any


class PlanningError(ValueError):
    """No plan fits: the message says what would (more devices, remat, ZeRO-3)."""


# Branch and bound in `plan`: a candidate whose compute plus its schedule's closed-form
# bubble (a lower bound on its step time) is slower than the top_k-th plan so far is not
# estimated. Tests turn it off to check that it skips only what cannot be chosen.
BOUND = True


def plan(
    model: "ModelSpec | str",
    cluster: "Cluster | str",
    *,
    global_batch: int,
    seq_len: int,
    assumptions: Assumptions | None = None,
    top_k: int = 10,
    mesh: dict | None = None,
    zero=None,
    remat=None,
    schedule=None,
    cp_strategy=None,
    microbatch_size=None,
    virtual_stages=None,
    prefetch=None,
    calibration=None,
) -> list[Plan]:
    """The fastest ways to train `model` on `cluster` (mesh and options), best first.

    Args:
      model: a `ModelSpec` or a name of `shardfuse.models`.
      cluster: a `shardfuse.hardware.Cluster`, or a device name (one node).
      global_batch: sequences per optimizer step.
      seq_len: tokens per sequence.
      assumptions: efficiency, precision, overlap (default `Assumptions()`).
      top_k: how many plans to return.
      mesh: axis -> size to pin (e.g. `{"model": 8, "pipeline": 2}`); the
        other axes are searched.
      zero, remat, schedule, cp_strategy, microbatch_size, virtual_stages: restrict
        an option to one value or a tuple of values (default: all; virtual stages:
        any that divides the layers of a stage, searched up to `MAX_VIRTUAL_STAGES`).
      prefetch: the ZeRO-3 layer prefetch (`sf.parallel.RunOptions.prefetch`), priced
        by the cost model; default False (not searched, so that the default plans do
        not change); True or `(False, True)` to try it (with ZeRO-3 only).
        Every field of a `Parallelism` can so be pinned.
      calibration: a measured step (`sf.profile`'s `Profile`, its `to_json()` dict
        or a JSON path) of one `Parallelism` on this cluster: the assumptions'
        efficiency is fitted to it (`planner.calibrate`) before the search.

    Returns:
      Up to `top_k` `Plan`s, sorted by predicted step time (then memory); every
      one fits in the device memory and respects every divisibility rule.

    Raises:
      ValueError: a bad argument (named, with what is valid).
      PlanningError: no plan fits, or none respects the rules (each rule that
        failed is named, with its values); the message says what would.

    Example usage::

      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner import plan
      >>> plans = plan(models.get("llama3-70b"), hardware.cluster("h100", nodes=8),
      ...              global_batch=512, seq_len=8192, top_k=3)
      >>> len(plans), plans[0].step_time_s <= plans[1].step_time_s * 1.001  # ties: `TIE_RULE`
      (3, True)
    """
    model, cluster = _model_and_cluster(model, cluster)
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len), ("top_k", top_k)):
        check_positive_int(name, value)
    a = assumptions or Assumptions()
    if not isinstance(a, Assumptions):
        raise TypeError(f"assumptions={a!r} must be a shardfuse.planner.Assumptions")
    choices = Choices.of(mesh=mesh, zero=zero, remat=remat, schedule=schedule,
                         cp_strategy=cp_strategy, microbatch_size=microbatch_size,
                         virtual_stages=virtual_stages, prefetch=prefetch)  # fmt: skip
    if calibration is not None:
        from shardfuse.planner.calibrate import calibrate

        a = calibrate(calibration, model=model, cluster=cluster, assumptions=a,
                      global_batch=global_batch, seq_len=seq_len)  # fmt: skip
    _check_mesh(choices, cluster)
    search = _Search(model, cluster, a, global_batch, seq_len, choices, top_k)
    for shape in search.meshes():
        search.visit(*shape)
    return search.plans()


def _model_and_cluster(model, cluster):
    """`(ModelSpec, Cluster)` of `plan`'s arguments (names looked up), or the TypeError."""
    if isinstance(model, str):
        model = get_model(model)
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model={model!r} must be a shardfuse.models.ModelSpec or a model name")
    if isinstance(cluster, str):
        cluster = make_cluster(cluster)
    if not isinstance(cluster, Cluster):
        raise TypeError(
            f"cluster={cluster!r} must be a shardfuse.hardware.Cluster or a device name"
        )
    return model, cluster


def _check_mesh(choices: Choices, cluster):
    """PlanningError unless the pinned sizes fit the cluster's device count."""
    pinned = math.prod(choices.mesh.values()) if choices.mesh else 1
    every_axis = len(choices.mesh) == len(MESH_AXES)
    if (pinned != cluster.num_devices) if every_axis else (cluster.num_devices % pinned):
        raise PlanningError(
            f"mesh {choices.mesh}: the pinned sizes multiply to {pinned}, which "
            + ("is not" if every_axis else "does not divide")
            + f" the cluster's {cluster.num_devices} devices (rule: the mesh product is the "
            "device count)"
        )


class _Search:
    """The state of one `plan` search: what was found, the bound, what was refused.

    `visit` walks one mesh shape: per ZeRO stage and prefetch, the remat policies
    (by recomputation) and microbatch sizes (largest first); each candidate is
    checked against the rules (`constraints`), its memory and time estimated
    (`cost.estimate`), then its context-parallel strategies and pipeline
    schedules. The bound: a candidate whose compute term (`cost.compute_term`,
    the same for every mesh) plus its schedule's least closed-form bubble is
    slower than the top_k-th plan so far is not estimated.
    """

    def __init__(self, model, cluster, a, global_batch, seq_len, choices: Choices, top_k):
        self.model, self.cluster, self.a, self.choices, self.top_k = (
            model, cluster, a, choices, top_k,
        )  # fmt: skip
        self.global_batch, self.seq_len = global_batch, seq_len
        self.kwargs = dict(global_batch=global_batch, seq_len=seq_len, assumptions=a)
        self.limit = cluster.device.hbm_gb * 1e9 * (1 - a.reserved_fraction)
        self.found, self.shapes = [], 0
        self.smallest = None  # (memory bytes, Parallelism) of the least memory estimated
        self.rejected = []  # (what, rule) of pinned candidates that break a rule
        self.best_times = []  # a max-heap (negated) of the top_k step times so far
        self.compute_s = {
            policy: compute_seconds(model, cluster, policy, **self.kwargs)
            for policy in choices.remats
        }
        self.max_v = max(choices.virtuals) if choices.virtuals else MAX_VIRTUAL_STAGES

    def meshes(self):
        """The mesh shapes, without a pipeline or context parallelism first (they set the
        bound early)."""
        c = self.choices
        meshes = mesh_shapes(self.model, self.cluster.num_devices, global_batch=self.global_batch,
                             seq_len=self.seq_len, fixed=c.mesh, assumptions=self.a,
                             rejected=self.rejected)  # fmt: skip
        sequence = MESH_AXES.index("sequence")
        return sorted(meshes, key=lambda shape: (shape[0], shape[sequence]))

    def cannot_win(self, policy, allowed, P, m, v) -> bool:
        """compute x (1 + the least bubble of `allowed`) beyond the top_k-th time so far."""
        if not BOUND or len(self.best_times) < self.top_k:
            return False
        bubble = _least_bubble(allowed, P, m, v)
        return self.compute_s[policy] * (1 + bubble) > -self.best_times[0] * 1.001

    def visit(self, P, D, F, E, C, T):
        """Every candidate of one mesh shape."""
        c = self.choices
        self.shapes += 1
        per_replica = self.global_batch // (D * F * E)
        if F == 1:
            stages = (0,) if 0 in c.zeros else ()
        else:
            stages = tuple(z for z in (1, 2, 3) if z in c.zeros)
        mbs = [b for b in divisors(per_replica) if c.sizes is None or b in c.sizes][::-1]
        cps = ("ring",) if C == 1 else c.strategies
        for z in stages:
            states = state_bytes(
                self.model, Parallelism(P, D, F, C, T, expert=E).replace(zero=z), self.a
            )
            if states > self.limit:  # parameters, gradients and optimizer alone do not fit
                if self.smallest is None or states < self.smallest[0]:
                    probe = Parallelism(P, D, F, C, T, expert=E).replace(
                        zero=z, remat=c.remats[-1], num_microbatches=per_replica
                    )
                    # only a probe the rules accept is estimated (the schedule checks its m)
                    if not parallelism_constraints(self.model, probe, **self.sizes_only()):
                        self.smallest = (self.memory(probe).memory_bytes, probe)
                continue
            for prefetch in c.prefetches:
                fitted = set()  # microbatch sizes at which a cheaper policy already fits
                for policy in c.remats:
                    for mb in mbs:
                        m = per_replica // mb
                        if (P > 1 and m < P) or mb in fitted:
                            continue
                        # compute plus the smallest bubble any allowed schedule could reach
                        # is a lower bound on the step time
                        if self.cannot_win(policy, c.schedules, P, m, self.max_v):
                            continue
                        options = RunOptions(zero=z, remat=policy, prefetch=prefetch,
                                             num_microbatches=m)  # fmt: skip
                        base = Parallelism(P, D, F, C, T, options, mb, cps[0], expert=E)
                        if self.candidate(base, cps):
                            # later policies recompute more: never faster at this size
                            fitted.add(mb)
                            if P == 1:
                                # without a pipeline a larger microbatch is never slower:
                                # stop at the largest that fits
                                break

    def candidate(self, base: Parallelism, cps) -> bool:
        """Estimates `base`, its context-parallel strategies and its schedules; whether it fits."""
        model, c = self.model, self.choices
        broken = parallelism_constraints(model, base, **self.sizes_only())
        if broken:
            self.rejected += [(base.mesh_shape, rule) for rule in broken]
            return False
        memory, first = self.estimate_if_fits(base)
        if self.smallest is None or memory < self.smallest[0]:
            self.smallest = (memory, base)
        if first is None:
            return False
        strategies = [base.replace(cp_strategy=s) for s in cps]
        best_cp = self.best(strategies, known=(base, first))
        candidates = [best_cp]
        if base.pipeline > 1:
            candidates = [(None, p) for p in _schedules(model, best_cp[1], c.schedules, c.virtuals)]
        elif "1f1b" not in c.schedules:  # no pipeline: the schedule is moot
            candidates = [(None, best_cp[1].replace(schedule=c.schedules[0]))]
        policy, m = base.options.remat, base.options.num_microbatches
        for e, parallelism in candidates:
            if parallelism == best_cp[1]:
                e = best_cp[0]
            elif self.cannot_win(policy, (parallelism.options.schedule,), base.pipeline, m,
                                 parallelism.options.virtual_stages):  # fmt: skip
                continue  # the bound above, for this schedule alone
            elif broken := parallelism_constraints(model, parallelism, **self.sizes_only()):
                self.rejected += [(parallelism.mesh_shape, rule) for rule in broken]
                continue
            else:
                e = self.estimate_if_fits(parallelism)[1]
            if e is not None:
                self.found.append((_rank(e, parallelism), parallelism, e))
                heapq.heappush(self.best_times, -e.step_time_s)
                if len(self.best_times) > self.top_k:
                    heapq.heappop(self.best_times)
        return True

    def memory(self, parallelism: Parallelism):
        """The memory half of `parallelism`'s estimate (`cost.step_memory`)."""
        return step_memory(Step.of(self.model, self.cluster, parallelism, **self.kwargs))

    def estimate_if_fits(self, parallelism: Parallelism):
        """`(memory bytes, estimate)` of `parallelism`; the estimate (`cost.estimate`'s) None
        where it does not fit: its time is not priced."""
        step = Step.of(self.model, self.cluster, parallelism, **self.kwargs)
        memory = step_memory(step)
        return memory.memory_bytes, step_estimate(step, memory) if memory.fits else None

    def best(self, parallelisms, known=None):
        """The fastest fitting `(estimate, parallelism)` of `parallelisms`; `known`: one
        estimated (and fitting)."""
        best = None
        for parallelism in parallelisms:
            if parallelism_constraints(self.model, parallelism, **self.kwargs):
                continue
            if known is not None and parallelism == known[0]:
                e = known[1]
            else:
                e = self.estimate_if_fits(parallelism)[1]
            if e is not None and (best is None or e.step_time_s < best[0].step_time_s):
                best = (e, parallelism)
        return best

    def sizes_only(self) -> dict:
        return dict(global_batch=self.global_batch, seq_len=self.seq_len, assumptions=self.a)

    def plans(self) -> list:
        """The `top_k` plans found, best first; PlanningError when none."""
        if not self.found:
            c, smallest = self.choices, self.smallest
            if smallest is not None:  # the least memory, estimated in full for the message
                smallest = (estimate(self.model, self.cluster, smallest[1], **self.kwargs),
                            smallest[1])  # fmt: skip
            raise PlanningError(_no_fit_message(
                self.model, self.cluster, self.global_batch, self.seq_len, smallest,
                self.shapes, c.remats, c.zeros, self.rejected,
            ))  # fmt: skip
        self.found.sort(key=lambda item: item[0])
        return [
            Plan(self.model, self.cluster, self.global_batch, self.seq_len, parallelism, e, self.a)
            for _, parallelism, e in self.found[: self.top_k]
        ]


TIE_RULE = (
    "plans within 0.1% of each other's step time are tied; ties go to: no pipeline, "
    "less recomputation (none < dots < selective < offload < full), the lower ZeRO stage, "
    "no context parallelism, then the least memory"
)


def _rank(e, parallelism):
    """Sort key (`TIE_RULE`): step time (to 0.1%), then the simpler options, then memory."""
    return (
        round(math.log(e.step_time_s) / math.log(1.001)),
        parallelism.pipeline > 1,
        REMAT_ORDER.index(parallelism.options.remat),
        parallelism.options.zero,
        parallelism.sequence > 1,
        e.memory_bytes,
    )


def compute_seconds(model, cluster, policy, *, global_batch, seq_len, assumptions) -> float:
    """The compute term (`cost.compute_term`) of remat `policy`: the same for every mesh of the
    cluster (data parallelism over all its devices, one sequence each, scaled to the batch);
    a mixture of experts' routed matmuls at their best roofline (`Step.expert_roofline`, which
    depends on the mesh and microbatch), so that it bounds every mesh's from below."""
    everywhere = Parallelism.of(data=cluster.num_devices, remat=policy)
    step = Step.of(model, cluster, everywhere, global_batch=cluster.num_devices, seq_len=seq_len,
                   assumptions=assumptions)  # fmt: skip
    seconds = compute_term(step).value
    if step.expert_flops:  # a lower bound: the routed experts at their best roofline (1)
        seconds -= step.expert_s * (1 - step.expert_roofline)
    return seconds * global_batch / cluster.num_devices


def _least_bubble(schedules, P, m, max_v) -> float:
    """The smallest closed-form bubble over `schedules`, relative to the pipelined work."""
    if P == 1:
        return 0.0
    idle = min(
        closed_form_bubble(name, P, m, max_v if name == "interleaved" else 1) for name in schedules
    )
    return idle / (1 - idle)


def _schedules(model, base, schedules, virtuals=None):
    out = []
    per_stage = model.num_layers // base.pipeline
    for name in schedules:
        if name == "interleaved":
            tried = virtuals or [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if per_stage % v == 0]
            for v in tried:
                # a pinned v that does not divide is kept: the constraints name the rule
                if v > 1 and (virtuals or model.num_layers % (base.pipeline * v) == 0):
                    out.append(base.replace(schedule=name, virtual_stages=v))
        elif name == base.options.schedule:
            out.append(base)
        else:
            out.append(base.replace(schedule=name))
    return out


def _no_fit_message(model, cluster, global_batch, seq_len, smallest, shapes, remats, zeros,
                    rejected=()):  # fmt: skip
    where = f"{model.name} ({model.num_params() / 1e9:.3g}B parameters) on {cluster.describe()}"
    if smallest is None or (smallest[0].fits and rejected):  # what fits breaks a rule
        rules = sorted({rule for _, rule in rejected})
        failed = f"; rules that failed: {'; '.join(rules[:8])}" if rules else ""
        return (
            f"no plan of {where} respects the divisibility rules for global_batch="
            f"{global_batch}, seq_len={seq_len} ({shapes} mesh shapes tried{failed}): use a "
            "device count, batch and sequence length that the heads, layers and batch divide"
        )
    e, parallelism = smallest
    options = parallelism.options
    limit = e.memory_limit_bytes
    needed = max(2, math.ceil(e.memory_bytes / limit * cluster.num_devices))
    # a power of two of nodes: the sizes that heads, layers and batches divide
    nodes = 2 ** math.ceil(math.log2(max(1, math.ceil(needed / cluster.devices_per_node))))
    hints = [f"more devices (about {nodes} nodes of {cluster.devices_per_node})"]
    if "full" not in remats:
        hints.append("remat='full' (allow it: remat=None)")
    if 3 not in zeros:
        hints.append("ZeRO-3 over an fsdp axis (allow it: zero=None)")
    if options.remat != "full" and "full" in remats:
        hints.append("remat='full'")
    hints.append("a smaller global batch or sequence length per microbatch")
    rules = sorted({rule for _, rule in rejected})
    if rules:
        hints.append(f"(pinned plans refused by the rules: {'; '.join(rules[:8])})")
    terms = ", ".join(f"{t.name} {t.value / 1e9:.3g} GB" for t in e.memory if t.value > 0)
    return (
        f"no plan of {where} fits in {limit / 1e9:.3g} GB per device: the smallest needs "
        f"{e.memory_bytes / 1e9:.3g} GB (mesh {parallelism.mesh_shape}, zero={options.zero}, "
        f"remat={options.remat}, microbatch {parallelism.microbatch_size}: {terms}). "
        f"What would fit: {'; '.join(hints)}"
    )
