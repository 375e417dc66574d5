"""Generated differential test of sf.grouped_matmul against an explicit float64 loop over groups.

Hypothesis draws routings from the whole space the API accepts: group-size
distributions (balanced, Zipf-skewed, every row in one group, many empty groups,
uniform at random, no rows at all) x 1 to 256 groups x M from 0 rows, with and
without rows past the sum x K and N odd and even, up to 515 x rhs `[G, K, N]` or
`[G, N, K]` x a group offset or none (expert parallelism: rhs holds a drawn slice
of the groups) x sizes and offset traced or concrete x float32 / bfloat16 x the
implementations that run on CPU (None, i.e. CPU's default, xla, native_cpu).
Values and the vjp of a random cotangent (d lhs, d rhs) are compared with the
float64 oracle of `grouped_cases.exact` (float32: 1e-5 / 2e-5 plus the summation
slack) or by the bfloat16 rule against the reference implementation. A planted bug
in the path a user hits by default must be caught.
"""

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import native_cpu as extension
from shardfuse.kernels.grouped_matmul import base, native_cpu
from tests.differential.budget import assert_catches, budget_params, run
from tests.kernels.grouped_matmul.grouped_cases import (
    NAMES,
    Case,
    assert_matches,
    make_inputs,
    zipf_sizes,
)

pytestmark = pytest.mark.timeout(1200)

DIMS = (1, 7, 16, 33, 64, 129, 257, 515)


@dataclasses.dataclass(frozen=True)
class Drawn:
    case: Case
    implementation: str | None


@st.composite
def _sizes(draw, groups: int, rows: int):
    kind = draw(st.sampled_from(["balanced", "zipf", "one_group", "empty_groups", "random"]))
    if kind == "balanced":
        sizes = [rows // groups + (i < rows % groups) for i in range(groups)]
    elif kind == "zipf":
        sizes = list(zipf_sizes(groups, rows, seed=draw(st.integers(0, 99))))
    elif kind == "one_group":
        sizes = [0] * groups
        sizes[draw(st.integers(0, groups - 1))] = rows
    else:
        active = groups if kind == "random" else max(1, groups // 4)
        cuts = sorted(
            draw(st.lists(st.integers(0, rows), min_size=active - 1, max_size=active - 1))
        )
        parts = np.diff([0, *cuts, rows]).tolist()
        sizes = [0] * groups
        where = draw(st.permutations(range(groups)))[:active]
        for i, part in zip(where, parts, strict=True):
            sizes[i] = int(part)
    return tuple(sizes)


@st.composite
def drawn_cases(draw):
    groups = draw(st.sampled_from([1, 2, 3, 8, 64, 256]))
    M = draw(st.sampled_from([0, 1, 31, 97, 128, 300]))
    tail = draw(st.sampled_from([0, 0, 5])) if M > 5 else 0
    sizes = draw(_sizes(groups, M - tail))
    big = groups >= 64  # keep the reference (G x the FLOPs) quick
    K = draw(st.sampled_from(DIMS[:5] if big else DIMS))
    N = draw(st.sampled_from(DIMS[:5] if big or K > 129 else DIMS))
    local = offset = None
    if draw(st.booleans()):
        local = draw(st.integers(1, groups))
        offset = draw(st.integers(0, groups - local))
    case = Case(
        name="drawn",
        M=M,
        K=K,
        N=N,
        sizes=sizes,
        local=local,
        offset=offset,
        transpose=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "float32", "bfloat16"])),
        traced=draw(st.booleans()),
    )
    implementation = draw(st.sampled_from([None, "xla", "native_cpu"]))
    if implementation == "native_cpu" and not extension.status("cpu")[0]:
        implementation = None
    return Drawn(case, implementation)


def _run(case: Case, implementation, dtype: str, inputs=None):
    """`(out, d_lhs, d_rhs)` as numpy, in one jitted call."""
    inputs = make_inputs(case) if inputs is None else inputs
    lhs, rhs = (x.astype(dtype) for x in inputs[:2])
    sizes_const, offset_const = np.asarray(case.sizes, np.int32), case.offset

    def step(lhs, rhs, sizes, offset, cotangent):
        if not case.traced:
            sizes, offset = sizes_const, offset_const

        def f(lhs, rhs):
            return sf.grouped_matmul(
                lhs,
                rhs,
                sizes,
                group_offset=offset,
                transpose_rhs=case.transpose,
                implementation=implementation,
            )

        out, pullback = jax.vjp(f, lhs, rhs)
        return (out, *pullback(cotangent.astype(out.dtype)))

    offset = None if case.offset is None else jnp.int32(case.offset)
    got = jax.jit(step)(lhs, rhs, jnp.asarray(case.sizes, jnp.int32), offset, inputs.cotangent)
    return tuple(np.asarray(x) for x in got)


def check(drawn: Drawn):
    case = drawn.case
    label = f"{drawn.implementation} {case}"
    got = _run(case, drawn.implementation, case.dtype)
    for name, x in zip(NAMES, got, strict=True):
        assert np.isfinite(np.asarray(x, np.float32)).all(), f"{label}: {name} not finite"

    def references():
        inputs = make_inputs(case)
        rounded = inputs._replace(
            lhs=inputs.lhs.astype(case.dtype), rhs=inputs.rhs.astype(case.dtype)
        )
        return _run(case, "reference", "float32", rounded), _run(case, "reference", case.dtype)

    assert_matches(got, case, label, references)


@pytest.mark.parametrize("max_examples", budget_params(10, 60))
def test_grouped_matmul_matches_the_float64_loop(max_examples):
    run(check, drawn_cases(), max_examples)


def _plant_start_off_by_one(monkeypatch):
    """Every backend: the local groups start one row late under an offset."""
    local_groups = base.local_groups

    def late(group_sizes, group_offset, num_local, M):
        sizes, start = local_groups(group_sizes, group_offset, num_local, M)
        return sizes, None if start is None else jnp.minimum(start + 1, M)

    monkeypatch.setattr(base, "local_groups", late)


def _plant_weight_gradient_drops_a_row(monkeypatch):
    """CPU's default: the C++ weights' gradient misses the last row of each group."""

    def transposed(config, x, y, sizes, start, out_dtype):
        return native_cpu.transposed(config, x, y, jnp.maximum(sizes - 1, 0), start, out_dtype)

    monkeypatch.setattr(
        native_cpu, "_grouped_matmul", base.differentiable(native_cpu.forward, transposed)
    )


@pytest.mark.parametrize("plant", [_plant_start_off_by_one, _plant_weight_gradient_drops_a_row])
def test_generator_catches_a_planted_bug(plant, monkeypatch):
    if plant is _plant_weight_gradient_drops_a_row and not extension.status("cpu")[0]:
        pytest.skip("native_cpu not built")
    assert_catches(plant, check, drawn_cases(), 25, monkeypatch)
