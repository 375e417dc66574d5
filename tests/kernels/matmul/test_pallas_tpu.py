"""The Pallas TPU matmul kernel: tiling, refusals, Mosaic lowering.

Its numerics in TPU interpret mode (the TESTING.md matrix, the multi-tile grid
with padding included) are in test_matmul_backends.py.
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.matmul import MatmulBlockSizes, pallas_tpu
from shardfuse.kernels.pallas_interpret import interpret_mode


def _inputs(M, C, N, dtype=jnp.float32):
    ka, kb, kc, kd = jax.random.split(jax.random.key(3), 4)
    a = (0.5 * jax.random.normal(ka, (M, C))).astype(dtype)
    b = (jax.random.normal(kb, (C, N)) / C**0.5).astype(dtype)
    c = jax.random.normal(kc, (M, N), jnp.float32)
    bias = jax.random.normal(kd, (N,), jnp.float32)
    return a, b, c, bias


def test_tiling_defaults_and_padding():
    t = pallas_tpu.tiling(1000, 130, 70, MatmulBlockSizes())
    assert (t.block_m, t.block_n, t.block_k) == (256, 256, 128)
    assert (t.M, t.N, t.C) == (1024, 256, 128)


@pytest.mark.parametrize(
    "blocks, match",
    [
        (MatmulBlockSizes(block_n=100), "block_n to be a multiple of 128, got 100"),
        (MatmulBlockSizes(block_m=12), "block_m to be a multiple of 16, got 12"),
    ],
)
def test_untileable_block_sizes_are_not_implemented(blocks, match):
    a, b, _, _ = _inputs(16, 128, 128)
    with pytest.raises(NotImplementedError, match=match):
        sf.matmul(a, b, implementation="pallas_tpu", block_sizes=blocks)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu(dtype):
    """The real Mosaic kernel (not the interpreter) lowers for TPU, forward and backward."""
    a, b, c, bias = _inputs(64, 256, 256, dtype)

    def loss(a, b, c, bias):
        out = sf.matmul(
            a, b, addend=c, bias=bias, out_dtype=jnp.float32, implementation="pallas_tpu"
        )
        return out.sum()

    with interpret_mode(False):
        lowered = (
            jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
            .trace(a, b, c, bias)
            .lower(lowering_platforms=("tpu",))
        )
    text = lowered.as_text()
    # forward, da and db: three Mosaic kernels
    assert text.count('kernel_name = "shardfuse_matmul_plus_reduce"') == 3


def test_float16_is_refused_by_mosaic():
    a, b, _, _ = _inputs(16, 128, 128, jnp.float16)
    with interpret_mode(False), pytest.raises(NotImplementedError, match="float32 and"):
        sf.matmul(a, b, implementation="pallas_tpu")
