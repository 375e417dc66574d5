"""pallas_tpu flash attention in TPU interpret mode against the reference oracle.

The TESTING.md matrix for this backend: forward, lse and gradients (vjp with
random cotangents on out and lse), odd lengths, T != S both ways, GQA/MQA,
causal, window, softcap, segment ids, fully masked rows, NaN poisoning,
determinism, float32 and the bfloat16 rule. Kernels run with
`out_of_bounds_reads="raise"` and `uninitialized_memory="nan"`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.kernels.attention import base, masks
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.kernels.attention.pallas_tpu_cases import (
    CASES,
    SLOW_CASES,
    inputs,
    positions,
    runner,
    segment_ids,
)

# Interpret mode can hang rather than fail (see pallas_tpu_cases.runner): cap each test.
pytestmark = pytest.mark.timeout(300)

PARAMS = [pytest.param(name, id=name) for name in CASES] + [
    pytest.param(name, id=name, marks=pytest.mark.slow) for name in SLOW_CASES
]
ALL_CASES = {**CASES, **SLOW_CASES}


def _run(name, implementation, q, k, v, d_out, d_lse, dtype):
    q_seg, kv_seg = segment_ids(ALL_CASES[name])
    cast = [x.astype(dtype) for x in (q, k, v)]
    return runner(name, implementation)(*cast, d_out, d_lse, q_seg, kv_seg)


def _check_finite(name, *arrays):
    for label, x in zip(("out", "lse", "dq", "dk", "dv"), arrays, strict=False):
        x = np.asarray(x, np.float32)
        finite = np.isfinite(x) | (np.isneginf(x) if label == "lse" else False)
        assert finite.all(), f"{name}: {label} has {int((~finite).sum())} non-finite entries"


@pytest.mark.parametrize("name", PARAMS)
def test_matches_reference(name):
    case = ALL_CASES[name]
    q, k, v, d_out, d_lse = inputs(case)
    out, lse, grads = _run(name, "pallas_tpu", q, k, v, d_out, d_lse, case.dtype)
    ref32 = _run(name, "reference", q, k, v, d_out, d_lse, jnp.float32)
    assert out.dtype == jnp.dtype(case.dtype) and lse.dtype == jnp.float32
    assert out.shape == q.shape and lse.shape == (case.B, case.H, case.T)
    _check_finite(name, out, lse, *grads)
    _check_finite(f"{name} reference", ref32[0], ref32[1], *ref32[2])
    labels = ("dq", "dk", "dv")
    if case.dtype == "float32":
        assert_close(out, ref32[0], name="out")
        assert_close(lse, ref32[1], name="lse")
        for label, grad, expected in zip(labels, grads, ref32[2], strict=True):
            assert_close(grad, expected, kind="grad", name=label)
    else:
        ref_lp = _run(name, "reference", q, k, v, d_out, d_lse, case.dtype)
        assert_close_low_precision(out, ref32[0], ref_lp[0], name="out")
        assert_close_low_precision(lse, ref32[1], ref_lp[1], name="lse")
        for label, grad, exp32, exp_lp in zip(labels, grads, ref32[2], ref_lp[2], strict=True):
            assert_close_low_precision(grad, exp32, exp_lp, kind="grad", name=label)


def test_fully_masked_rows_are_zero_with_zero_grads():
    """T > S, bottom-right aligned: queries at negative positions see no key."""
    name = "causal_t_gt_s_gqa_d64"
    case = CASES[name]
    q, k, v, d_out, d_lse = inputs(case)
    out, lse, (dq, _, _) = _run(name, "pallas_tpu", q, k, v, d_out, d_lse, jnp.float32)
    masked = case.T - case.S  # rows 0 .. T - S - 1 have q_pos < 0
    assert np.all(np.asarray(out[:, :masked]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :masked])))
    assert np.all(np.asarray(dq[:, :masked]) == 0)
    assert np.isfinite(np.asarray(lse[:, :, masked:])).all()


def test_segment_without_keys_gives_zero_rows():
    name = "segments_causal"
    case = CASES[name]
    q, k, v, d_out, d_lse = inputs(case)
    out, lse, (dq, _, _) = _run(name, "pallas_tpu", q, k, v, d_out, d_lse, jnp.float32)
    rows = slice(case.T // 2, case.T // 2 + 9)  # segment 7: no key has it
    assert np.all(np.asarray(out[:, rows]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, rows])))
    assert np.all(np.asarray(dq[:, rows]) == 0)


@pytest.mark.parametrize("name", ["segments_causal", "causal_t_gt_s_gqa_d64"])
def test_nan_in_invisible_positions_never_leaks(name):
    """NaN in keys no query sees and in queries that see no key: results bitwise unchanged."""
    case = CASES[name]
    q, k, v, d_out, d_lse = inputs(case)
    clean = _run(name, "pallas_tpu", q, k, v, d_out, d_lse, jnp.float32)
    q_seg, kv_seg = segment_ids(case)
    config = base.validate(q, k, v, **_validate_kwargs(case, q_seg, kv_seg))
    q_pos, kv_pos = base.default_positions(case.T, case.S, *positions(case))
    visible = masks.visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg)
    visible = jnp.broadcast_to(visible, (case.B, case.T, case.S))
    invisible_keys = ~jnp.any(visible, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    invisible_rows = ~jnp.any(visible, axis=2)[:, :, None, None]  # [B, T, 1, 1]
    assert invisible_rows.any()
    assert invisible_keys.any() or not case.segments
    q_bad = jnp.where(invisible_rows, jnp.nan, q)
    k_bad, v_bad = jnp.where(invisible_keys, jnp.nan, k), jnp.where(invisible_keys, jnp.nan, v)
    out, lse, grads = _run(name, "pallas_tpu", q_bad, k_bad, v_bad, d_out, d_lse, jnp.float32)
    _check_finite(name, out, lse, *grads)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean[0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean[1]))
    for grad, expected in zip(grads, clean[2], strict=True):
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(expected))


def _validate_kwargs(case, q_seg, kv_seg):
    kwargs = case.kwargs()
    return dict(
        causal=kwargs["causal"],
        window=kwargs["window"],
        logit_softcap=kwargs["logit_softcap"],
        scale=None,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
    )


def test_deterministic_under_jit():
    name = "bf16_causal_gqa"
    case = CASES[name]
    q, k, v, d_out, d_lse = inputs(case, seed=3)
    first = _run(name, "pallas_tpu", q, k, v, d_out, d_lse, case.dtype)
    second = _run(name, "pallas_tpu", q, k, v, d_out, d_lse, case.dtype)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
