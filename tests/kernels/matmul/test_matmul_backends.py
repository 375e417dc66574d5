"""One test body for every matmul implementation: the TESTING.md matrix.

Parametrized over `matmul_cases.BACKENDS` (xla; pallas_tpu in TPU interpret
mode; triton under the Triton interpreter on CPU, and through jax-triton on a
GPU, marked `gpu`) and over each backend's budget of `matmul_cases.CASES`.
What a backend's capability flags exclude is skipped with the reason, and
`test_refuses_what_its_flags_exclude` checks that the implementation really
raises NotImplementedError there.

- the output and the gradients of a, b, addend and bias (vjp with a random
  cotangent): float32 at atol = rtol = 1e-5 (2e-5 gradients), plus the
  summation slack of each entry's terms, against the exact result (float64,
  `exact_results`; the reference implementation is held to it too), bfloat16 /
  float16 by the 2x / 3x rule against the reference in float32 and in the low
  precision; finite on both sides; dtypes and shapes;
- determinism: a second run under jit is bitwise equal.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.testing import F32_TOLERANCE, assert_close, assert_close_low_precision
from tests.kernels.backend_params import backend_params
from tests.kernels.matmul.matmul_cases import (
    BACKENDS,
    CASE,
    exact_results,
    make_inputs,
    results,
    run,
)

NAMES = ("out", "da", "db", "daddend", "dbias")


def _params(names_of, **options):
    return backend_params(BACKENDS, CASE, names_of, **options)


@pytest.mark.parametrize(
    "backend, case", _params(lambda backend: (*backend.default, *backend.slow))
)
def test_matches_reference(backend, case):
    backend.require()
    got = results(backend.name, case.name)
    expected = results("reference", case.name)
    label = f"{backend.name} {case.name}"
    out_shape = (*case.shape_a[:-1], case.N)
    assert got[0].shape == out_shape, f"{label}: out shape {got[0].shape} != {out_shape}"
    assert got[0].dtype == jnp.dtype(case.out_dtype or case.dtype), (label, got[0].dtype)
    present = [i for i, x in enumerate(expected) if x is not None]
    assert [x is not None for x in got] == [x is not None for x in expected], label
    for i in present:
        # Gradients keep their primal's dtype, as the reference's do.
        assert got[i].dtype == expected[i].dtype, (label, NAMES[i], got[i].dtype)
        for side, x in (("got", got[i]), ("reference", expected[i])):
            finite = np.isfinite(np.asarray(x, np.float32))
            assert finite.all(), f"{label}: {side} {NAMES[i]} has non-finite entries"
    kinds = ["output"] + ["grad"] * 4
    if case.dtype == "float32":
        exact, slack = exact_results(case.name)
        for i in present:
            atol = F32_TOLERANCE[kinds[i]] + slack[i]
            assert_close(got[i], exact[i], atol=atol, kind=kinds[i], name=f"{label} {NAMES[i]}")
        return
    ref32 = results("reference", case.name, "float32")
    ref_lp = results("reference", case.name, "low")
    for i in present:
        # Gradients are sums over M (or N) and grow with it: the cap scales with their size.
        assert_close_low_precision(
            got[i],
            ref32[i],
            ref_lp[i],
            kind=kinds[i],
            name=f"{label} {NAMES[i]}",
            relative_cap=i > 0,
        )


@pytest.mark.parametrize("backend, case", _params(lambda backend: backend.deterministic))
def test_deterministic_under_jit(backend, case):
    backend.require()
    first = results(backend.name, case.name)
    second = run(backend, case, make_inputs(case), case.dtype, case.out_dtype)
    for name, a, b in zip(NAMES, first, second, strict=True):
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=f"{backend.name}: {name} differs")


@pytest.mark.parametrize(
    "backend, case", _params(lambda backend: CASE, tiered=False, only_unsupported=True)
)
def test_refuses_what_its_flags_exclude(backend, case):
    """Where a flag says no, the implementation raises NotImplementedError (dispatch falls back)."""
    backend.require()
    a = jnp.zeros(case.shape_a, case.dtype)
    b = jnp.zeros((case.shape_a[-1], case.N), case.dtype)
    addend = jnp.zeros((*case.shape_a[:-1], case.N)) if case.addend else None
    bias = jnp.zeros((case.N,)) if case.bias else None
    with pytest.raises(NotImplementedError), backend.calling():
        backend.matmul(
            a,
            b,
            addend,
            bias,
            out_dtype=case.out_dtype,
            block_sizes=case.block_sizes(),
        )


@pytest.mark.parametrize("case", [name for name, case in CASE.items() if case.dtype == "float32"])
def test_reference_matches_exact(case):
    """The pure-JAX reference against float64 numpy, at the float32 tolerances."""
    got, (exact, slack) = results("reference", case), exact_results(case)
    for i, (x, y) in enumerate(zip(got, exact, strict=True)):
        assert (x is None) == (y is None), (case, NAMES[i])
        if x is not None:
            kind = "output" if i == 0 else "grad"
            atol = F32_TOLERANCE[kind] + slack[i]
            assert_close(x, y, atol=atol, kind=kind, name=f"{case} {NAMES[i]}")
