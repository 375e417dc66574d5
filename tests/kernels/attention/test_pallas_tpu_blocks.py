"""pallas_tpu attention: block sizes and the tiling rule, block tables, refusals and fallback.

Pure XLA or no computation at all: fast.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import api, base, masks
from shardfuse.kernels.attention import pallas_tpu_blocks as blocks
from shardfuse.kernels.pallas_interpret import interpret_mode
from shardfuse.testing import assert_close


def test_block_sizes_defaults_and_rule():
    assert blocks.PallasTPUBlockSizes.get_default(jnp.bfloat16, 128) == blocks.PallasTPUBlockSizes(
        512, 512, 256, 512
    )
    assert blocks.PallasTPUBlockSizes.get_default(jnp.float32, 128) == blocks.PallasTPUBlockSizes(
        256, 256, 128, 256
    )
    assert blocks.PallasTPUBlockSizes.get_default(jnp.float32, 256) == blocks.PallasTPUBlockSizes(
        128, 128, 128, 128
    )
    with pytest.raises(ValueError, match=r"block_q=100 must be a multiple of 128"):
        blocks.PallasTPUBlockSizes(100, 128, 128, 128)
    with pytest.raises(ValueError, match=r"block_kv_bwd=0 must be a positive int"):
        blocks.PallasTPUBlockSizes(128, 128, 128, 0)
    assert blocks.fit_block(97, 512) == 128
    assert blocks.fit_block(600, 512) == 384  # two even tiles, not 512 + 88
    assert blocks.fit_block(1024, 512) == 512


def test_tiling_rule_check():
    blocks.check_tiling("q", (None, None, 128, 64), (1, 2, 256, 64))  # full last dim
    blocks.check_tiling("lse", (None, 8, 256), (2, 8, 512))
    with pytest.raises(NotImplementedError, match="tiling rule"):
        blocks.check_tiling("q", (None, None, 100, 128), (1, 2, 256, 128))
    with pytest.raises(NotImplementedError, match="tiling rule"):
        blocks.check_tiling("lse", (None, 1, 64), (2, 8, 512))


def _brute_force_states(config, q_pos, kv_pos, q_seg, kv_seg, T, S, bq, bk):
    visible = np.asarray(
        jnp.broadcast_to(
            masks.visibility_mask(config, q_pos, kv_pos, q_seg, kv_seg),
            (1 if q_seg is None else q_seg.shape[0], q_pos.shape[0], kv_pos.shape[0]),
        )
    )
    visible = visible & (np.arange(q_pos.shape[0]) < T)[:, None] & (np.arange(kv_pos.shape[0]) < S)
    nq, nk = q_pos.shape[0] // bq, kv_pos.shape[0] // bk
    tiles = visible.reshape(visible.shape[0], nq, bq, nk, bk)
    some, every = tiles.any(axis=(2, 4)), tiles.all(axis=(2, 4))
    return np.where(every, blocks.FULL, np.where(some, blocks.PARTIAL, blocks.SKIP))


@pytest.mark.parametrize(
    "causal, window, segments",
    [(True, None, False), (False, (70, 10), False), (True, (200, None), True), (False, None, True)],
)
def test_block_states_match_brute_force(causal, window, segments):
    T, S, bq, bk = 300, 500, 128, 128
    Tp, Sp = 384, 512
    rng = np.random.default_rng(0)
    q_pos = jnp.asarray(np.pad(np.arange(T) + 150, (0, Tp - T)), jnp.int32)
    kv_pos = jnp.asarray(np.pad(np.arange(S), (0, Sp - S)), jnp.int32)
    q_seg = kv_seg = None
    if segments:
        q_seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, Tp)), axis=1), jnp.int32)
        kv_seg = jnp.asarray(np.sort(rng.integers(0, 4, (2, Sp)), axis=1), jnp.int32)
    config = base.AttentionConfig(causal=causal, window=window, logit_softcap=None, scale=1.0)
    states = blocks.block_states(
        config, q_pos, kv_pos, q_seg, kv_seg, length_q=T, length_kv=S, block_q=bq, block_kv=bk
    )
    expected = _brute_force_states(config, q_pos, kv_pos, q_seg, kv_seg, T, S, bq, bk)
    np.testing.assert_array_equal(np.asarray(states), expected)
    assert (expected == blocks.SKIP).any() or not (causal or window)


def test_fetch_indices_hold_the_next_computed_block():
    S, P, F = blocks.SKIP, blocks.PARTIAL, blocks.FULL
    states = jnp.asarray([[S, S, P, F, S], [F, S, S, P, S], [S, S, S, S, S]], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(blocks.fetch_indices(states)),
        [[2, 2, 2, 3, 3], [0, 3, 3, 3, 3], [0, 0, 0, 0, 0]],
    )


def _qkv(D=72, dtype=jnp.float32):
    q = jax.random.normal(jax.random.key(0), (1, 16, 2, D), dtype)
    k = v = jax.random.normal(jax.random.key(1), (1, 16, 1, D), dtype)
    return q, k, v


def test_refusals_raise_not_implemented():
    q, k, v = _qkv(D=72)
    with pytest.raises(NotImplementedError, match="D=72"):
        sf.flash_attention(q, k, v, implementation="pallas_tpu")
    q, k, v = _qkv(D=128, dtype=jnp.float16)
    with pytest.raises(NotImplementedError, match="float16"):
        sf.flash_attention(q, k, v, implementation="pallas_tpu")
    q, k, v = _qkv(D=128)
    with pytest.raises(NotImplementedError, match="block_q=64"):
        sf.flash_attention(
            q, k, v, implementation="pallas_tpu", block_sizes=sf.BlockSizes(block_q=64)
        )
    with pytest.raises(TypeError, match="InterpretParams"):
        with interpret_mode("yes"):
            pass


def test_dispatch_falls_back_to_xla(monkeypatch):
    """With pallas_tpu preferred, an odd head dim falls back to xla (dispatch catches it)."""
    monkeypatch.setitem(api.PREFERENCE, jax.default_backend(), ("pallas_tpu", "xla"))
    q, k, v = _qkv(D=72)
    out = sf.flash_attention(q, k, v, causal=True)
    expected = sf.flash_attention(q, k, v, causal=True, implementation="xla")
    assert_close(out, expected)
