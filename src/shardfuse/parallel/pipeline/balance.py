"""Balanced pipeline stages: the contiguous split of the layers that minimises the slowest stage.

A pipeline runs each tick as long as its slowest stage, so the split of L
layers over p stages that matters is the one whose largest stage cost (its
layers' costs, plus the embedding's on the first stage and the head's on
the last where the stages run apart) is smallest. (`sf.parallel.Pipeline`
runs the same code on every stage: each runs the fullest stage's rows and
the head's ticks, so there only the fullest stage's layer count matters.)
`balance_stages` finds it exactly by
dynamic programming over the prefix sums of the layer costs: `best[s][i]`,
the smallest slowest-stage cost of the first `i` layers over `s` stages, is
`min_j max(best[s-1][j], cost(j, i) + extra(s))`, `O(p L^2)` (126 layers
over 16 stages: 250 thousand steps, a fraction of a second).
"""

import math

from shardfuse.layers.stack import check_stage_layers


def _check_costs(layer_costs) -> list[float]:
    costs = [float(c) for c in layer_costs]
    if not costs:
        raise ValueError("layer_costs is empty: there must be at least one layer")
    bad = [c for c in costs if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"layer_costs must be finite and >= 0; got {bad[0]!r}")
    return costs


def stage_costs(layer_costs, counts, *, first_extra=0.0, last_extra=0.0) -> list[float]:
    """Each stage's cost under the split `counts`: its layers' costs, plus the extras.

    Example:
      >>> from shardfuse.parallel.pipeline.balance import stage_costs
      >>> stage_costs([1] * 10, (3, 3, 2, 2), last_extra=2)
      [3.0, 3.0, 2.0, 4.0]
    """
    costs = _check_costs(layer_costs)
    counts = check_stage_layers(counts, len(costs))
    out, start = [], 0
    for count in counts:
        out.append(sum(costs[start : start + count]))
        start += count
    out[0] += float(first_extra)
    out[-1] += float(last_extra)
    return out


def balance_stages(layer_costs, stages: int, *, first_extra=0.0, last_extra=0.0) -> tuple:
    """The contiguous split of the layers over `stages` that minimises the slowest stage.

    Stage `s` takes the next `counts[s] >= 1` layers; its cost is the sum of
    their `layer_costs`, plus `first_extra` on the first stage (e.g. the
    embedding) and `last_extra` on the last (the head and loss). Exact (a
    dynamic program, see the module docstring); among equally slow splits,
    the most even one (least sum of squared stage costs), then the one
    whose earlier stages hold more layers. Pass the result to
    `Stack(..., stage_layers=...)`. `sf.parallel.Pipeline` runs in lockstep:
    every stage runs the fullest stage's rows and the head's ticks, so only
    the fullest stage's layer count matters there (balance equal costs);
    the extras model an executor whose stages run apart (docs/pipeline.md).

    Args:
      layer_costs: the cost of each layer, in order (seconds, FLOPs: any unit).
      stages: p >= 1, at most the number of layers.
      first_extra, last_extra: extra cost of the first and last stage (>= 0).

    Returns:
      The layers per stage, a tuple of `stages` ints summing to `len(layer_costs)`.

    Raises:
      ValueError: no layers, a negative or non-finite cost, `stages` < 1 or
        more than the layers.

    Example:
      >>> from shardfuse.parallel import balance_stages
      >>> from shardfuse.parallel.pipeline.balance import stage_costs
      >>> balance_stages([1] * 10, 4)
      (3, 3, 2, 2)
      >>> balance_stages([1] * 10, 4, last_extra=2)  # a head as heavy as two layers
      (3, 3, 3, 1)
      >>> max(stage_costs([1] * 10, (3, 3, 3, 1), last_extra=2))  # the even split's: 4
      3.0
    """
    costs = _check_costs(layer_costs)
    n = len(costs)
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n:
        raise ValueError(f"stages={stages!r} must be an int from 1 to the {n} layers")
    for name, value in (("first_extra", first_extra), ("last_extra", last_extra)):
        if not math.isfinite(float(value)) or float(value) < 0:
            raise ValueError(f"{name}={value!r} must be finite and >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def extra(s):
        return (float(first_extra) if s == 0 else 0.0) + (
            float(last_extra) if s == stages - 1 else 0.0
        )

    slowest = _split(prefix, stages, extra, lambda cost, rest: max(cost, rest), math.inf)[0]
    # Among the splits as slow as the slowest, the most even (least sum of squared stage
    # costs): a second program, every stage capped at the optimum.
    cap = slowest * (1 + 1e-12) + 1e-300

    def even(cost, rest):
        return cost * cost + rest if cost <= cap else math.inf

    return _split(prefix, stages, extra, even, math.inf)[1]


def _split(prefix, stages, extra, combine, inf):
    """`(value, counts)`: the split minimising `combine(stage cost, value of the stages
    before)` folded over the stages (max: the slowest stage; a sum: the even split)."""
    n = len(prefix) - 1
    # best[s][i]: value of layers [0, i) over stages 0..s; cut[s][i]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for i in range(1, n + 1):
        best[0][i] = combine(prefix[i] + extra(0), 0.0)
    for s in range(1, stages):
        for i in range(s + 1, n + 1):
            value, where = inf, s
            for j in range(i - 1, s - 1, -1):  # stage s = [j, i); ties: earlier stages fuller
                candidate = combine(prefix[i] - prefix[j] + extra(s), best[s - 1][j])
                if candidate < value:
                    value, where = candidate, j
            best[s][i], cut[s][i] = value, where
    counts, i = [], n
    for s in range(stages - 1, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    counts.append(i)
    return best[stages - 1][n], tuple(reversed(counts))
