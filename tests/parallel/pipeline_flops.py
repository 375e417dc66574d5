"""Executed FLOPs of a compiled pipeline step against the schedule IR's lockstep work.

`executed_flops(hlo_text)`: dot FLOPs per device of an optimized HLO
module, each `while` body counted `known_trip_count` times (nested loops
multiply; `compiled.cost_analysis()` counts a loop body once and cannot be
used). A `conditional` counts its largest branch: the pipeline executor has
none (what it runs per tick is fixed by the table); the attention kernel's
tile skipping (`lax.cond` on a tile's visibility) has, counted the same way
in the pipelined program and in the unpipelined pieces the costs come from.

`measure(shape, names, schedule, m, v, residuals)`: the transformer LM of
`pipeline_models` (one `ParallelTransformerBlock` per chunk, microbatch 2)
pipelined on a mesh of `shape` and `names`; the per-action costs (one
chunk's forward F and backward B, the head H) counted independently from
the unpipelined pieces (the stack's forward, the stack's VJP, the head's
VJP) compiled on the same mesh with a pipeline axis of 1; the IR's lockstep
work `lockstep.lockstep_work` from those costs, and the ideal, the busiest
stage's work without a bubble (`LockstepTable.ideal`).

Run as a script for the table of the issue (slow: one compile per row)::

  python -m tests.parallel.pipeline_flops
"""

import functools
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from shardfuse.parallel.pipeline.lockstep import lockstep_table
from shardfuse.parallel.pipeline.schedule import HEAD, B, F
from tests.parallel import pipeline_models as pm

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_DOT = re.compile(r"=\s*(\w+\[[\d,]*\])\S*\s+dot\((.*?)\),.*?lhs_contracting_dims=\{([\d,]*)\}")
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _computations(text):
    comps, name, entry = {}, None, None
    for line in text.splitlines():
        if name is None:
            match = _HEADER.match(line)
            if match and ("->" in line or line.startswith("ENTRY")):
                name = match.group(1)
                comps[name] = []
                entry = name if line.startswith("ENTRY") else entry
            continue
        if line.startswith("}"):
            name = None
            continue
        comps[name].append(line)
    return comps, entry


def _dims(text):
    match = _SHAPE.search(text)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def executed_flops(text: str) -> float:
    """Dot FLOPs per device of an optimized HLO module, loops times their trip counts."""
    comps, entry = _computations(text)
    shapes = {}
    for lines in comps.values():
        for line in lines:
            match = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+\[[\d,]*\])", line)
            if match:
                shapes[match.group(1)] = match.group(2)
    memo = {}

    def visit(name):
        if name in memo:
            return memo[name]
        total = 0.0
        for line in comps.get(name, ()):
            if " conditional(" in line:
                branches = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
                total += max(visit(b.strip().lstrip("%")) for b in branches.split(","))
                continue
            dot = _DOT.search(line)
            if dot and " dot(" in line:
                out = _dims(dot.group(1))
                lhs = dot.group(2).split(",")[0].strip()
                lhs_shape = _dims(lhs) if "[" in lhs else _dims(shapes[lhs.lstrip("%").split()[-1]])
                contract = [int(c) for c in dot.group(3).split(",") if c]
                total += 2 * math.prod(out) * math.prod(lhs_shape[c] for c in contract)
            if " while(" in line:
                body = re.search(r"body=%?([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
                if trips is None:
                    raise ValueError(f"a while loop without a known trip count in {name}")
                total += int(trips.group(1)) * visit(body)
            else:
                for callee in re.findall(r"(?:to_apply|calls)=%?([\w.\-]+)", line):
                    total += visit(callee)
        memo[name] = total
        return total

    return visit(entry)


def _flops(fn, *args):
    return executed_flops(nnx.jit(fn).lower(*args).compile().as_text())


MICROBATCH, SEQ = 2, 8


@functools.cache
def _action_flops(rest, names, layers):
    """(stack forward, stack VJP, head VJP) dot FLOPs per device of the unpipelined pieces
    of a `layers`-layer LM on a mesh of shape `rest` (pipeline axis 1); computed once per
    mesh and depth, shared by every schedule, residual mode and m measured on them."""
    one = jax.make_mesh(rest, names, devices=jax.devices()[: math.prod(rest)])
    ref = pm.LM(one, schedule="gpipe", m=1, layers=layers)
    x = jnp.zeros((MICROBATCH, SEQ, pm.FEATURES * 2))
    targets = jnp.zeros((MICROBATCH, SEQ), jnp.int32)
    stack, head = ref.pipe.stack, ref.head
    forward = _flops(lambda stack, x: stack(x), stack, x)
    vjp = _flops(nnx.grad(lambda stack, x: jnp.sum(stack(x)), argnums=(0, 1)), stack, x)

    def head_loss(head, y):
        total, count = pm.token_loss(head(y), targets, jnp.ones(targets.shape))
        return total / count

    head_flops = _flops(nnx.grad(head_loss, argnums=(0, 1)), head, x)
    return forward, vjp, head_flops


def measure(shape, names, schedule, m, v=1, residuals="recompute", stage_layers=None):
    """`dict(executed, lockstep, ideal)`: dot FLOPs per device of one training step.

    `stage_layers` (v = 1): uneven stages; every stage then runs the fullest
    stage's rows, so one F or B costs `max(stage_layers)` layers' (what the
    planner's `pipeline_imbalance` charges).
    """
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: math.prod(shape)])
    p = mesh.shape["pipeline"]
    layers = p * v if stage_layers is None else sum(stage_layers)
    rows = 1 if stage_layers is None else max(stage_layers)  # layers per chunk, run by all
    model = pm.LM(mesh, schedule=schedule, m=m, v=v, layers=layers, stage_layers=stage_layers)
    model.pipe.residuals = residuals
    tokens = jnp.zeros((MICROBATCH * m, SEQ), jnp.int32)
    executed = _flops(nnx.value_and_grad(pm.LM.loss), model, tokens, tokens)

    rest = tuple(1 if n == "pipeline" else s for n, s in zip(names, shape, strict=True))
    forward, vjp, head_flops = _action_flops(rest, tuple(names), layers)
    per_layer = rows / layers
    backward = vjp if residuals == "recompute" else vjp - forward
    cost = {F: forward * per_layer, B: backward * per_layer, HEAD: head_flops}
    table = lockstep_table(schedule, p, m, v)
    return dict(executed=executed, lockstep=table.work(cost), ideal=table.ideal(cost))


def main():  # pragma: no cover - the measurement behind the issue's table
    rows = []
    for shape, names in (((4, 2), ("pipeline", "model")), ((4, 1), ("pipeline", "model"))):
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
            for residuals in ("recompute", "stored"):
                for m in (4, 8, 16):
                    r = measure(shape, names, schedule, m, v, residuals)
                    rows.append((shape, schedule, residuals, m, r))
                    mesh = " x ".join(f"{n} {s}" for n, s in zip(names, shape, strict=True))
                    executed, lockstep, ideal = r["executed"], r["lockstep"], r["ideal"]
                    print(
                        f"| {mesh} | {schedule} | {residuals} | {m} | {executed / ideal:.2f} "
                        f"| {lockstep / ideal:.2f} | {executed / lockstep:.3f} |",
                        flush=True,
                    )


if __name__ == "__main__":  # pragma: no cover
    main()
