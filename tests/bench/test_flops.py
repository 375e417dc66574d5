"""FLOP and byte formulas of the benchmark harness, against brute force and XLA's own count."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.bench import flops


def _brute_force_pairs(T, S, causal, window):
    q_pos = np.arange(T)[:, None] + S - T
    kv_pos = np.arange(S)[None, :]
    mask = np.ones((T, S), bool)
    if causal:
        mask &= kv_pos <= q_pos
    if window is not None:
        left, right = window
        if left is not None:
            mask &= q_pos - left <= kv_pos
        if right is not None:
            mask &= kv_pos <= q_pos + right
    return int(mask.sum())


@pytest.mark.parametrize(
    "T, S", [(1, 1), (7, 7), (5, 13), (13, 5), (64, 64), (0, 4)], ids=lambda x: str(x)
)
def test_visible_pairs_matches_the_mask(T, S):
    for causal, window in itertools.product(
        (False, True), (None, (3, 0), (0, 2), (None, 1), (2, None), (100, 100))
    ):
        expected = _brute_force_pairs(T, S, causal, window)
        assert flops.visible_pairs(T, S, causal=causal, window=window) == expected, (
            causal,
            window,
        )


def test_causal_is_about_half_and_fwd_bwd_is_3_5x():
    T = 1024
    full = flops.attention_flops(2, T, T, 8, 64)
    causal = flops.attention_flops(2, T, T, 8, 64, causal=True)
    assert full == 4 * 2 * 8 * 64 * T * T
    assert causal == full * (T + 1) / (2 * T)
    assert flops.attention_flops(2, T, T, 8, 64, causal=True, mode="fwd+bwd") == 3.5 * causal


def test_attention_bytes():
    B, T, S, H, K, D, item = 2, 16, 32, 8, 2, 64, 2
    q = B * T * H * D * item
    kv = B * S * K * D * item
    lse = B * H * T * 4
    fwd = flops.attention_bytes(B, T, S, H, K, D, item)
    assert fwd == 2 * q + 2 * kv + lse
    both = flops.attention_bytes(B, T, S, H, K, D, item, mode="fwd+bwd")
    assert both == fwd + (3 * q + 2 * kv + lse) + (q + 2 * kv)


def test_bad_mode_and_lengths_raise():
    with pytest.raises(ValueError, match="mode='bwd'"):
        flops.attention_flops(1, 2, 2, 1, 8, mode="bwd")
    with pytest.raises(ValueError, match="T=-1"):
        flops.visible_pairs(-1, 2)
    with pytest.raises(ValueError, match="num_devices=0"):
        flops.all_gather_bytes(10, 0)


def test_matmul_and_collective_formulas():
    assert flops.matmul_flops(3, 5, 7) == 2 * 3 * 5 * 7
    assert flops.matmul_bytes(3, 5, 7, 2, out_itemsize=4) == (21 + 35) * 2 + 15 * 4
    assert flops.all_gather_bytes(1000, 8) == 7000
    assert flops.reduce_scatter_bytes(8000, 8) == 7000
    assert flops.all_gather_bytes(1000, 1) == flops.reduce_scatter_bytes(1000, 1) == 0


def test_formulas_agree_with_xla_cost_analysis():
    """Loop-free programs: XLA's count of a dot equals 2MNC; attention's dots dominate its total."""
    a = jnp.ones((32, 48), jnp.float32)
    b = jnp.ones((48, 16), jnp.float32)
    cost = jax.jit(jnp.dot).lower(a, b).compile().cost_analysis()
    assert cost["flops"] == flops.matmul_flops(32, 16, 48)

    from shardfuse.kernels.attention import attention_reference

    B, T, H, D = 1, 64, 2, 64
    q = jnp.ones((B, T, H, D), jnp.float32)
    cost = jax.jit(attention_reference).lower(q, q, q).compile().cost_analysis()
    analytic = flops.attention_flops(B, T, T, H, D)
    # The rest is softmax and masking: O(T * S) elementwise against O(T * S * D) in the dots.
    assert analytic <= cost["flops"] <= 1.25 * analytic
