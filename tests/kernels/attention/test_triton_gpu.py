"""The Triton attention kernels on an NVIDIA GPU through jax-triton: the TESTING.md matrix.

Marked `gpu`: skipped without one (`python -m pytest -m gpu` runs them). The
same cases run on CPU under the Triton interpreter in test_triton_interpret.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from tests.kernels.attention.common import Case, attention_with_vjp, check_case, make_inputs

pytestmark = pytest.mark.gpu

FLOAT32_CASES = [
    Case(T=1, S=1),
    Case(T=7, S=7, causal=True),
    Case(T=97, S=113, H=4, K=1, causal=True, block=(32, 32)),
    Case(T=113, S=97, H=8, K=2, causal=True, block=(16, 64)),
    Case(T=127, S=257, window=(32, 8), block=(64, 32)),
    Case(B=2, T=257, S=127, segments=True, softcap=3.0, block=(128, 16)),
    Case(T=64, S=64, H=4, K=1, D=64, causal=True),
    Case(T=33, S=65, D=64, block=(16, 32)),
    Case(B=2, T=50, S=70, H=4, K=2, D=20, causal=True, window=(20, 5), softcap=2.0, segments=True),
    Case(T=96, S=96, H=4, K=2, causal=True, positions="shuffled", block=(16, 16)),
]

LOW_PRECISION_CASES = [
    Case(T=97, S=113, H=4, K=1, causal=True, block=(32, 32), dtype="bfloat16"),
    Case(
        B=2,
        T=64,
        S=80,
        H=8,
        K=2,
        D=64,
        window=(16, 16),
        softcap=5.0,
        segments=True,
        dtype="bfloat16",
    ),
    Case(T=65, S=65, H=2, K=2, causal=True, dtype="float16"),
    Case(B=2, T=1024, S=1024, H=8, K=2, D=128, causal=True, dtype="bfloat16"),
    Case(T=257, S=1000, H=4, K=4, D=64, dtype="float16"),
    Case(T=40, S=72, D=256, causal=True, dtype="bfloat16"),
    Case(T=33, S=65, D=96, block=(16, 32), dtype="float16"),
]


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("jax_triton")


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: c.id)
def test_float32_matches_reference(case):
    check_case("triton", case)


@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=lambda c: c.id)
def test_low_precision_two_x_rule(case):
    check_case("triton", case)


def test_fully_masked_rows_and_nan_poisoning():
    case = Case(B=2, T=40, S=24, H=4, K=2, causal=True, block=(16, 16))
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(case)
    q_seg = jnp.zeros((2, 40), jnp.int32).at[1, 30:].set(7)
    kv_seg = jnp.zeros((2, 24), jnp.int32).at[0, 20:].set(9)  # keys nobody sees
    kwargs.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    k = k.at[0, 20:].set(jnp.nan)
    v = v.at[0, 20:].set(jnp.nan)
    q = q.at[1, 30:].set(jnp.nan)
    got = attention_with_vjp("triton", kwargs, sf.BlockSizes(16, 16))(q, k, v, d_out, d_lse)
    out, lse, dq, dk, dv = (np.asarray(x) for x in got)
    for x in (out, dq, dk, dv):
        assert np.isfinite(x).all()
    assert (out[1, 30:] == 0).all() and np.isneginf(lse[1, :, 30:]).all()
    assert (out[:, :16] == 0).all()  # bottom-right causal with T > S: rows before key 0
    assert (dq[1, 30:] == 0).all() and (dk[0, 20:] == 0).all() and (dv[0, 20:] == 0).all()


def test_deterministic_under_jit():
    case = Case(B=2, T=300, S=300, H=8, K=2, D=64, causal=True, dtype="bfloat16")
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(case)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    run = attention_with_vjp("triton", kwargs)
    first, second = run(q, k, v, d_out, d_lse), run(q, k, v, d_out, d_lse)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_float32_above_head_dim_64_falls_back():
    q = k = v = jnp.ones((1, 32, 2, 128), jnp.float32)
    with pytest.raises(NotImplementedError, match="float32 inputs up to head dim 64"):
        sf.flash_attention(q, k, v, implementation="triton")
    expected = sf.flash_attention(q, k, v, implementation="xla")
    np.testing.assert_array_equal(np.asarray(sf.flash_attention(q, k, v)), np.asarray(expected))


def test_default_implementation_is_triton_on_gpu():
    q = k = v = jax.random.normal(jax.random.key(0), (1, 128, 2, 64), jnp.bfloat16)
    default = sf.flash_attention(q, k, v, causal=True)
    triton = sf.flash_attention(q, k, v, causal=True, implementation="triton")
    np.testing.assert_array_equal(np.asarray(default), np.asarray(triton))
