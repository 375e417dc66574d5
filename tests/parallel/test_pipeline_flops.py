"""The compiled pipeline step executes the schedule IR's lockstep work, and no more.

Executed FLOPs: the dot ops of the optimized HLO, loops times their trip
counts (`pipeline_flops.executed_flops`), per device. The IR's lockstep work
(`lockstep.lockstep_work`) comes from per-action costs counted apart, on the
unpipelined pieces (one chunk's forward and VJP, the head's VJP): the
program's executed FLOPs must be within 1.1x of it for every schedule, on a
pure pipeline mesh, pipeline x model (tensor parallel collectives inside the
stage and the head) and pipeline x sequence x model, with recomputed and
stored residuals, at m = p, 2p and 4p (`-m slow` runs the rows that cover
every pair of mesh, schedule, residuals and m, `tests/pairwise.py`;
SHARDFUSE_FULL_MATRIX=1 runs all 72 cells; the quick suite keeps one
pipeline x model case); uneven stages likewise, one F or B costing the
fullest stage's layers. Before the lockstep executor, pipeline 4 x model 2
executed 2.3-3.4x the busiest stage's work (every tick ran the stage
forward twice, the whole VJP and the head).
"""

import pytest

from tests.pairwise import pairwise
from tests.parallel.pipeline_flops import measure

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
MESHES = (
    ((4, 1), ("pipeline", "model")),
    ((4, 2), ("pipeline", "model")),
    ((2, 2, 2), ("pipeline", "sequence", "model")),
)


def _grid():
    for (shape, names), (schedule, v), residuals, per_stage in pairwise(
        MESHES, SCHEDULES, ("recompute", "stored"), (1, 2, 4)
    ):
        yield shape, names, schedule, v, residuals, per_stage * shape[0]


def _check(shape, names, schedule, v, residuals, m):
    r = measure(shape, names, schedule, m, v, residuals)
    assert r["lockstep"] / 1.1 <= r["executed"] <= 1.1 * r["lockstep"], r
    p = shape[0]
    if schedule in ("gpipe", "1f1b", "zb-h1"):  # the IR: at most GPipe's bubble
        assert r["lockstep"] <= (m + p - 1) / m * r["ideal"] * (1 + 1e-9), r


def test_pipeline_model_executes_the_lockstep_work():
    _check((2, 2), ("pipeline", "model"), "1f1b", 1, "recompute", 2)


@pytest.mark.slow
@pytest.mark.parametrize("shape, names, schedule, v, residuals, m", list(_grid()))
def test_every_schedule_executes_the_lockstep_work(shape, names, schedule, v, residuals, m):
    _check(shape, names, schedule, v, residuals, m)


@pytest.mark.parametrize(
    "shape, names, stage_layers, m",
    [
        ((2, 2), ("pipeline", "model"), (2, 1), 2),
        pytest.param((4, 1), ("pipeline", "model"), (3, 2, 2, 1), 8, marks=pytest.mark.slow),
    ],
)
def test_uneven_stages_execute_the_fullest_stage_in_every_tick(shape, names, stage_layers, m):
    """Uneven stages (`Stack(stage_layers=...)`): every stage runs the fullest stage's rows
    (padding computed and discarded) and the head's ticks, so the step executes the IR's
    lockstep work with one F or B costing `max(stage_layers)` layers, whatever the split;
    the balancer's split for a head as heavy as two layers, (3, 2, 2, 1), executes 1.48x the
    even split's (2, 2, 2, 2) (docs/pipeline.md: its extras model stages that run apart)."""
    r = measure(shape, names, "1f1b", m, stage_layers=stage_layers)
    assert r["lockstep"] / 1.1 <= r["executed"] <= 1.1 * r["lockstep"], r
    if len(stage_layers) == 4:
        even = measure(shape, names, "1f1b", m, stage_layers=(2, 2, 2, 2))
        assert r["executed"] > 1.3 * even["executed"], (r, even)
