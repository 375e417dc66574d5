"""The search: every layout that respects the model's divisibility, ranked by predicted step time.

Enumerates mesh shapes `(pipeline, data, fsdp, sequence, model)` whose
product is the device count (model divides the heads and MLP; sequence
divides the sequence; pipeline x virtual stages divides the layers; data x
fsdp divides the batch), then per shape the ZeRO stage (1-3 over a real fsdp
axis, 0 without one), the remat policy, the microbatch size, the pipeline
schedule and virtual stages, and the context-parallel strategy. A layout
whose predicted memory exceeds the device's is dropped (checked once per
shape, ZeRO stage, remat and microbatch size with the schedule that keeps
the fewest microbatches in flight, before the schedules are tried). What
remains is ranked by predicted step time, then memory.
"""

import dataclasses
import heapq
import math

from shardfuse.hardware import Cluster
from shardfuse.hardware import cluster as make_cluster
from shardfuse.models import ModelShape
from shardfuse.models import get as get_model
from shardfuse.planner.constraints import layout_constraints
from shardfuse.planner.cost import estimate
from shardfuse.planner.memory import state_bytes
from shardfuse.planner.options import (
    CP_STRATEGIES,
    MESH_AXES,
    REMAT_POLICIES,
    SCHEDULES,
    ZERO_STAGES,
    Assumptions,
    Layout,
)
from shardfuse.planner.plans import Plan

SEARCHED_CP_STRATEGIES = ("ring", "all_gather", "ulysses")  # ulysses_ring: not modelled apart
VIRTUAL_STAGES = (2, 4)
# Remat policies by recomputation (and time): the search tries them in this order.
REMAT_ORDER = ("none", "dots", "selective", "offload", "full")


class PlanningError(ValueError):
    """No layout fits: the message says what would (more devices, remat, ZeRO-3)."""


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


