"""The schedule IR: golden tables, dependencies, action counts, bubbles, memory, bad input."""

import itertools

import numpy as np
import pytest

from shardfuse.parallel.pipeline.lockstep import lockstep_table, lockstep_work
from shardfuse.parallel.pipeline.schedule import (
    HEAD,
    IDLE,
    SCHEDULES,
    B,
    F,
    W,
    closed_form_bubble,
    schedule_table,
)

GOLDEN_1F1B_P4_M8 = """\
tick     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21
stage 0 F0 F1 F2 F3  .  .  . B0 F4 B1 F5 B2 F6 B3 F7 B4  . B5  . B6  . B7
stage 1  . F0 F1 F2  .  . B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5  . B6  . B7  .
stage 2  .  . F0 F1  . B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6  . B7  .  .
stage 3  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7  .  .  ."""

GOLDEN_INTERLEAVED_P2_M4_V2 = """\
tick       0    1    2    3    4    5    6    7    8    9   10   11   12   13   14   15   16   17
stage 0 F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0    . B2.1    . B3.1 B2.0 B3.0
stage 1    . F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0    ."""

# Qi et al. 2023, figure 3 (ZB-H1): W fills the 1F1B cool-down, p - 1 idle ticks per stage
GOLDEN_ZB_H1_P4_M8 = """\
tick     0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
stage 0 F0 F1 F2 F3  .  .  . B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
stage 1  . F0 F1 F2  .  . B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
stage 2  .  . F0 F1  . B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
stage 3  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"""

GOLDEN_GPIPE_P2_M2 = """\
tick     0  1  2  3  4  5
stage 0 F0 F1  .  . B0 B1
stage 1  . F0 F1 B0 B1  ."""


def _cases():
    for schedule, p in itertools.product(SCHEDULES, (2, 4)):
        for m in (p, 2 * p, 4 * p):
            for v in (2, 3) if schedule == "interleaved" else (1,):
                yield schedule, p, m, v


def test_golden_tables():
    assert schedule_table("1f1b", 4, 8).grid() == GOLDEN_1F1B_P4_M8
    assert schedule_table("interleaved", 2, 4, 2).grid() == GOLDEN_INTERLEAVED_P2_M4_V2
    assert schedule_table("gpipe", 2, 2).grid() == GOLDEN_GPIPE_P2_M2
    assert schedule_table("zb-h1", 4, 8).grid() == GOLDEN_ZB_H1_P4_M8


@pytest.mark.parametrize("schedule, p, m, v", list(_cases()))
def test_table_properties(schedule, p, m, v):
    table = schedule_table(schedule, p, m, v)
    when = {}
    for t, s in zip(*np.nonzero(table.kind != IDLE), strict=True):
        key = (int(table.kind[t, s]), int(table.microbatch[t, s]), int(table.chunk[t, s]), int(s))
        assert key not in when, f"{key} runs twice"
        when[key] = int(t)
    kinds = (F, B, W) if schedule == "zb-h1" else (F, B)
    # every microbatch through every chunk of every stage: once per kind
    for kind in kinds:
        assert sum(1 for k in when if k[0] == kind) == m * v * p
    assert not np.any(table.kind == W) or schedule == "zb-h1"
    for i, c, s in itertools.product(range(m), range(v), range(p)):
        vs = c * p + s
        assert when[(F, i, c, s)] < when[(B, i, c, s)]  # F before B on each stage
        if schedule == "zb-h1":
            assert when[(B, i, c, s)] < when[(W, i, c, s)]
        if vs + 1 < p * v:  # F of virtual stage k before F of k + 1, B the other way
            nc, ns = divmod(vs + 1, p)
            assert when[(F, i, c, s)] < when[(F, i, nc, ns)]
            assert when[(B, i, nc, ns)] < when[(B, i, c, s)]
    # the simulated bubble equals the closed form
    assert table.bubble == pytest.approx(closed_form_bubble(schedule, p, m, v), abs=1e-12)


@pytest.mark.parametrize("p", [2, 4])
def test_in_flight_bounded_by_p_except_gpipe(p):
    for m in (p, 2 * p, 4 * p, 8 * p):
        assert list(schedule_table("1f1b", p, m).in_flight()) == [p - s for s in range(p)]
        # zb-h1: every stage may hold p (deferred W), 1F1B's peak on stage 0: same buffers
        assert list(schedule_table("zb-h1", p, m).in_flight()) == [p] * p
        assert schedule_table("zb-h1", p, m).buffer_slots == p
        assert schedule_table("1f1b", p, m).buffer_slots == p
        assert max(schedule_table("gpipe", p, m).in_flight()) == m
    # interleaved: flat in m once m >= 2p (Megatron's warm-up of 2(p-s-1) + (v-1)p forwards)
    peaks = {m: max(schedule_table("interleaved", p, m, 2).in_flight()) for m in (2 * p, 8 * p)}
    assert peaks[2 * p] == peaks[8 * p] <= 3 * p


