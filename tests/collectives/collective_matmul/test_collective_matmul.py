"""Collective matmuls vs JAX's own collectives in the same shard_map: forward and vjp.

Oracles: `lax.all_gather(x) @ w`, `lax.psum_scatter(x @ w)`, `lax.psum(x @ w)`,
HIGHEST precision for float32; bfloat16 by the low-precision rule of TESTING.md.
"""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from shardfuse.testing import assert_close, assert_close_low_precision
from tests.collectives.collective_matmul.common import Case, run_with_oracle, upcast_oracle

pytestmark = pytest.mark.timeout(300)

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
NAMES = ("y", "dx", "dw")


def _check_float32(case, implementation, **kwargs):
    got, expected = run_with_oracle(case, implementation, **kwargs)
    x_spec, w_spec, out_spec = case.specs()
    expected_sharding = NamedSharding(case.mesh, out_spec)
    assert got[0].sharding.is_equivalent_to(expected_sharding, got[0].ndim), got[0].sharding
    for name, g, e in zip(NAMES, got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, (name, g.shape, e.shape)
        assert_close(g, e, kind="output" if name == "y" else "grad", name=f"{case} {name}")


RING_CASES = (
    [
        Case(op, n, bidirectional=bidirectional)
        for op in OPS
        for n, bidirectional in (
            (1, False),
            (2, False),
            (2, True),
            (4, False),
            (4, True),
            (8, False),
        )
    ]
    + [pytest.param(Case(op, 8, bidirectional=True), marks=pytest.mark.slow) for op in OPS]
    + [Case(op, 4, layout="rows", bidirectional=True, m=5) for op in OPS]
    + [
        Case(op, 2, bidirectional=True, m=1)
        for op in OPS  # halves of 1 row: one direction
    ]
)


@pytest.mark.parametrize("case", RING_CASES, ids=Case.id)
def test_ring_float32(case):
    _check_float32(case, "xla")


@pytest.mark.parametrize(
    "case",
    [Case("matmul_all_reduce", n) for n in (1, 2, 4, 8)]
    + [Case("matmul_all_reduce", 4, layout="rows", extra_rows=1)],  # no divisible axis: psum
    ids=Case.id,
)
def test_all_reduce_float32(case):
    _check_float32(case, "xla")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_two_dimensional_mesh(op):
    """Ring over "model" of a (data=2, model=4) mesh; w is replicated over "data"."""
    _check_float32(Case(op, 4, data=2, bidirectional=True), "xla")


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
def test_bfloat16(op):
    case = Case(op, 4, bidirectional=True, dtype="bfloat16", c=16, f=16)
    got, ref_lp = run_with_oracle(case, "xla")
    ref32 = upcast_oracle(case)
    for name, g, r32, rlp in zip(NAMES, got, ref32, ref_lp, strict=True):
        assert g.dtype == rlp.dtype
        kind = "output" if name == "y" else "grad"
        assert_close_low_precision(g, r32, rlp, kind=kind, name=f"{case} {name}")


def test_reference_implementation_matches_lax():
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        _check_float32(Case(op, 2), "reference")


def test_deterministic():
    case = Case("matmul_reduce_scatter", 4, bidirectional=True)
    x, w, cotangent = case.placed(*case.inputs())
    f = case.sharded(case.call("xla"))
    run = jax.jit(lambda x, w, ct: (f(x, w), jax.vjp(f, x, w)[1](ct)))
    first, second = run(x, w, cotangent), run(x, w, cotangent)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_empty_batch(op):
    case = dataclasses.replace(Case(op, 2), data=1)
    x, w, _ = case.inputs()
    x = x[:0]
    x, w = case.placed(x, w)
    y = case.sharded(case.call("xla"))(x, w)
    assert y.shape[0] == 0


def test_default_implementation_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    _check_float32(Case("all_gather_matmul", 2), None)
