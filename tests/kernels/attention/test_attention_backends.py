"""One test body for every attention implementation: the TESTING.md matrix.

Parametrized over `attention_backends.BACKENDS` (xla; pallas_tpu in TPU
interpret mode; triton under the Triton interpreter on CPU, and through
jax-triton on a GPU, marked `gpu`) and over each backend's budget of
`attention_cases.CASES`. What a backend's capability flags exclude is skipped
with the reason, and `test_refuses_what_its_flags_exclude` checks that the
implementation really raises NotImplementedError there.

- forward, lse and gradients (vjp with random cotangents on out and lse)
  against the reference: float32 at atol = rtol = 1e-5 (2e-5 gradients),
  bfloat16 / float16 by the 2x / 3x rule against the reference in float32
  and in the low precision; everything finite on both sides first;
- fully masked rows: output 0, lse -inf, zero dq; keys nobody sees: zero dk, dv;
- NaN poisoning: NaN (and inf in values) in queries that see nothing and in
  keys nobody sees leave every result bitwise unchanged;
- determinism: a second run under jit is bitwise equal.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.kernels.attention.attention_backends import BACKENDS, results, run
from tests.kernels.attention.attention_cases import CASE, blind_rows_and_unseen_keys, make_inputs
from tests.kernels.backend_params import backend_params

NAMES = ("out", "lse", "dq", "dk", "dv")


def _params(names_of, **options):
    return backend_params(BACKENDS, CASE, names_of, **options)


def _budget(backend):
    return (*backend.default, *backend.slow)


def _masks_whole_rows_or_keys(backend):
    """Budget cases that may have blind rows or unseen keys (the test skips those that don't)."""
    return [
        name
        for name in _budget(backend)
        if CASE[name].segments
        or CASE[name].window
        or (CASE[name].causal and CASE[name].T > CASE[name].S)
    ]


def _check_finite(label, arrays):
    for name, x in zip(NAMES, arrays, strict=True):
        x = np.asarray(x, np.float32)
        ok = np.isfinite(x) | (np.isneginf(x) if name == "lse" else False)
        assert ok.all(), f"{label}: {name} has {int((~ok).sum())} NaN or inf entries"


@pytest.mark.parametrize("backend, case", _params(_budget))
def test_matches_reference(backend, case):
    backend.require()
    got = results(backend.name, case.name)
    expected = results("reference", case.name)
    label = f"{backend.name} {case.name}"
    assert got[0].shape == (case.B, case.T, case.H, case.D)
    assert got[1].shape == (case.B, case.H, case.T)
    for name, x in zip(NAMES, got, strict=True):
        want = jnp.float32 if name == "lse" else jnp.dtype(case.dtype)
        assert x.dtype == want, f"{label}: {name} has dtype {x.dtype}, expected {want}"
    _check_finite(label, got)
    _check_finite(f"reference {case.name}", expected)
    kinds = ("output", "output", "grad", "grad", "grad")
    if case.dtype == "float32":
        for name, kind, a, e in zip(NAMES, kinds, got, expected, strict=True):
            assert_close(a, e, kind=kind, name=f"{label} {name}")
        return
    ref32 = results("reference", case.name, "clean-float32")
    for name, kind, a, r32, rlp in zip(NAMES, kinds, got, ref32, expected, strict=True):
        assert_close_low_precision(a, r32, rlp, kind=kind, name=f"{label} {name}")


@pytest.mark.parametrize("backend, case", _params(_masks_whole_rows_or_keys))
def test_fully_masked_rows_and_unseen_keys(backend, case):
    backend.require()
    blind, unseen = blind_rows_and_unseen_keys(case, make_inputs(case))
    if not (blind.any() or unseen.any()):
        pytest.skip("every query sees a key and every key is seen")
    out, lse, dq, dk, dv = results(backend.name, case.name)
    lse = lse.transpose(0, 2, 1)  # [B, T, H]
    assert (out[blind] == 0).all(), "rows that see no key must be 0"
    assert np.isneginf(lse[blind]).all(), "rows that see no key must have lse = -inf"
    assert np.isfinite(lse[~blind]).all()
    assert (dq[blind] == 0).all(), "rows that see no key must have zero dq"
    assert (dk[unseen] == 0).all() and (dv[unseen] == 0).all(), "unseen keys need zero dk, dv"
    for name, g in zip(NAMES[2:], (dq, dk, dv), strict=True):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name


@pytest.mark.parametrize("backend, case", _params(lambda backend: backend.poisoned))
def test_nan_in_invisible_positions_never_leaks(backend, case):
    backend.require()
    blind, unseen = blind_rows_and_unseen_keys(case, make_inputs(case))
    assert blind.any() or unseen.any(), "a poisoning case needs blind rows or unseen keys"
    for name in (backend.name, "reference"):
        clean, poisoned = results(name, case.name), results(name, case.name, "poisoned")
        _check_finite(f"{name} {case.name} poisoned", poisoned)
        for label, a, b in zip(NAMES, poisoned, clean, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: poison changed {label}")


@pytest.mark.parametrize("backend, case", _params(lambda backend: backend.deterministic))
def test_deterministic_under_jit(backend, case):
    backend.require()
    first = results(backend.name, case.name)
    second = run(backend, case, make_inputs(case), case.dtype)
    for name, a, b in zip(NAMES, first, second, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=f"{backend.name}: {name} differs between runs")


@pytest.mark.parametrize(
    "backend, case", _params(lambda backend: CASE, tiered=False, only_unsupported=True)
)
def test_refuses_what_its_flags_exclude(backend, case):
    """Where a flag says no, the implementation raises NotImplementedError (dispatch falls back)."""
    backend.require()
    q = jnp.zeros((case.B, case.T, case.H, case.D), case.dtype)
    k = v = jnp.zeros((case.B, case.S, case.K, case.D), case.dtype)
    extra = {} if case.block is None else {"block_sizes": sf.BlockSizes(*case.block)}
    with pytest.raises(NotImplementedError), backend.calling():
        backend.attend(q, k, v, **case.options(), **extra)
