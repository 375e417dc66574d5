"""What `plan` searches: the mesh shapes that fit a model, and the values of each option.

`mesh_shapes` enumerates the mesh sizes `(pipeline, data, fsdp, expert,
sequence, model)` whose product is the device count and that the model divides
(an expert axis > 1 only for a mixture of experts, its size dividing the experts).

`Choices.of` checks `plan`'s keywords (each one value or a tuple of values of
a `Parallelism` field) against the planner's vocabulary (`options`: the ZeRO
stages, remat policies, schedules and context-parallel strategies, each
listed once where it is defined) and orders the remat policies by
recomputation (`REMAT_ORDER`), the order the search tries them in.
"""

import dataclasses

from shardfuse.model_spec import ModelSpec
from shardfuse.planner import options
from shardfuse.planner.constraints import mlp_widths
from shardfuse.planner.options import MESH_AXES, Assumptions, check_positive_int

SEARCHED_CP_STRATEGIES = ("ring", "all_gather", "ulysses")  # ulysses_ring: not modelled apart
# Remat policies by recomputation (and time): the search tries them in this order.
REMAT_ORDER = ("none", "dots", "selective", "offload", "full")


def subset(name, value, valid):
    if value is None:
        return tuple(valid)
    values = (value,) if isinstance(value, str | int) else tuple(value)
    bad = [v for v in values if v not in valid]
    if bad or not values:
        raise ValueError(f"{name}={value!r} must be one or more of {tuple(valid)}")
    return values


def positive_ints(name, value):
    if value is None:
        return None
    values = (value,) if isinstance(value, int) else tuple(value)
    for size in values:
        check_positive_int(name, size)
    return values


@dataclasses.dataclass(frozen=True)
class Choices:
    """What `plan` searches: the pinned mesh sizes and the values of each option tried."""

    mesh: dict
    zeros: tuple
    remats: tuple  # in `REMAT_ORDER`: by recomputation
    schedules: tuple
    strategies: tuple
    sizes: tuple | None  # microbatch sizes (None: every divisor)
    virtuals: tuple | None  # virtual stages (None: those that divide, up to the maximum)
    prefetches: tuple

    @classmethod
    def of(cls, *, mesh, zero, remat, schedule, cp_strategy, microbatch_size, virtual_stages,
           prefetch):  # fmt: skip
        """The checked choices of `plan`'s keywords (ValueError naming a bad one)."""
        fixed = dict(mesh or {})
        for axis, size in fixed.items():
            if axis not in MESH_AXES:
                raise ValueError(f"mesh axis {axis!r} is not one of {MESH_AXES}")
            check_positive_int(f"mesh[{axis!r}]", size)
        zeros = subset("zero", zero, options.ZERO_STAGES)
        remats = tuple(
            p for p in REMAT_ORDER if p in subset("remat", remat, options.REMAT_POLICIES)
        )
        schedules = subset("schedule", schedule, options.SCHEDULES)
        strategies = subset("cp_strategy", cp_strategy, options.CP_STRATEGIES)
        if cp_strategy is None:
            strategies = SEARCHED_CP_STRATEGIES
        sizes = positive_ints("microbatch_size", microbatch_size)
        virtuals = positive_ints("virtual_stages", virtual_stages)
        if virtuals is not None and any(v > 1 for v in virtuals) and "interleaved" not in schedules:
            raise ValueError(f"virtual_stages={virtual_stages!r} > 1 needs schedule='interleaved'")
        prefetches = (False,) if prefetch is None else subset("prefetch", prefetch, (False, True))
        return cls(fixed, zeros, remats, schedules, strategies, sizes, virtuals, prefetches)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


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
    """Mesh sizes `(pipeline, data, fsdp, expert, sequence, model)` (`MESH_AXES` order) with
    product `n` that fit the model.

    The sequence must divide by what shards it (`constraints.sequence_shards`:
    the ring, and `model` only with sequence parallelism); a pipeline needs at
    least one microbatch per stage (the batch per replica at least `pipeline`). Shapes
    that match the pins in `fixed` but break a rule are appended to `rejected` as
    `(shape, rule)` when a list is given. The expert axis splits the batch with
    data and fsdp; it is searched for a mixture of experts only, over the sizes
    that divide its experts.

    Example:
      >>> from shardfuse import models
      >>> from shardfuse.planner.search import mesh_shapes
      >>> (1, 1, 1, 1, 1, 8) in list(mesh_shapes(models.get("llama3-8b"), 8, global_batch=8,
      ...                                       seq_len=4096))
      True
      >>> (1, 1, 1, 8, 1, 1) in list(mesh_shapes(models.get("mixtral-8x7b"), 8, global_batch=8,
      ...                                       seq_len=4096))
      True
    """
    fixed = fixed or {}
    sp = (assumptions or Assumptions()).sequence_parallel
    ok = lambda axis, size: fixed.get(axis, size) == size  # noqa: E731

    def reject(shape, rule):
        if rejected is not None:
            rejected.append((shape, rule))

    for T in divisors(n):
        if not ok("model", T):
            continue
        widths = mlp_widths(model)
        if model.heads % T or any(width % T for width in widths.values()):
            sizes = " and ".join(f"{name}={width}" for name, width in widths.items())
            reject({"model": T}, f"heads={model.heads} and {sizes} % model={T} != 0")
            continue
        if model.kv_heads % T and T % model.kv_heads:
            reject({"model": T}, f"kv_heads={model.kv_heads} and model={T}: neither divides")
            continue
        by_model = T if sp else 1
        for C in divisors(n // T):
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
            for P in divisors(n // (T * C)):
                if not ok("pipeline", P):
                    continue
                if model.num_layers < P:  # (P not dividing L: uneven, balanced stages)
                    reject({"pipeline": P}, f"num_layers={model.num_layers} < pipeline={P}")
                    continue
                replicas = n // (T * C * P)
                if global_batch % replicas:
                    reject(
                        {"pipeline": P, "sequence": C, "model": T},
                        f"global_batch={global_batch} % (data x fsdp x expert={replicas}) != 0",
                    )
                    continue
                if P > 1 and global_batch // replicas < P:  # no schedule runs m < P
                    reject(
                        {"pipeline": P, "sequence": C, "model": T},
                        f"global_batch={global_batch} / (data x fsdp x expert={replicas}) = "
                        f"{global_batch // replicas} microbatches at most < pipeline={P}",
                    )
                    continue
                for E in divisors(replicas):
                    if not ok("expert", E):
                        continue
                    if E > 1 and (not model.experts or model.experts % E):
                        reject({"expert": E}, f"experts={model.experts} % expert={E} != 0"
                               if model.experts else f"expert={E}: {model.name} has no "
                               "mixture-of-experts block")  # fmt: skip
                        continue
                    for F in divisors(replicas // E):
                        D = replicas // (E * F)
                        if ok("fsdp", F) and ok("data", D):
                            yield P, D, F, E, C, T
