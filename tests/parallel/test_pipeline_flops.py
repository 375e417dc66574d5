"""The compiled pipeline step executes the schedule IR's lockstep work, and no more.

Executed FLOPs: the dot ops of the optimized HLO, loops times their trip
counts (`pipeline_flops.executed_flops`), per device. The IR's lockstep work
(`schedule.lockstep_work`) comes from per-action costs counted apart, on the
unpipelined pieces (one chunk's forward and VJP, the head's VJP): the
program's executed FLOPs must be within 1.1x of it for every schedule, on a
pure pipeline mesh, pipeline x model (tensor parallel collectives inside the
stage and the head) and pipeline x sequence x model, with recomputed and
stored residuals, at m = p, 2p and 4p (`-m slow` runs the rows that cover
every pair of mesh, schedule, residuals and m, `tests/pairwise.py`;
SHARDFUSE_FULL_MATRIX=1 runs all 72 cells; the quick suite keeps one
pipeline x model case). Before the lockstep executor, pipeline 4 x model 2
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
