"""The Triton attention kernels under the Triton interpreter (CPU) against the reference.

The whole JAX wrapper of `triton_gpu.py` runs (block tables, custom_vjp, jit);
only the launcher differs from a GPU: `InterpretLauncher` runs each kernel in a
worker process started with `TRITON_INTERPRET=1`, on torch CPU tensors. The
interpreter is slow, so shapes are tiny and block sizes small (16) so that
every case still spans several blocks, partial blocks and skipped blocks.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.kernels.attention import base
from tests.kernels.attention.common import Case, compare_to_reference, make_inputs, with_vjp

pytest.importorskip("torch", reason="the Triton interpreter runs on torch CPU tensors")
pytest.importorskip("triton", reason="needs triton (pip install triton)")

from shardfuse.kernels.attention import triton_gpu  # noqa: E402
from shardfuse.kernels.triton.launch import InterpretLauncher  # noqa: E402

LAUNCHER = InterpretLauncher()

CASES = [
    # Odd lengths, T < S, GQA 4:2, causal (bottom-right aligned), float32.
    Case(T=37, S=45, H=4, K=2, D=32, causal=True, block=(16, 16)),
    # T > S, MQA, odd head dim (padded to 32 in registers), no mask, bfloat16.
    Case(T=45, S=23, H=4, K=1, D=24, block=(16, 16), dtype="bfloat16"),
    # Packed segments, a sliding window and a softcap, float16.
    Case(
        T=48,
        S=48,
        H=2,
        K=2,
        D=16,
        segments=True,
        window=(9, 0),
        softcap=5.0,
        block=(16, 16),
        dtype="float16",
    ),
    # Non-monotone positions (a ring layout): conservative block ranges, exact masks.
    Case(T=40, S=40, H=2, K=1, D=16, causal=True, positions="shuffled", block=(16, 32)),
    # Two batch elements, a two-sided window, GQA 4:1 (G = 4 heads per dK/dV program).
    Case(B=2, T=33, S=50, H=4, K=1, D=16, window=(10, 7), block=(16, 16)),
]

SLOW_CASES = [
    # Default tiles (128-row forward tiles), head dim 128, bfloat16.
    Case(T=130, S=257, H=4, K=2, D=128, causal=True, dtype="bfloat16"),
    Case(B=2, T=200, S=200, H=8, K=2, D=64, segments=True, softcap=20.0, window=(64, 0)),
]


def interpreted_with_vjp(kwargs, block_sizes):
    """`attention_with_vjp` of common.py, through the Triton interpreter launcher."""

    def attend(q, k, v):
        config = base.validate(
            q,
            k,
            v,
            causal=kwargs.get("causal", False),
            q_positions=kwargs.get("q_positions"),
            kv_positions=kwargs.get("kv_positions"),
            q_segment_ids=kwargs.get("q_segment_ids"),
            kv_segment_ids=kwargs.get("kv_segment_ids"),
            window=kwargs.get("window"),
            logit_softcap=kwargs.get("logit_softcap"),
            scale=kwargs.get("scale"),
            block_sizes=block_sizes,
        )
        q_pos, kv_pos = base.default_positions(
            q.shape[1], k.shape[1], kwargs.get("q_positions"), kwargs.get("kv_positions")
        )
        return triton_gpu.flash_attention(
            config,
            q,
            k,
            v,
            q_pos,
            kv_pos,
            kwargs.get("q_segment_ids"),
            kwargs.get("kv_segment_ids"),
            launcher=LAUNCHER,
        )

    return with_vjp(attend)


def check(case, inputs=None):
    """Forward, lse and gradients against the reference with the TESTING.md tolerances."""
    inputs = inputs or make_inputs(case)
    block_sizes = None if case.block is None else base.BlockSizes(*case.block)
    return compare_to_reference(
        "triton", case, interpreted_with_vjp(inputs[3], block_sizes), inputs
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.id)
def test_larger_cases_match_reference(case):
    check(case)


def test_default_tiles_fully_masked_rows_and_nan_poisoning():
    """Default tiles; rows with no visible key; NaN where no query can look."""
    case = Case(B=2, T=24, S=40, H=2, K=1, D=16, segments=True)
    q, k, v, kwargs, cotangents = make_inputs(case, seed=3)
    # Query segment 7 exists in no key row: those rows see nothing.
    q_seg = kwargs["q_segment_ids"].at[:, :5].set(7)
    kv_seg = kwargs["kv_segment_ids"].at[:, -6:].set(9)  # and keys no query can see
    kwargs = dict(kwargs, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    k = k.at[:, -6:].set(jnp.nan)
    v = v.at[:, -6:].set(jnp.nan)
    q = q.at[:, :5].set(jnp.nan)
    out, lse, dq, dk, dv = check(case, (q, k, v, kwargs, cotangents))
    assert np.all(np.asarray(out[:, :5]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :5])))
    assert np.all(np.asarray(dq[:, :5]) == 0)
    assert np.all(np.asarray(dk[:, -6:]) == 0) and np.all(np.asarray(dv[:, -6:]) == 0)


def test_deterministic():
    case = CASES[0]
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(case, seed=1)
    run = interpreted_with_vjp(kwargs, base.BlockSizes(*case.block))
    first = run(q, k, v, d_out, d_lse)
    second = run(q, k, v, d_out, d_lse)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
