"""The search: every mesh and options that keep the model's divisibility, ranked by step time.

Enumerates mesh shapes `(pipeline, data, fsdp, sequence, model)` whose
product is the device count (model divides the heads and MLP; sequence
divides the sequence; pipeline x virtual stages divides the layers; data x
fsdp divides the batch), then per shape the ZeRO stage (1-3 over a real fsdp
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
from shardfuse.parallel.pipeline.schedule import closed_form_bubble
from shardfuse.planner import options
from shardfuse.planner.constraints import parallelism_constraints
from shardfuse.planner.cost import estimate
from shardfuse.planner.memory import state_bytes
from shardfuse.planner.options import MESH_AXES, Assumptions, Parallelism
from shardfuse.planner.plans import Plan

SEARCHED_CP_STRATEGIES = ("ring", "all_gather", "ulysses")  # ulysses_ring: not modelled apart
MAX_VIRTUAL_STAGES = 8  # interleaved: virtual stages searched (2..8 that divide); pins: any
# Remat policies by recomputation (and time): the search tries them in this order.
REMAT_ORDER = ("none", "dots", "selective", "offload", "full")


class PlanningError(ValueError):
    """No plan fits: the message says what would (more devices, remat, ZeRO-3)."""


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def _subset(name, value, valid):
    if value is None:
        return tuple(valid)
    values = (value,) if isinstance(value, str | int) else tuple(value)
    bad = [v for v in values if v not in valid]
    if bad or not values:
        raise ValueError(f"{name}={value!r} must be one or more of {tuple(valid)}")
    return values


def mesh_shapes(
    model: ModelSpec,
    n: int,
    *,
    global_batch: int,
    seq_len: int,
    fixed=None,
    assumptions: Assumptions | None = None,
    rejected: list | None = None,
):
    """Mesh sizes `(pipeline, data, fsdp, sequence, model)` with product `n` that fit the model.

    The sequence must divide by what shards it (`constraints.sequence_shards`:
    the ring, and `model` only with sequence parallelism). Shapes that match
    the pins in `fixed` but break a rule are appended to `rejected` as
    `(shape, rule)` when a list is given.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.search import mesh_shapes
      >>> (1, 1, 1, 1, 8) in list(mesh_shapes(models.get("llama3-8b"), 8, global_batch=8,
      ...                                    seq_len=4096))
      True
    """
    fixed = fixed or {}
    sp = (assumptions or Assumptions()).sequence_parallel
    ok = lambda axis, size: fixed.get(axis, size) == size  # noqa: E731

    def reject(shape, rule):
        if rejected is not None:
            rejected.append((shape, rule))

    for T in _divisors(n):
        if not ok("model", T):
            continue
        if model.heads % T or model.ffn_hidden % T:
            reject({"model": T}, f"heads={model.heads} and ffn_hidden={model.ffn_hidden} % "
                                 f"model={T} != 0")  # fmt: skip
            continue
        if model.kv_heads % T and T % model.kv_heads:
            reject({"model": T}, f"kv_heads={model.kv_heads} and model={T}: neither divides")
            continue
        by_model = T if sp else 1
        for C in _divisors(n // T):
            chunks = 2 * C if C > 1 else 1
            if not ok("sequence", C):
                continue
            if seq_len % (chunks * by_model) and seq_len % (C * by_model):
                reject(
                    {"sequence": C, "model": T},
                    f"seq_len={seq_len} % (sequence chunks="
                    f"{chunks}" + (f" x model={T}, sequence parallel" if sp else "") + ") != 0",
                )
                continue
            for P in _divisors(n // (T * C)):
                if not ok("pipeline", P):
                    continue
                if model.num_layers < P:  # (P not dividing L: uneven, balanced stages)
                    reject({"pipeline": P}, f"num_layers={model.num_layers} < pipeline={P}")
                    continue
                replicas = n // (T * C * P)
                if global_batch % replicas:
                    reject(
                        {"pipeline": P, "sequence": C, "model": T},
                        f"global_batch={global_batch} % (data x fsdp={replicas}) != 0",
                    )
                    continue
                for F in _divisors(replicas):
                    D = replicas // F
                    if ok("fsdp", F) and ok("data", D):
                        yield P, D, F, C, T


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
    calibration=None,
) -> list[Plan]:
    """The best parallelisms for training `model` on `cluster`, best (fastest predicted) first.

    Args:
      model: a `ModelSpec` / `ModelSpec` or a name of `shardfuse.models`.
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
        Every field of a `Parallelism` can so be pinned.
      calibration: a measured step (`sf.profile`'s `Profile`, its `to_json()` dict
        or a JSON path) of one parallelism on this cluster: the assumptions'
        efficiency is fitted to it (`planner.calibrate`) before the search.

    Returns:
      Up to `top_k` `Plan`s, sorted by predicted step time (then memory); every
      one fits in the device memory and respects every divisibility rule.

    Raises:
      ValueError: a bad argument (named, with what is valid).
      PlanningError: no parallelism fits, or none respects the rules (each rule that
        failed is named, with its values); the message says what would.

    Example usage::

      >>> from shardfuse import hardware, models
      >>> from shardfuse.planner import plan
      >>> plans = plan(models.get("llama3-70b"), hardware.cluster("h100", nodes=8),
      ...              global_batch=512, seq_len=8192, top_k=3)
      >>> len(plans), plans[0].step_time_s <= plans[1].step_time_s * 1.001  # ties: `TIE_RULE`
      (3, True)
    """
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
    _check_positive_int("global_batch", global_batch)
    _check_positive_int("seq_len", seq_len)
    _check_positive_int("top_k", top_k)
    a = assumptions or Assumptions()
    if not isinstance(a, Assumptions):
        raise TypeError(f"assumptions={a!r} must be a shardfuse.planner.Assumptions")
    fixed = dict(mesh or {})
    for axis, size in fixed.items():
        if axis not in MESH_AXES:
            raise ValueError(f"mesh axis {axis!r} is not one of {MESH_AXES}")
        _check_positive_int(f"mesh[{axis!r}]", size)
    zeros = _subset("zero", zero, options.ZERO_STAGES)
    remats = tuple(p for p in REMAT_ORDER if p in _subset("remat", remat, options.REMAT_POLICIES))
    schedules = _subset("schedule", schedule, options.SCHEDULES)
    strategies = _subset("cp_strategy", cp_strategy, options.CP_STRATEGIES)
    if cp_strategy is None:
        strategies = SEARCHED_CP_STRATEGIES
    sizes = _ints("microbatch_size", microbatch_size)
    virtuals = _ints("virtual_stages", virtual_stages)
    if virtuals is not None and any(v > 1 for v in virtuals) and "interleaved" not in schedules:
        raise ValueError(f"virtual_stages={virtual_stages!r} > 1 needs schedule='interleaved'")
    if calibration is not None:
        from shardfuse.planner.calibrate import calibrate

        a = calibrate(calibration, model=model, cluster=cluster, assumptions=a,
                      global_batch=global_batch, seq_len=seq_len)  # fmt: skip
    pinned = math.prod(fixed.values()) if fixed else 1
    every_axis = len(fixed) == len(MESH_AXES)
    if (pinned != cluster.num_devices) if every_axis else (cluster.num_devices % pinned):
        raise PlanningError(
            f"mesh {fixed}: the pinned sizes multiply to {pinned}, which "
            + ("is not" if every_axis else "does not divide")
            + f" the cluster's {cluster.num_devices} devices (rule: the mesh product is the "
            "device count)"
        )

    n = cluster.num_devices
    limit = cluster.device.hbm_gb * 1e9 * (1 - a.reserved_fraction)
    kwargs = dict(global_batch=global_batch, seq_len=seq_len, assumptions=a)
    sizes_only = dict(global_batch=global_batch, seq_len=seq_len, assumptions=a)
    found, smallest, shapes = [], None, 0
    rejected = []  # (what, rule) of pinned candidates that break a rule
    best_times = []  # a max-heap (negated) of the top_k step times so far

    def cannot_win(compute, allowed, P, m, v):
        """compute x (1 + the least bubble of `allowed`) beyond the top_k-th time so far."""
        if not BOUND or len(best_times) < top_k:
            return False
        return compute * (1 + _least_bubble(allowed, P, m, v)) > -best_times[0] * 1.001

    compute_s = {policy: _compute_seconds(model, cluster, policy, **kwargs) for policy in remats}
    max_v = max(virtuals) if virtuals else MAX_VIRTUAL_STAGES
    meshes = list(mesh_shapes(model, n, global_batch=global_batch, seq_len=seq_len, fixed=fixed,
                              assumptions=a, rejected=rejected))  # fmt: skip
    # Shapes without a pipeline or context parallelism first: they set the bound early.
    for P, D, F, C, T in sorted(meshes, key=lambda shape: (shape[0], shape[3])):
        shapes += 1
        per_replica = global_batch // (D * F)
        if F == 1:
            stages = (0,) if 0 in zeros else ()
        else:
            stages = tuple(z for z in (1, 2, 3) if z in zeros)
        mbs = [b for b in _divisors(per_replica) if sizes is None or b in sizes][::-1]
        cps = ("ring",) if C == 1 else strategies
        for z in stages:
            states = state_bytes(model, Parallelism(P, D, F, C, T).replace(zero=z), a)
            if states > limit:  # parameters, gradients and optimizer alone do not fit
                if smallest is None or states < smallest[0].memory_bytes:
                    probe = Parallelism(P, D, F, C, T).replace(
                        zero=z, remat=remats[-1], num_microbatches=per_replica
                    )
                    smallest = (estimate(model, cluster, probe, **kwargs), probe)
                continue
            fitted = set()  # microbatch sizes at which a cheaper policy already fits
            for policy in remats:
                for mb in mbs:
                    m = per_replica // mb
                    if (P > 1 and m < P) or mb in fitted:
                        continue
                    # Branch and bound: compute plus the smallest bubble any allowed
                    # schedule could reach is a lower bound on the step time.
                    if cannot_win(compute_s[policy], schedules, P, m, max_v):
                        continue
                    base = Parallelism(P, D, F, C, T).replace(
                        zero=z, remat=policy, microbatch_size=mb, num_microbatches=m,
                        cp_strategy=cps[0],
                    )  # fmt: skip
                    broken = parallelism_constraints(model, base, **sizes_only)
                    if broken:
                        rejected += [(base.mesh_shape, rule) for rule in broken]
                        continue
                    first = estimate(model, cluster, base, **kwargs)
                    if smallest is None or first.memory_bytes < smallest[0].memory_bytes:
                        smallest = (first, base)
                    if not first.fits:
                        continue
                    # Later policies recompute more: never faster at this microbatch size.
                    fitted.add(mb)
                    best_cp = _best(model, cluster, kwargs, [
                        base.replace(cp_strategy=s) for s in cps
                    ], known=(base, first))  # fmt: skip
                    candidates = [best_cp]
                    if P > 1:
                        candidates = [
                            (None, parallelism)
                            for parallelism in _schedules(model, best_cp[1], schedules, virtuals)
                        ]
                    elif "1f1b" not in schedules:  # no pipeline: the schedule is moot
                        candidates = [(None, best_cp[1].replace(schedule=schedules[0]))]
                    for e, parallelism in candidates:
                        if parallelism == best_cp[1]:
                            e = best_cp[0]
                        elif cannot_win(compute_s[policy], (parallelism.options.schedule,), P, m,
                                        parallelism.options.virtual_stages):  # fmt: skip
                            continue  # the bound above, for this schedule alone
                        elif broken := parallelism_constraints(model, parallelism, **sizes_only):
                            rejected += [(parallelism.mesh_shape, rule) for rule in broken]
                            continue
                        else:
                            e = estimate(model, cluster, parallelism, **kwargs)
                        if e.fits:
                            found.append((_rank(e, parallelism), parallelism, e))
                            heapq.heappush(best_times, -e.step_time_s)
                            if len(best_times) > top_k:
                                heapq.heappop(best_times)
                    if P == 1:
                        # Without a pipeline a larger microbatch is never slower: stop at
                        # the largest that fits.
                        break
    if not found:
        raise PlanningError(_no_fit_message(model, cluster, global_batch, seq_len, smallest,
                                            shapes, remats, zeros, rejected))  # fmt: skip
    found.sort(key=lambda item: item[0])
    return [
        Plan(model, cluster, global_batch, seq_len, parallelism, e, a)
        for _, parallelism, e in found[:top_k]
    ]


TIE_RULE = (
    "plans within 0.1% of each other's step time are tied; ties go to: no pipeline, "
    "less recomputation (none < dots < selective < offload < full), the lower ZeRO stage, "
    "no context parallelism, then the least memory"
)


def _ints(name, value):
    if value is None:
        return None
    values = (value,) if isinstance(value, int) else tuple(value)
    for size in values:
        _check_positive_int(name, size)
    return values


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


def _compute_seconds(model, cluster, policy, *, global_batch, seq_len, assumptions):
    """The compute term of `policy` (the same for every mesh of the cluster)."""
    parallelism = Parallelism.of(data=cluster.num_devices, remat=policy)
    e = estimate(model, cluster, parallelism, global_batch=cluster.num_devices, seq_len=seq_len,
                 assumptions=assumptions)  # fmt: skip
    return e.time[0].value * global_batch / cluster.num_devices


def _best(model, cluster, kwargs, parallelisms, known=None):
    """The fastest fitting `(estimate, parallelism)` of `parallelisms`; `known`: one estimated."""
    best = None
    for parallelism in parallelisms:
        if parallelism_constraints(model, parallelism, **kwargs):
            continue
        if known is not None and parallelism == known[0]:
            e = known[1]
        else:
            e = estimate(model, cluster, parallelism, **kwargs)
        if e.fits and (best is None or e.step_time_s < best[0].step_time_s):
            best = (e, parallelism)
    return best


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
    if smallest is None:
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
