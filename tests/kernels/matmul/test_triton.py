"""The Triton matmul kernel without a GPU: the interpreter against the reference, and
compiled for sm_80 / sm_90 with no register spills and shared memory within the limit."""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.matmul import MatmulBlockSizes, base
from shardfuse.testing import assert_close, assert_close_low_precision

pytest.importorskip("torch", reason="the Triton interpreter runs on torch CPU tensors")
pytest.importorskip("triton", reason="needs triton (pip install triton)")

from shardfuse.kernels.matmul import triton_compile, triton_gpu  # noqa: E402
from shardfuse.kernels.triton.launch import InterpretLauncher  # noqa: E402

LAUNCHER = InterpretLauncher()
# Small tiles so that the tiny shapes still span several tiles, partial edges and K steps.
BLOCKS = MatmulBlockSizes(block_m=16, block_n=16, block_k=16)


def _inputs(shape_a, n, dtype):
    ka, kb, kc, kd = jax.random.split(jax.random.key(5), 4)
    a = (0.5 * jax.random.normal(ka, shape_a)).astype(dtype)
    b = (jax.random.normal(kb, (shape_a[-1], n)) / shape_a[-1] ** 0.5).astype(dtype)
    c = 0.1 * jax.random.normal(kc, (*shape_a[:-1], n), jnp.float32)
    bias = 0.1 * jax.random.normal(kd, (n,), jnp.float32)
    return a, b, c, bias


def _interpreted(a, b, c, bias, out_dtype=None):
    config = base.validate(a, b, c=c, bias=bias, out_dtype=out_dtype, block_sizes=BLOCKS)
    return triton_gpu.matmul(config, a, b, c, bias, launcher=LAUNCHER)


def _reference(a, b, c, bias, out_dtype=None):
    return sf.matmul(a, b, addend=c, bias=bias, out_dtype=out_dtype, implementation="reference")


def test_forward_float32_multi_tile():
    a, b, c, bias = _inputs((2, 37, 45), 29, jnp.float32)  # 3 x 2 tiles, 3 K steps, ragged
    assert_close(jax.jit(_interpreted)(a, b, c, bias), _reference(a, b, c, bias))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_forward_low_precision(dtype):
    a, b, c, bias = _inputs((33, 40), 24, dtype)
    out = _interpreted(a, b, c, None)
    up = [x.astype(jnp.float32) for x in (a, b)]
    assert out.dtype == dtype
    assert_close_low_precision(out, _reference(*up, c, None), _reference(a, b, c, None))


def test_gradients_float32():
    a, b, c, bias = _inputs((20, 24), 18, jnp.float32)
    cotangent = jax.random.normal(jax.random.key(9), (20, 18))

    def vjp(f):
        return jax.vjp(f, a, b, c, bias)[1](cotangent)

    got = jax.jit(lambda: vjp(_interpreted))()
    for name, g, r in zip("a b c bias".split(), got, vjp(_reference), strict=True):
        assert_close(g, r, kind="grad", name=f"d{name}")


def test_refuses_without_a_gpu_and_bad_blocks():
    a, b, _, _ = _inputs((16, 16), 16, jnp.float32)
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
        sf.matmul(a, b, implementation="triton")
    with pytest.raises(NotImplementedError, match="power of two >= 16, got 24"):
        sf.matmul(a, b, implementation="triton", block_sizes=MatmulBlockSizes(block_m=24))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compiles_without_spills(arch, dtype):
    stats = triton_compile.compile_stats(arch=arch, dtype=dtype)
    assert stats.spill_stores == 0 and stats.spill_loads == 0, stats
    assert stats.shared_memory <= stats.shared_memory_limit, stats


@pytest.mark.gpu
def test_on_gpu():
    a, b, c, bias = _inputs((2, 300, 256), 384, jnp.bfloat16)
    out = sf.matmul(a, b, addend=c, bias=bias, implementation="triton")
    up = [x.astype(jnp.float32) for x in (a, b)]
    ref32 = _reference(*up, c, bias)
    assert_close_low_precision(out, ref32, _reference(a, b, c, bias))
