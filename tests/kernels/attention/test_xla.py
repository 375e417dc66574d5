"""The xla implementation (blockwise flash attention) against the oracle: the TESTING.md matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import base, xla
from tests.kernels.attention.common import Case, attention_with_vjp, check_case, make_inputs

FLOAT32_CASES = [
    Case(T=1, S=1),
    Case(T=7, S=7, causal=True),
    Case(T=97, S=113, H=4, K=1, causal=True, block=(32, 32)),
    Case(T=113, S=97, H=8, K=2, causal=True, block=(16, 64)),
    Case(T=127, S=257, window=(32, 8), block=(64, 32)),
    Case(B=2, T=257, S=127, segments=True, softcap=3.0, block=(128, 16)),
    Case(T=64, S=64, H=4, K=1, D=64, causal=True),
    Case(T=33, S=65, D=128, block=(8, 24)),
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
]


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: c.id)
def test_float32_matches_reference(case):
    check_case("xla", case)


@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=lambda c: c.id)
def test_low_precision_two_x_rule(case):
    check_case("xla", case)


def test_fully_masked_rows():
    # T > S bottom-right causal masks the first T - S rows; a segment absent from the
    # keys masks more rows.
    case = Case(B=2, T=40, S=24, H=4, K=2, causal=True, block=(16, 16))
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(case)
    q_seg = jnp.zeros((2, 40), jnp.int32).at[1, 30:].set(7)
    kwargs.update(q_segment_ids=q_seg, kv_segment_ids=jnp.zeros((2, 24), jnp.int32))
    out, lse, dq, dk, dv = attention_with_vjp("xla", kwargs, sf.BlockSizes(16, 16))(
        q, k, v, d_out, d_lse
    )
    masked = np.zeros((2, 40), bool)
    masked[:, :16] = True
    masked[1, 30:] = True
    out, lse, dq = map(np.asarray, (out, lse, dq))
    assert np.all(out[masked] == 0) and np.all(np.isneginf(lse.transpose(0, 2, 1)[masked]))
    assert np.all(np.isfinite(lse.transpose(0, 2, 1)[~masked]))
    assert np.all(dq[masked] == 0)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))


def test_nan_in_invisible_positions_never_reaches_outputs_or_gradients():
    case = Case(B=2, T=48, S=80, H=4, K=2, causal=True, window=(24, 0), block=(16, 16))
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(case)
    q_seg = jnp.zeros((2, 48), jnp.int32).at[0, 40:].set(5)  # rows 40.. of batch 0 see nothing
    kv_seg = jnp.zeros((2, 80), jnp.int32).at[1, 70:].set(9)  # keys 70.. of batch 1: no query
    kwargs.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    # Keys before position 32 - 24 = 8 are outside every query's window; keys of
    # segment 9 are seen by no query; queries of segment 5 see no key.
    k = k.at[:, :8].set(jnp.nan).at[1, 70:].set(jnp.nan)
    v = v.at[:, :8].set(jnp.nan).at[1, 70:].set(jnp.inf)
    q = q.at[0, 40:].set(jnp.nan)
    for impl in ("xla", "oracle"):
        results = attention_with_vjp(impl, kwargs, sf.BlockSizes(16, 16))(q, k, v, d_out, d_lse)
        for name, x in zip(("out", "lse", "dq", "dk", "dv"), results, strict=True):
            x = np.asarray(x)
            assert not np.isnan(x).any(), f"{impl}: NaN leaked into {name}"
            if name != "lse":
                assert np.isfinite(x).all(), f"{impl}: inf leaked into {name}"


def test_deterministic_under_jit():
    case = Case(B=2, T=97, S=113, H=4, K=2, causal=True, segments=True, block=(32, 32))
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(case)
    first = attention_with_vjp("xla", kwargs, sf.BlockSizes(32, 32))(q, k, v, d_out, d_lse)
    second = attention_with_vjp("xla", kwargs, sf.BlockSizes(32, 32))(q, k, v, d_out, d_lse)
    for a, b in zip(first, second, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize(
    "kwargs, expected_fraction",
    [
        (dict(causal=True), (16 * 17 / 2) / 256),
        (dict(causal=True, window=(128, 0)), None),
        (dict(causal=False), 1.0),
    ],
)
def test_masked_blocks_are_skipped(kwargs, expected_fraction):
    T = S = 1024
    config = base.validate(
        jnp.zeros((1, T, 1, 8)),
        jnp.zeros((1, S, 1, 8)),
        jnp.zeros((1, S, 1, 8)),
        q_positions=None,
        kv_positions=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        logit_softcap=None,
        scale=None,
        block_sizes=sf.BlockSizes(64, 64),
        **{"window": None, **kwargs},
    )
    q_pos, kv_pos = base.default_positions(T, S)
    q = jnp.zeros((1, T, 1, 8))
    tiles = xla._Tiles(config, q, q, q, q_pos, kv_pos, None, None)
    fraction = float(jnp.mean(tiles.visible))
    if expected_fraction is None:  # window 128 at block 64: diagonal + 2 blocks back
        expected_fraction = (16 + 15 + 14) / 256
    assert fraction == pytest.approx(expected_fraction)


def test_block_skipping_with_segments_and_padding():
    # Block 16 on length 40: the last block is half padding. Segment ranges
    # 0 | 1 per half make the off-diagonal blocks invisible.
    q = jnp.zeros((1, 40, 1, 8))
    seg = (jnp.arange(40) >= 16).astype(jnp.int32)[None]
    config = base.validate(
        q,
        q,
        q,
        causal=False,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=seg,
        kv_segment_ids=seg,
        window=None,
        logit_softcap=None,
        scale=None,
        block_sizes=sf.BlockSizes(16, 16),
    )
    q_pos, kv_pos = base.default_positions(40, 40)
    tiles = xla._Tiles(config, q, q, q, q_pos, kv_pos, seg, seg)
    np.testing.assert_array_equal(np.asarray(tiles.visible), [[1, 0, 0], [0, 1, 1], [0, 1, 1]])


def _all_avals(jaxpr):
    """Every intermediate's aval in a jaxpr, sub-jaxprs (loops, conds, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_avals(inner)


def test_gqa_never_repeats_kv():
    # H = 8 query heads on K = 1 kv head, S = 64, D = 24: a repeated K or V (or
    # its gradient) would be some intermediate with 8, 64 and 24 in its shape.
    q, k, v, _, _ = make_inputs(Case(T=16, S=64, H=8, K=1, D=24))
    loss = lambda q, k, v: sf.flash_attention(q, k, v, implementation="xla").sum()
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    shapes = [tuple(getattr(aval, "shape", ())) for aval in _all_avals(jaxpr.jaxpr)]
    assert any(64 in s and 24 in s for s in shapes)  # K/V tiles are there...
    repeated = [s for s in shapes if {8, 64, 24} <= set(s)]
    assert not repeated, repeated  # ... but never with the 8 query heads
