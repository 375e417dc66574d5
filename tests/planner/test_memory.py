"""Predicted per-device memory vs the compiled training step's, on 8 CPU devices.

The model and step are those of `examples/plan_and_train.py`: the trainer of
`examples/train_lm.py` (`shardfuse.train.Trainer`: a Llama-style LM
of `sf.layers.ParallelTransformerBlock`s in an `sf.layers.Stack` with the
plan's remat policy, ZeRO through the layers and `sf.parallel.ZeroOptimizer`,
AdamW, gradient accumulation or `sf.parallel.Pipeline` over the plan's
microbatches) configured from a plan (`from_plan`), compiled from abstract
parameters and optimizer state (`shardfuse.train.step_memory`: the same bytes as
the real trainer's step, a test below checks, without building the arrays; about
1 s less per configuration). For every configuration
of the grid (mesh shapes over pipeline, data, fsdp, sequence and model;
ZeRO 0-3; remat policies; accumulation and pipeline microbatches; pipeline
schedules) the planner's predicted memory per device (`Plan.memory_bytes`,
with the CPU run's assumptions: float32, outputs not donated) must be within
15% of the compiled step's `memory_analysis()` (arguments + outputs + temp),
and the ranking of the configurations by memory must agree (Spearman >= 0.9).
Compiling takes 4-15 s per configuration on the 2-core machine, so the grid
runs under `-m slow`, and there only SAMPLE: 23 of the 42 that hold every value of
every factor (all of GRID with SHARDFUSE_FULL_MATRIX=1); one configuration runs in
the default suite.

`python tests/planner/test_memory.py [CONFIG ...]` prints the table.
"""

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan_and_train.py"
_spec = importlib.util.spec_from_file_location("plan_and_train", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

TOLERANCE = 0.15
# (pipeline, data, fsdp, sequence, model), zero, remat, microbatches, schedule, virtual stages
GRID = [
    ((1, 8, 1, 1, 1), 0, "none", 1, "1f1b", 1),
    ((1, 8, 1, 1, 1), 0, "full", 1, "1f1b", 1),
    ((1, 4, 1, 1, 2), 0, "none", 1, "1f1b", 1),
    ((1, 4, 1, 1, 2), 0, "full", 1, "1f1b", 1),
    ((1, 2, 1, 2, 2), 0, "none", 1, "1f1b", 1),
    ((1, 2, 1, 2, 2), 0, "full", 1, "1f1b", 1),
    ((1, 1, 1, 2, 4), 0, "none", 1, "1f1b", 1),
    ((1, 1, 1, 2, 4), 0, "full", 1, "1f1b", 1),
    ((1, 2, 1, 1, 4), 0, "none", 1, "1f1b", 1),
    ((1, 1, 1, 1, 8), 0, "none", 1, "1f1b", 1),
    ((1, 1, 1, 1, 8), 0, "full", 1, "1f1b", 1),
    ((1, 4, 1, 2, 1), 0, "none", 1, "1f1b", 1),
    ((1, 4, 1, 2, 1), 0, "full", 1, "1f1b", 1),
    ((1, 2, 1, 2, 2), 0, "selective", 1, "1f1b", 1),
    ((1, 2, 1, 2, 2), 0, "dots", 1, "1f1b", 1),
    ((1, 8, 1, 1, 1), 0, "selective", 1, "1f1b", 1),
    ((1, 1, 1, 1, 8), 0, "dots", 1, "1f1b", 1),
    ((1, 8, 1, 1, 1), 0, "none", 2, "1f1b", 1),
    ((1, 2, 1, 1, 4), 0, "none", 2, "1f1b", 1),
    ((1, 4, 1, 1, 2), 0, "full", 2, "1f1b", 1),
    ((1, 2, 4, 1, 1), 3, "none", 1, "1f1b", 1),
    ((1, 2, 4, 1, 1), 3, "full", 1, "1f1b", 1),
    ((1, 1, 4, 1, 2), 3, "full", 1, "1f1b", 1),
    ((1, 1, 8, 1, 1), 3, "none", 1, "1f1b", 1),
    ((1, 4, 2, 1, 1), 3, "selective", 1, "1f1b", 1),
    ((1, 2, 4, 1, 1), 1, "none", 1, "1f1b", 1),
    ((1, 2, 4, 1, 1), 2, "none", 1, "1f1b", 1),
    ((1, 2, 4, 1, 1), 2, "full", 1, "1f1b", 1),
    ((1, 1, 4, 1, 2), 2, "selective", 1, "1f1b", 1),
    ((1, 4, 2, 1, 1), 1, "none", 2, "1f1b", 1),
    ((1, 4, 2, 1, 1), 2, "none", 2, "1f1b", 1),
    ((2, 4, 1, 1, 1), 0, "none", 2, "1f1b", 1),
    ((2, 4, 1, 1, 1), 0, "full", 2, "1f1b", 1),
    ((2, 4, 1, 1, 1), 0, "none", 4, "1f1b", 1),
    ((2, 4, 1, 1, 1), 0, "none", 4, "gpipe", 1),
    ((2, 4, 1, 1, 1), 0, "full", 4, "gpipe", 1),
    ((2, 4, 1, 1, 1), 0, "none", 4, "zb-h1", 1),
    ((2, 4, 1, 1, 1), 0, "none", 4, "interleaved", 2),
    ((2, 2, 1, 1, 2), 0, "full", 2, "1f1b", 1),
    ((4, 2, 1, 1, 1), 0, "none", 4, "1f1b", 1),
    ((4, 2, 1, 1, 1), 0, "none", 8, "gpipe", 1),
    ((2, 2, 2, 1, 1), 3, "full", 2, "1f1b", 1),
]
DEFAULT = ((1, 8, 1, 1, 1), 0, "full", 1, "1f1b", 1)
# What `-m slow` compiles: 23 of GRID's 42 (about 170 of 285 s alone on the 2-core machine),
# every value of every factor among them (`_factor_values` checks): each mesh axis and the
# three-axis meshes, pipeline x model and pipeline x ZeRO-3, ZeRO 0-3, the four remat
# policies, 1/2/4/8 microbatches, the four schedules at P = 2 and 1F1B and GPipe at P = 4,
# the ratios nearest the tolerance (0.87, 1.12, 1.14) and the misses that
# `memory._backward_ticks_outside_loops` and `input_gradient` fixed (below). Left to a run
# by hand (SHARDFUSE_FULL_MATRIX=1, or the table: `python tests/planner/test_memory.py`):
# the rest of GRID, each a mesh and option that a kept row has with another partner.
SAMPLE = [GRID[i] for i in (0, 1, 4, 7, 10, 11, 13, 16, 19, 21, 22, 23, 24, 25, 27, 30, 31,
                            36, 37, 38, 39, 40, 41)]  # fmt: skip


def _factor_values(cases):
    """Each factor's values among `cases`: the axes used (size > 1), how many axes a mesh
    mixes, the pipeline sizes, ZeRO, remat, microbatches, schedule and virtual stages."""
    axes = ("pipeline", "data", "fsdp", "sequence", "model")
    options = ("zero", "remat", "microbatches", "schedule", "virtual")
    values = {name: {case[i] for case in cases} for i, name in enumerate(options, start=1)}
    values["axis"] = {a for case in cases for a, n in zip(axes, case[0], strict=True) if n > 1}
    values["axes mixed"] = {sum(n > 1 for n in case[0]) for case in cases}
    values["pipeline"] = {case[0][0] for case in cases}
    return values


def _plan(case):
    """The plan of `case`: the search restricted to its mesh and options."""
    (pipeline, data, fsdp, sequence, model), zero, remat, micro, schedule, virtual = case
    mesh = dict(pipeline=pipeline, data=data, fsdp=fsdp, sequence=sequence, model=model)
    plans = example.plan_for_cpu(mesh=mesh, zero=zero, remat=remat, schedule=schedule,
                                 microbatch_size=example.GLOBAL_BATCH // (data * fsdp * micro),
                                 top_k=1000)  # fmt: skip
    found = [p for p in plans if p.parallelism.options.virtual_stages == virtual]
    assert found, f"the planner returned no plan for {case}"
    return found[0]


def _compiled_bytes(plan):
    """arguments + outputs + temp of the compiled training step, per device.

    Attention runs the `xla` kernel, whose backward tiles (XLA temporaries) the planner
    models (`planner.memory.attention_tiles`): the trainer's step calls attention on
    operands XLA partitions over the mesh, where CPU's default `native_cpu` declines (it
    runs per device, inside shard_map). `native_cpu` keeps its tiles in its own buffers
    outside XLA's accounting (DEFAULT's compiled bytes 4.64 MB against 5.41 MB with xla),
    which the planner does not model.
    """
    m = _memory_analysis(plan, abstract=True)
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def _memory_analysis(plan, abstract):
    """The plan's training step's `memory_analysis()`: from abstract state
    (`shardfuse.train.step_memory`, no parameters allocated) or a real `Trainer`."""
    from shardfuse.kernels.attention import api
    from shardfuse.train import Trainer, from_plan, step_memory

    config = from_plan(example.config(), plan)
    saved = api.PREFERENCE["cpu"]
    api.PREFERENCE["cpu"] = ("xla",)
    try:
        if abstract:
            return step_memory(config)
        return Trainer(config, log=lambda line: None).memory_analysis()
    finally:
        api.PREFERENCE["cpu"] = saved


_RESULTS = {}  # case -> (predicted, compiled), shared by the grid and the ranking test


def _predicted_and_compiled(case):
    if case not in _RESULTS:
        plan = _plan(case)
        _RESULTS[case] = (plan.memory_bytes, _compiled_bytes(plan))
    return _RESULTS[case]


def _row(case):
    predicted, compiled = _predicted_and_compiled(case)
    return (f"{str(case):48} predicted {predicted / 1e6:7.3f} MB  "
            f"compiled {compiled / 1e6:7.3f} MB  ratio {predicted / compiled:.3f}")  # fmt: skip


def _check(case):
    predicted, compiled = _predicted_and_compiled(case)
    print(_row(case), flush=True)
    assert predicted == pytest.approx(compiled, rel=TOLERANCE), _row(case)


def _spearman(a, b):
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731  (no ties in practice)
    return float(np.corrcoef(rank(np.asarray(a)), rank(np.asarray(b)))[0, 1])


def test_one_configuration_within_tolerance():
    _check(DEFAULT)


@pytest.mark.parametrize("case", [DEFAULT, ((2, 2, 2, 1, 1), 3, "full", 2, "1f1b", 1)])
def test_abstract_step_memory_is_the_trainers(case):
    """`step_memory` (abstract state: what the grid compiles) and the real `Trainer`'s
    compiled step agree byte for byte, on data parallelism and on pipeline x ZeRO-3."""
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
    plan = _plan(case)
    abstract, real = (_memory_analysis(plan, abstract=a) for a in (True, False))
    assert [getattr(abstract, f) for f in fields] == [getattr(real, f) for f in fields]


# Known misses: none. The pipeline 2 x data 4 misses without remat (1F1B at m = 2 and 4,
# zb-h1 at m = 4: 0.66-0.73 before `memory._backward_ticks_outside_loops`) were the drain's
# one B tick, scanned alone: XLA inlines the one-iteration scan and allocates its
# recomputed chunk's residual buffers at the start of the step, live beside the
# steady-state loop's (0.91-0.92 now). The model = 8 mesh with remat "full" (0.81 on jax
# 0.12 and on 0.10.2's IR emitters, which the suite uses: tests/conftest.py) missed the
# embedded batch's gradient, a [16, 128, 64] float32 buffer that XLA allocates at the
# step's start (the `input_gradient` term: 0.92 now; 0.10.2's fusion emitters write it in
# place, 1.03).
MISSES = {}


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_memory_grid_within_tolerance_and_ranking_agrees():
    """Every configuration of SAMPLE (of GRID with SHARDFUSE_FULL_MATRIX=1) within TOLERANCE
    (MISSES outside it), and the ranking.

    One test compiles each configuration once for both claims: as separate tests under
    `pytest -n 2` the ranking test compiled again, on its worker, every configuration
    that the other worker's grid tests had compiled (158 s of the 457 s in CI).
    """
    cases = GRID if os.environ.get("SHARDFUSE_FULL_MATRIX") == "1" else SAMPLE
    assert len(cases) >= 20 and set(cases) <= set(GRID) and len(set(cases)) == len(cases)
    assert _factor_values(cases) == _factor_values(GRID)
    pairs = [_predicted_and_compiled(case) for case in cases]
    rho = _spearman([p for p, _ in pairs], [c for _, c in pairs])
    table = "\n".join(_row(case) for case in cases) + f"\nSpearman {rho:.3f}"
    print(table)
    within = {
        case: p == pytest.approx(c, rel=TOLERANCE)
        for case, (p, c) in zip(cases, pairs, strict=True)
    }
    wrong = [_row(case) for case in cases if within[case] == (case in MISSES)]
    assert not wrong, "outside the tolerance, or a known miss that now holds (update MISSES):\n" + (
        "\n".join(wrong)
    )
    assert rho >= 0.9, table


@pytest.mark.slow
def test_the_example_trains_from_its_plan():
    """examples/plan_and_train.py: the best plan's mesh and options train the model."""
    best = example.plan_for_cpu()[0]
    losses = example.train(best, steps=15, log=lambda line: None)
    assert np.all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 1.0, losses


if __name__ == "__main__":  # the table: python tests/planner/test_memory.py [CASE ...]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    cases = [eval(arg) for arg in sys.argv[1:]] or GRID
    for case in cases:
        print(_row(case), flush=True)