def test_closed_forms():
    assert closed_form_bubble("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert closed_form_bubble("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert schedule_table("1f1b", 4, 8).bubble == pytest.approx(0.2727, abs=1e-4)
    # zero bubble (Qi et al. 2023, ZB-H1): p - 1 idle ticks per stage, a third of 1F1B's in
    # the same units (F, B, W one tick each: 1F1B's B is two, 3m + 3(p - 1) ticks)
    for p, m in ((2, 2), (4, 4), (4, 8), (4, 16), (8, 8)):
        zb = schedule_table("zb-h1", p, m)
        assert zb.num_ticks == 3 * m + p - 1, (p, m)
        assert zb.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
        assert list(np.sum(zb.kind == 0, axis=0)) == [p - 1] * p


def test_forward_only_tables():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
        table = schedule_table(schedule, 4, 8, v, forward_only=True)
        assert set(np.unique(table.kind)) <= {IDLE, F}
        assert np.sum(table.kind == F) == 8 * v * 4
        assert table.num_ticks == v * 8 + 4 - 1


def test_json_figures():
    figures = schedule_table("1f1b", 2, 4).to_dict()
    assert figures["ticks"] == 10 and figures["bubble"] == pytest.approx(0.2)
    assert figures["peak_in_flight"] == [2, 1]
    assert figures["actions"][1][:3] == [".", "F0", "B0"]


@pytest.mark.parametrize(
    "args, match",
    [
        (("pipedream", 2, 4, 1), "schedule='pipedream' must be one of"),
        (("1f1b", 4, 2, 1), r"num_microbatches=2 must be >= the number of pipeline stages p=4"),
        (("interleaved", 2, 3, 2), r"num_microbatches=3 must be a multiple of .* p=2"),
        (("1f1b", 2, 4, 2), "virtual_stages=2 needs schedule='interleaved'"),
        (("interleaved", 2, 4, 1), "needs virtual_stages >= 2"),
        (("gpipe", 0, 4, 1), "num_stages=0 must be a positive integer"),
        (("gpipe", 2, 2.5, 1), "num_microbatches=2.5 must be a positive integer"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        schedule_table(*args)


# --- The lockstep table the executor runs ---------------------------------------------------


@pytest.mark.parametrize("schedule, p, m, v", list(_cases()))
def test_lockstep_table_dependencies_and_work(schedule, p, m, v):
    table = lockstep_table(schedule, p, m, v)
    when = {}  # (kind, microbatch, virtual stage) -> tick
    for kind, slot in ((F, table.forward), (B, table.backward)):
        for t, s in zip(*np.nonzero(slot[..., 0] >= 0), strict=True):
            i, c = (int(a) for a in slot[t, s])
            key = (kind, i, c * p + int(s))
            assert key not in when, f"{key} runs twice"
            when[key] = int(t)
    assert len(when) == 2 * m * v * p  # every microbatch through every virtual stage, F and B
    last = v * p - 1
    for i, k in itertools.product(range(m), range(v * p)):
        # F on k one tick after F on k - 1 (the activation sent at the end of a tick);
        # B on the last virtual stage in its F's tick (F, head, then B), else one tick after
        # B on k + 1
        if k > 0:
            assert when[(F, i, k)] >= when[(F, i, k - 1)] + 1
        if k == last:
            assert when[(B, i, k)] >= when[(F, i, k)]
        else:
            assert when[(B, i, k)] >= when[(B, i, k + 1)] + 1
            assert when[(B, i, k)] > when[(F, i, k)]
    # the ring buffers: microbatches sharing a slot never overlap (stage input held F..B)
    slots = table.buffer_slots
    for k in range(v * p):
        for i in range(m - slots):
            arrive = when[(F, i + slots, k - 1)] + 1 if k > 0 else when[(F, i + slots, 0)]
            assert arrive > when[(B, i, k)]
    # lockstep work: the largest stage per tick equals the slots in use (same code on every
    # stage); (v m + p - 1) ticks of F and B and m heads
    cost = {F: 1.0, B: 2.5, W: 0.5, HEAD: 0.7}
    active = table.active()
    uniform = float((active @ np.array([1.0, 0.7, 3.0])).sum())
    assert table.work(cost) == pytest.approx(uniform)
    assert table.work(cost) == pytest.approx((v * m + p - 1) * 4.0 + m * 0.7)
    assert lockstep_work(schedule, p, m, v, cost=cost) == pytest.approx(table.work(cost))
    assert table.ideal(cost) == pytest.approx(m * v * 4.0 + m * 0.7)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_lockstep_bounds(p):
    cost = {F: 1.0, B: 2.0, HEAD: 0.3}
    ratio = {}
    for m in (p, 2 * p, 4 * p):
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)):
            table = lockstep_table(schedule, p, m, v)
            ratio[schedule, m] = table.work(cost) / table.ideal(cost)
        # at most GPipe's (m + p - 1) / m: the fill and drain are the only waste
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            assert ratio[schedule, m] <= (m + p - 1) / m + 1e-12
        assert ratio["interleaved", m] < ratio["1f1b", m]
    # zb-h1 runs as 1F1B (its W inside B): equal, not below (see the executor's docstring)
    assert ratio["zb-h1", 4 * p] == pytest.approx(ratio["1f1b", 4 * p])
    # in flight: a tick holds an F and a B, so stage s holds 2 (p - 1 - s) + 1 (1F1B's p - s
    # doubled, less one); GPipe all m
    for m in (2 * p, 8 * p):
        want = [min(m, 2 * (p - 1 - s) + 1) for s in range(p)]
        assert list(lockstep_table("1f1b", p, m).in_flight()) == want
        assert max(lockstep_table("gpipe", p, m).in_flight()) == m


def test_lockstep_forward_only_and_grid():
    table = lockstep_table("interleaved", 2, 4, 2, forward_only=True)
    assert np.all(table.backward == -1) and table.num_ticks == 2 * 4 + 2 - 1
    assert not table.active()[:, 1:].any()  # no head, no B
    assert lockstep_table("1f1b", 2, 3).grid().splitlines()[1].split() == [
        "stage", "0", "F0/.", "F1/.", "F2/B0", "./B1", "./B2",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="must give the cost of F"):
        lockstep_table("1f1b", 2, 2).work({F: 1.0})
    with pytest.raises(ValueError, match="num_microbatches=1 must be >="):
        lockstep_table("1f1b", 2, 1)
