"""The oracle itself: against jax.nn.dot_product_attention and a naive NumPy loop."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import shardfuse as sf
from shardfuse.kernels.attention import base, masks
from shardfuse.testing import assert_close
from tests.kernels.attention.common import naive_attention_numpy, segment_ids


def _qkv(B, T, S, H, K, D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (B, T, H, D), jnp.float32),
        jax.random.normal(keys[1], (B, S, K, D), jnp.float32),
        jax.random.normal(keys[2], (B, S, K, D), jnp.float32),
    )


@pytest.mark.parametrize(
    "H, K, causal, window",
    [
        (4, 4, False, None),
        (4, 4, True, None),
        (8, 2, True, None),
        (4, 1, False, None),
        (4, 2, True, (5, 0)),
        (4, 4, False, (3, 2)),
    ],
)
def test_matches_jax_nn_dot_product_attention(H, K, causal, window):
    # Conventions meet at T == S (jax.nn aligns causal masks top-left).
    q, k, v = _qkv(2, 37, 37, H, K, 16)
    ours = sf.attention_reference(q, k, v, causal=causal, window=window)
    with jax.default_matmul_precision("highest"):
        theirs = jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, local_window_size=window, implementation="xla"
        )
    assert_close(ours, theirs, name="reference vs jax.nn.dot_product_attention")


def test_matches_jax_nn_with_key_lengths_as_segments():
    # Padding keys of each batch row = a segment the queries do not belong to.
    q, k, v = _qkv(2, 16, 24, 4, 2, 16)
    lengths = jnp.array([24, 11])
    kv_seg = (jnp.arange(24)[None, :] >= lengths[:, None]).astype(jnp.int32)
    q_seg = jnp.zeros((2, 16), jnp.int32)
    ours = sf.attention_reference(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    with jax.default_matmul_precision("highest"):
        theirs = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
    assert_close(ours, theirs, name="reference vs jax.nn with key lengths")


@pytest.mark.parametrize(
    "T, S, H, K, causal, window, softcap, segments, positions",
    [
        (7, 7, 2, 2, True, None, None, False, False),
        (9, 13, 4, 2, True, (3, None), None, False, False),  # T != S, bottom-right causal
        (13, 9, 4, 1, True, None, 5.0, False, False),  # T > S: leading rows fully masked
        pytest.param(11, 11, 4, 2, False, (2, 1), None, True, False, marks=pytest.mark.slow),
        pytest.param(10, 12, 2, 1, True, (4, 4), 2.0, True, True, marks=pytest.mark.slow),
    ],
)
def test_matches_naive_numpy(T, S, H, K, causal, window, softcap, segments, positions):
    B, D = 2, 8
    q, k, v = _qkv(B, T, S, H, K, D, seed=1)
    kwargs = dict(causal=causal, window=window, logit_softcap=softcap)
    q_pos = np.arange(T) + S - T
    kv_pos = np.arange(S)
    if positions:
        q_pos = np.random.default_rng(0).permutation(T) + 3
        kv_pos = np.random.default_rng(1).permutation(S)
        kwargs.update(
            q_positions=jnp.asarray(q_pos, jnp.int32), kv_positions=jnp.asarray(kv_pos, jnp.int32)
        )
    mask = np.ones((B, T, S), bool)
    diff = q_pos[:, None] - kv_pos[None, :]
    if causal:
        mask &= diff >= 0
    if window is not None:
        if window[0] is not None:
            mask &= diff <= window[0]
        if window[1] is not None:
            mask &= -diff <= window[1]
    if segments:
        q_seg = segment_ids(jax.random.key(2), B, T)
        kv_seg = segment_ids(jax.random.key(3), B, S)
        kwargs.update(q_segment_ids=q_seg, kv_segment_ids=kv_seg)
        mask &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
    out, lse = sf.attention_reference(q, k, v, return_lse=True, **kwargs)
    expected_out, expected_lse = naive_attention_numpy(q, k, v, mask, 1 / math.sqrt(D), softcap)
    assert_close(out, expected_out, name="out")
    assert_close(lse, expected_lse, name="lse")
    assert (~mask).all(axis=2).any() == np.isneginf(np.asarray(lse)).any()


@pytest.mark.slow  # every backend checks fully masked rows against it in the default suite
def test_fully_masked_rows_give_zero_output_neginf_lse_and_zero_gradients():
    q, k, v = _qkv(1, 6, 4, 2, 1, 8)
    # T > S with causal bottom-right alignment: the first 2 queries see nothing.
    f = lambda q, k, v: sf.attention_reference(q, k, v, causal=True, return_lse=True)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    assert np.all(np.asarray(out[:, :2]) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :2])))
    assert np.all(np.isfinite(np.asarray(lse[:, :, 2:])))
    d_out = jnp.ones_like(out)
    dq, dk, dv = vjp((d_out, jnp.where(jnp.isfinite(lse), 1.0, 0.0)))
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq[:, :2]) == 0)


def test_reference_gradients_numerically():
    q, k, v = _qkv(1, 5, 6, 2, 1, 4, seed=3)
    f = lambda q, k, v: sf.attention_reference(
        q, k, v, causal=True, window=(3, 0), logit_softcap=4.0
    )
    with jax.default_matmul_precision("highest"), jax.enable_x64(False):
        check_grads(f, (q, k, v), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)


def test_gqa_does_not_touch_caller_arrays():
    q, k, v = _qkv(1, 8, 8, 4, 2, 8)
    before = [np.asarray(x).copy() for x in (q, k, v)]
    sf.attention_reference(q, k, v)
    for x, b in zip((q, k, v), before, strict=True):
        assert x.shape == b.shape and np.array_equal(np.asarray(x), b)


def test_visibility_mask_large_window_does_not_overflow():
    config = base.AttentionConfig(
        causal=False, window=(2**31 - 1, 2**31 - 1), logit_softcap=None, scale=1.0
    )
    q_pos = jnp.array([2**30, -(2**30)], jnp.int32)
    kv_pos = jnp.array([-(2**30), 2**30], jnp.int32)
    assert np.all(np.asarray(masks.visibility_mask(config, q_pos, kv_pos)))


def test_reference_takes_flash_attentions_keywords_but_no_implementation():
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
    kv = jax.random.normal(jax.random.key(1), (1, 8, 1, 16))
    out, lse = sf.attention_reference(q, kv, kv, causal=True, window=(2, 0), return_lse=True)
    pos = np.arange(8)
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] <= 2)  # causal, left 2
    expected_out, expected_lse = naive_attention_numpy(q, kv, kv, np.broadcast_to(mask, (1, 8, 8)),
                                                       scale=16**-0.5)  # fmt: skip
    np.testing.assert_allclose(out, expected_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lse, expected_lse, atol=1e-5, rtol=1e-5)
    for keyword in ("implementation", "block_sizes"):
        with pytest.raises(TypeError, match=f"takes no {keyword}="):
            sf.attention_reference(q, kv, kv, **{keyword: None})
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        sf.attention_reference(q, kv, kv, casual=True)