def mesh_shapes(model: ModelShape, n: int, *, global_batch: int, seq_len: int, fixed=None):
    """Mesh sizes `(pipeline, data, fsdp, sequence, model)` with product `n` that fit the model.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.search import mesh_shapes
      >>> (1, 1, 1, 1, 8) in list(mesh_shapes(models.get("llama3-8b"), 8, global_batch=8,
      ...                                    seq_len=4096))
      True
    """
    fixed = fixed or {}
    ok = lambda axis, size: fixed.get(axis, size) == size  # noqa: E731
    for T in _divisors(n):
        if not ok("model", T) or model.heads % T or model.ffn_hidden % T:
            continue
        if model.kv_heads % T and T % model.kv_heads:
            continue
        for C in _divisors(n // T):
            chunks = 2 * C if C > 1 else 1
            if not ok("sequence", C) or seq_len % (chunks * T) and seq_len % (C * T):
                continue
            for P in _divisors(n // (T * C)):
                if not ok("pipeline", P) or model.num_layers % P:
                    continue
                replicas = n // (T * C * P)
                if global_batch % replicas:
                    continue
                for F in _divisors(replicas):
                    D = replicas // F
                    if ok("fsdp", F) and ok("data", D):
                        yield P, D, F, C, T


def plan(
    model: "ModelShape | str",
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
) -> list[Plan]:
    """The best layouts for training `model` on `cluster`, best (fastest predicted) first.

    Args:
      model: a `ModelShape` / `ModelSpec` or a name of `shardfuse.models`.
      cluster: a `shardfuse.hardware.Cluster`, or a device name (one node).
      global_batch: sequences per optimizer step.
      seq_len: tokens per sequence.
      assumptions: efficiency, precision, overlap (default `Assumptions()`).
      top_k: how many plans to return.
      mesh: axis -> size to pin (e.g. `{"model": 8, "pipeline": 2}`); the
        other axes are searched.
      zero, remat, schedule, cp_strategy, microbatch_size: restrict an option to
        one value or a tuple of values (default: all).

    Returns:
      Up to `top_k` `Plan`s, sorted by predicted step time (then memory); every
      one fits in the device memory and respects every divisibility rule.

    Raises:
      ValueError: a bad argument (named, with what is valid).
      PlanningError: no layout fits; the message says what would.

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
    if not isinstance(model, ModelShape):
        raise TypeError(f"model={model!r} must be a shardfuse.models.ModelShape or a model name")
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
    zeros = _subset("zero", zero, ZERO_STAGES)
    remats = tuple(p for p in REMAT_ORDER if p in _subset("remat", remat, REMAT_POLICIES))
    schedules = _subset("schedule", schedule, SCHEDULES)
    strategies = _subset("cp_strategy", cp_strategy, CP_STRATEGIES)
    if cp_strategy is None:
        strategies = SEARCHED_CP_STRATEGIES
    if microbatch_size is not None:
        sizes = (microbatch_size,) if isinstance(microbatch_size, int) else tuple(microbatch_size)
        for size in sizes:
            _check_positive_int("microbatch_size", size)
    else:
        sizes = None

    n = cluster.num_devices
    limit = cluster.device.hbm_gb * 1e9 * (1 - a.reserved_fraction)
    kwargs = dict(global_batch=global_batch, seq_len=seq_len, assumptions=a)
    sizes_only = dict(global_batch=global_batch, seq_len=seq_len)
    found, smallest, shapes = [], None, 0
    best_times = []  # a max-heap (negated) of the top_k step times so far
    compute_s = {policy: _compute_seconds(model, cluster, policy, **kwargs) for policy in remats}
    min_bubble = min(
        1 / max(VIRTUAL_STAGES) if name == "interleaved" else 1 / 3 if name == "zb-h1" else 1
        for name in schedules
    )
    meshes = mesh_shapes(model, n, global_batch=global_batch, seq_len=seq_len, fixed=fixed)
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
            states = state_bytes(model, Layout(P, D, F, C, T, zero=z), a)
            if states > limit:  # parameters, gradients and optimizer alone do not fit
                if smallest is None or states < smallest[0].memory_bytes:
                    probe = Layout(P, D, F, C, T, zero=z, remat=remats[-1],
                                   num_microbatches=per_replica)  # fmt: skip
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
                    bound = compute_s[policy] * (1 + (P - 1) / m * min_bubble)
                    if len(best_times) >= top_k and bound > -best_times[0] * 1.001:
                        continue
                    base = Layout(P, D, F, C, T, zero=z, remat=policy, microbatch_size=mb,
                                  num_microbatches=m, cp_strategy=cps[0])  # fmt: skip
                    if layout_constraints(model, base, **sizes_only):
                        continue
                    first = estimate(model, cluster, base, **kwargs)
                    if smallest is None or first.memory_bytes < smallest[0].memory_bytes:
                        smallest = (first, base)
                    if not first.fits:
                        continue
                    # Later policies recompute more: never faster at this microbatch size.
                    fitted.add(mb)
                    best_cp = _best(model, cluster, kwargs, [
                        dataclasses.replace(base, cp_strategy=s) for s in cps
                    ])  # fmt: skip
                    candidates = [best_cp]
                    if P > 1:
                        candidates = [
                            (None, layout) for layout in _schedules(model, best_cp[1], schedules)
                        ]
                    elif "1f1b" not in schedules:  # no pipeline: the schedule is moot
                        candidates = [
                            (None, dataclasses.replace(best_cp[1], schedule=schedules[0]))
                        ]
                    for e, layout in candidates:
                        if layout == best_cp[1]:
                            e = best_cp[0]
                        elif layout_constraints(model, layout, **sizes_only):
                            continue
                        else:
                            e = estimate(model, cluster, layout, **kwargs)
                        if e.fits:
                            found.append((_rank(e, layout), layout, e))
                            heapq.heappush(best_times, -e.step_time_s)
                            if len(best_times) > top_k:
                                heapq.heappop(best_times)
                    if P == 1:
                        # Without a pipeline a larger microbatch is never slower: stop at
                        # the largest that fits.
                        break
    if not found:
        raise PlanningError(_no_fit_message(model, cluster, global_batch, seq_len, smallest,
                                            shapes, remats, zeros))  # fmt: skip
    found.sort(key=lambda item: item[0])
    return [
        Plan(model, cluster, global_batch, seq_len, layout, e, a) for _, layout, e in found[:top_k]
    ]


def _rank(e, layout):
    """Sort key: step time (to 0.1%), then the simpler options, then memory."""
    return (
        round(math.log(e.step_time_s) / math.log(1.001)),
        layout.pipeline > 1,
        REMAT_ORDER.index(layout.remat),
        layout.zero,
        layout.sequence > 1,
        e.memory_bytes,
    )


def _compute_seconds(model, cluster, policy, *, global_batch, seq_len, assumptions):
    """The compute term of `policy` (the same for every mesh of the cluster)."""
    layout = Layout(data=cluster.num_devices, remat=policy)
    e = estimate(model, cluster, layout, global_batch=cluster.num_devices, seq_len=seq_len,
                 assumptions=assumptions)  # fmt: skip
    return e.time[0].value * global_batch / cluster.num_devices


def _best(model, cluster, kwargs, layouts):
    best = None
    sizes_only = {k: v for k, v in kwargs.items() if k != "assumptions"}
    for layout in layouts:
        if layout_constraints(model, layout, **sizes_only):
            continue
        e = estimate(model, cluster, layout, **kwargs)
        if e.fits and (best is None or e.step_time_s < best[0].step_time_s):
            best = (e, layout)
    return best


def _schedules(model, base, schedules):
    out = []
    for name in schedules:
        if name == "interleaved":
            for v in VIRTUAL_STAGES:
                if model.num_layers % (base.pipeline * v) == 0:
                    out.append(dataclasses.replace(base, schedule=name, virtual_stages=v))
        elif name == base.schedule:
            out.append(base)
        else:
            out.append(dataclasses.replace(base, schedule=name))
    return out


def _no_fit_message(model, cluster, global_batch, seq_len, smallest, shapes, remats, zeros):
    where = f"{model.name} ({model.num_params() / 1e9:.3g}B parameters) on {cluster.describe()}"
    if smallest is None:
        return (
            f"no layout of {where} respects the divisibility rules for global_batch="
            f"{global_batch}, seq_len={seq_len} ({shapes} mesh shapes tried): use a device "
            "count, batch and sequence length that the heads, layers and batch divide"
        )
    e, layout = smallest
    limit = e.memory_limit_bytes
    needed = max(2, math.ceil(e.memory_bytes / limit * cluster.num_devices))
    # a power of two of nodes: the sizes that heads, layers and batches divide
    nodes = 2 ** math.ceil(math.log2(max(1, math.ceil(needed / cluster.devices_per_node))))
    hints = [f"more devices (about {nodes} nodes of {cluster.devices_per_node})"]
    if "full" not in remats:
        hints.append("remat='full' (allow it: remat=None)")
    if 3 not in zeros:
        hints.append("ZeRO-3 over an fsdp axis (allow it: zero=None)")
    if layout.remat != "full" and "full" in remats:
        hints.append("remat='full'")
    hints.append("a smaller global batch or sequence length per microbatch")
    terms = ", ".join(f"{t.name} {t.value / 1e9:.3g} GB" for t in e.memory if t.value > 0)
    return (
        f"no layout of {where} fits in {limit / 1e9:.3g} GB per device: the smallest needs "
        f"{e.memory_bytes / 1e9:.3g} GB (mesh {layout.mesh_shape}, zero={layout.zero}, "
        f"remat={layout.remat}, microbatch {layout.microbatch_size}: {terms}). "
        f"What would fit: {'; '.join(hints)}"
    )
