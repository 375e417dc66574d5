"""One test body for every grouped matmul implementation: the TESTING.md matrix.

Parametrized over `grouped_cases.BACKENDS` (xla; native_cpu; pallas_tpu in TPU
interpret mode with 16-row tiles; triton under the Triton interpreter on CPU with
16 x 16 x 16 tiles, and through jax-triton on a GPU, marked `gpu`) and over each
backend's budget of `grouped_cases.CASES`. What a backend's capability flags
exclude is skipped with the reason, and `test_refuses_what_its_flags_exclude`
checks that the implementation really raises NotImplementedError there.

- the output and both gradients (vjp with a random cotangent): float32 at atol =
  rtol = 1e-5 (2e-5 gradients) plus each entry's summation slack against the exact
  float64 result (`grouped_cases.exact`; the reference implementation is held to it
  too), bfloat16 by the 2x / 3x rule against the reference in float32 and in
  bfloat16; finite on both sides; dtypes and shapes; rows no local group owns are
  exactly zero, and so are the gradients of empty groups;
- determinism: a second run under jit is bitwise equal.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.testing import F32_TOLERANCE, assert_close
from tests.kernels.backend_params import backend_params
from tests.kernels.grouped_matmul.grouped_cases import (
    BACKENDS,
    CASE,
    KINDS,
    NAMES,
    assert_matches,
    exact,
    make_inputs,
    results,
    run,
)


def _params(names_of, **options):
    return backend_params(BACKENDS, CASE, names_of, **options)


def _unowned_rows(case):
    """Rows no local group owns (other shards' groups, past the sum): output exactly 0."""
    ends = np.cumsum(case.sizes)
    offset = case.offset or 0
    owned = np.zeros(case.M, bool)
    for j in range(case.groups):
        owned[ends[offset + j] - case.sizes[offset + j] : ends[offset + j]] = True
    return ~owned


@pytest.mark.parametrize(
    "backend, case", _params(lambda backend: (*backend.default, *backend.slow))
)
def test_matches_reference(backend, case):
    backend.require()
    got = results(backend.name, case.name)
    label = f"{backend.name} {case.name}"
    shapes = ((case.M, case.N), (case.M, case.K), case.rhs_shape)
    dtypes = (case.out_dtype or case.dtype, case.dtype, case.dtype)
    for name, x, shape, dtype in zip(NAMES, got, shapes, dtypes, strict=True):
        assert x.shape == shape, f"{label}: {name} shape {x.shape} != {shape}"
        assert x.dtype == jnp.dtype(dtype), f"{label}: {name} dtype {x.dtype} != {dtype}"
        assert np.isfinite(np.asarray(x, np.float32)).all(), f"{label}: {name} not finite"
    unowned = _unowned_rows(case)
    assert not np.asarray(got[0], np.float32)[unowned].any(), f"{label}: unowned rows not 0"
    assert not np.asarray(got[1], np.float32)[unowned].any(), f"{label}: d_lhs there not 0"
    offset = case.offset or 0
    for j in range(case.groups):
        if case.sizes[offset + j] == 0:
            assert not np.asarray(got[2][j], np.float32).any(), f"{label}: empty group {j}"
    assert_matches(
        got,
        case,
        label,
        lambda: (
            results("reference", case.name, "float32"),
            results("reference", case.name, "low"),
        ),
    )


@pytest.mark.parametrize("backend, case", _params(lambda backend: backend.deterministic))
def test_deterministic_under_jit(backend, case):
    backend.require()
    first = results(backend.name, case.name)
    second = run(backend, case, make_inputs(case), case.dtype, case.out_dtype)
    for name, a, b in zip(NAMES, first, second, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"{backend.name}: {name} differs")


@pytest.mark.parametrize(
    "backend, case", _params(lambda backend: CASE, tiered=False, only_unsupported=True)
)
def test_refuses_what_its_flags_exclude(backend, case):
    """Where a flag says no, the implementation raises NotImplementedError (dispatch falls back)."""
    backend.require()
    lhs = jnp.zeros((case.M, case.K), case.dtype)
    rhs = jnp.zeros(case.rhs_shape, case.dtype)
    with pytest.raises(NotImplementedError), backend.calling():
        backend.grouped_matmul(
            lhs,
            rhs,
            jnp.asarray(case.sizes, jnp.int32),
            case.offset,
            transpose=case.transpose,
            out_dtype=case.out_dtype,
        )


@pytest.mark.parametrize("case", [name for name, case in CASE.items() if case.dtype == "float32"])
def test_reference_matches_exact(case):
    """The reference implementation (the oracle of 16-bit cases) against float64 numpy."""
    got, (values, slack) = results("reference", case), exact(CASE[case])
    for i, name in enumerate(NAMES):
        atol = F32_TOLERANCE[KINDS[i]] + slack[i]
        assert_close(got[i], values[i], atol=atol, kind=KINDS[i], name=f"{case} {name}")
