"""Independent checks of the math `shardfuse.layers.reference` imports from the layers.

The references call the layers' own `rope`, `activate` and `normalize`, so
comparing a layer with its reference cannot catch a mistake in those three.
Here each is checked against a separate NumPy formulation instead.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.layers.attention import rope
from shardfuse.layers.block import normalize
from shardfuse.layers.mlp import activate


def test_rope_is_a_complex_rotation_per_frequency():
    # RoFormer in rotate-half form: pair (x_i, x_{i + D/2}) as x_i + j x_{i + D/2}, rotated
    # by angle p * theta^(-2i / D).
    B, T, N, D, theta = 2, 5, 3, 8, 100.0
    x = np.random.default_rng(0).standard_normal((B, T, N, D)).astype(np.float32)
    positions = np.array([0, 3, 1, 7, 2])
    freq = theta ** (-2.0 * np.arange(D // 2) / D)  # [D/2]
    z = (x[..., : D // 2] + 1j * x[..., D // 2 :]) * np.exp(1j * positions[:, None, None] * freq)
    expected = np.concatenate([z.real, z.imag], axis=-1)  # [B, T, N, D]
    actual = rope(jnp.asarray(x), jnp.asarray(positions, jnp.int32), theta)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_normalize(kind):
    x = np.random.default_rng(1).standard_normal((3, 4, 16)).astype(np.float32)
    scale = np.linspace(0.5, 1.5, 16, dtype=np.float32)
    bias = np.linspace(-1.0, 1.0, 16, dtype=np.float32) if kind == "layernorm" else None
    centred = x - x.mean(-1, keepdims=True) if kind == "layernorm" else x
    expected = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-6) * scale
    if bias is not None:
        expected = expected + bias
    actual = normalize(kind, jnp.asarray(x), jnp.asarray(scale), bias, 1e-6)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-5)


def test_swiglu_reads_interleaved_gate_and_up_columns():
    h = np.random.default_rng(2).standard_normal((2, 3, 8)).astype(np.float32)
    gate, up = h[..., 0::2], h[..., 1::2]  # columns (gate_0, up_0, gate_1, up_1, ...)
    expected = gate / (1.0 + np.exp(-gate)) * up
    actual = activate("swiglu", jnp.asarray(h))
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-5, atol=1e-6)
