"""The Triton grouped matmul kernels without a GPU: refusals, and compiled for sm_80 / sm_90
with no register spills and shared memory within the limit.

Their numerics (the TESTING.md matrix) run in test_grouped_matmul_backends.py: under the
Triton interpreter on CPU (`triton_interpret`) and through jax-triton on a GPU (`triton_gpu`).
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.grouped_matmul import tiles

pytest.importorskip("torch", reason="the Triton interpreter runs on torch CPU tensors")
pytest.importorskip("triton", reason="needs triton (pip install triton)")

from shardfuse.kernels.grouped_matmul import triton_compile  # noqa: E402


def test_refuses_without_a_gpu_and_bad_tiles():
    lhs = jax.random.normal(jax.random.key(5), (16, 16), jnp.float32)
    rhs = jnp.ones((2, 16, 16))
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
        sf.grouped_matmul(lhs, rhs, [8, 8], implementation="triton")
    with pytest.raises(NotImplementedError, match="power of two >= 16, got 24"):
        with tiles.block_sizes(tiles.BlockSizes(block_n=24)):
            sf.grouped_matmul(lhs, rhs, [8, 8], implementation="triton")


@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_without_spills(arch):
    for dtype in ("bfloat16", "float32"):
        for kernel in triton_compile.KERNELS:
            stats = triton_compile.compile_stats(arch=arch, dtype=dtype, kernel=kernel)
            assert stats.spill_stores == 0 and stats.spill_loads == 0, stats
            assert stats.shared_memory <= stats.shared_memory_limit, stats
            assert 0 < stats.registers <= 255, stats
