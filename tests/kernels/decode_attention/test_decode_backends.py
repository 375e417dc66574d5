"""One test body for every decode-attention implementation.

Parametrized over `decode_backends.BACKENDS` (xla; pallas_tpu in TPU interpret
mode; triton under the Triton interpreter on CPU, and through jax-triton on a
GPU, marked `gpu`) and each backend's budget of `decode_cases.CASES`:

- out and lse against the decode reference: float32 at atol = rtol = 1e-5;
  bfloat16 / float16 by the 2x rule against the reference in float32 and in
  the low precision (TESTING.md); everything finite (lse: or -inf) first;
- against flash attention's own reference on the equivalent masked problem:
  per batch row, `sf.attention_reference(q[b], k[b, :L], v[b, :L], causal=True,
  window=...)` with L = lengths[b] (bottom-right aligned, so the queries are
  the last T positions of the valid prefix);
- queries that see no key (length 0, length below T): out 0, lse -inf;
- NaN poisoning: NaN in every cache row nobody sees (beyond a length, before
  the window; inf in v) and in blind queries leaves the results bitwise equal;
- determinism: a second run is bitwise equal;
- what a backend's flags exclude raises NotImplementedError.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.kernels.backend_params import backend_params
from tests.kernels.decode_attention.decode_backends import BACKENDS, results, run
from tests.kernels.decode_attention.decode_cases import (
    CASE,
    blind_rows_and_unseen_keys,
    make_inputs,
)

NAMES = ("out", "lse")


def _params(names_of, **options):
    return backend_params(BACKENDS, CASE, names_of, **options)


def _budget(backend):
    return (*backend.default, *backend.slow)


def _check_finite(label, arrays):
    for name, x in zip(NAMES, arrays, strict=True):
        x = np.asarray(x, np.float32)
        ok = np.isfinite(x) | (np.isneginf(x) if name == "lse" else False)
        assert ok.all(), f"{label}: {name} has {int((~ok).sum())} NaN or inf entries"


@functools.cache
def _flash_reference(case_name, dtype):
    """`(out, lse)` of `sf.attention_reference` per batch row on its valid prefix."""
    case = CASE[case_name]
    q, k, v, lengths = make_inputs(case)
    q, k, v = (x.astype(case.dtype).astype(dtype) for x in (q, k, v))
    attend = jax.jit(
        functools.partial(
            sf.attention_reference, causal=True, window=case.window,
            logit_softcap=case.softcap, return_lse=True,
        )
    )  # fmt: skip
    outs, lses = [], []
    for b, length in enumerate(case.lengths):
        out, lse = attend(q[b : b + 1], k[b : b + 1, :length], v[b : b + 1, :length])
        outs.append(np.asarray(out))
        lses.append(np.asarray(lse))
    return np.concatenate(outs), np.concatenate(lses)


def _flash_pair(case):
    flash32 = _flash_reference(case.name, "float32")
    flash_lp = flash32 if case.dtype == "float32" else _flash_reference(case.name, case.dtype)
    return flash32, flash_lp


def _compare(label, case, got, ref32, ref_lp):
    _check_finite(label, got)
    if case.dtype == "float32":
        for name, a, e in zip(NAMES, got, ref32, strict=True):
            assert_close(a, e, name=f"{label} {name}")
        return
    for name, a, r32, rlp in zip(NAMES, got, ref32, ref_lp, strict=True):
        assert_close_low_precision(a, r32, rlp, name=f"{label} {name}")


@pytest.mark.parametrize("backend, case", _params(_budget))
def test_matches_reference(backend, case):
    backend.require()
    got = results(backend.name, case.name)
    label = f"{backend.name} {case.name}"
    assert got[0].shape == (case.B, case.T, case.H, case.D)
    assert got[1].shape == (case.B, case.H, case.T)
    assert got[0].dtype == jnp.dtype(case.dtype) and got[1].dtype == jnp.float32, label
    expected = results("reference", case.name)
    _check_finite(f"reference {case.name}", expected)
    ref32 = (
        expected if case.dtype == "float32" else results("reference", case.name, "clean-float32")
    )
    _compare(label, case, got, ref32, expected)


@pytest.mark.parametrize("backend, case", _params(_budget))
def test_matches_flash_attention_on_the_valid_prefix(backend, case):
    backend.require()
    got = results(backend.name, case.name)
    flash32, flash_lp = _flash_pair(case)
    _compare(f"{backend.name} {case.name} vs flash", case, got, flash32, flash_lp)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=[pytest.mark.slow] if case.S > 1000 else [])
        for case in CASE.values()
    ],
    ids=list(CASE),
)
def test_reference_matches_flash_attention(case):
    """The oracle itself, against flash attention's oracle, on every case (cheap)."""
    got = results("reference", case.name)
    flash32, flash_lp = _flash_pair(case)
    _compare(f"reference {case.name} vs flash", case, got, flash32, flash_lp)


@pytest.mark.parametrize("backend, case", _params(_budget))
def test_blind_queries_give_zero_and_minus_inf(backend, case):
    backend.require()
    blind, _ = blind_rows_and_unseen_keys(case)
    out, lse = results(backend.name, case.name)
    lse = lse.transpose(0, 2, 1)  # [B, T, H]
    assert (out[blind] == 0).all(), "queries that see no key must return 0"
    assert np.isneginf(lse[blind]).all(), "queries that see no key must have lse = -inf"
    assert np.isfinite(lse[~blind]).all()


@pytest.mark.parametrize("backend, case", _params(lambda backend: backend.poisoned))
def test_nan_in_unread_cache_never_leaks(backend, case):
    backend.require()
    blind, unseen = blind_rows_and_unseen_keys(case)
    assert unseen.any(), "a poisoning case needs cache rows nobody sees"
    for name in (backend.name, "reference"):
        clean, poisoned = results(name, case.name), results(name, case.name, "poisoned")
        _check_finite(f"{name} {case.name} poisoned", poisoned)
        for label, a, b in zip(NAMES, poisoned, clean, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name}: poison changed {label}")


@pytest.mark.parametrize("backend, case", _params(lambda backend: backend.deterministic))
def test_deterministic(backend, case):
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
    lengths = jnp.asarray(case.lengths, jnp.int32)
    with pytest.raises(NotImplementedError), backend.calling():
        backend.attend(q, k, v, lengths, **case.options())
