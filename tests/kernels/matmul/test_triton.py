"""The Triton matmul kernel without a GPU: refusals, and compiled for sm_80 / sm_90 with no
register spills and shared memory within the limit.

Its numerics (the TESTING.md matrix) run in test_matmul_backends.py: under the Triton
interpreter on CPU (`triton_interpret`) and through jax-triton on a GPU (`triton_gpu`).
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.matmul import MatmulBlockSizes

pytest.importorskip("torch", reason="the Triton interpreter runs on torch CPU tensors")
pytest.importorskip("triton", reason="needs triton (pip install triton)")

from shardfuse.kernels.matmul import triton_compile  # noqa: E402


def test_refuses_without_a_gpu_and_bad_blocks():
    a = b = jax.random.normal(jax.random.key(5), (16, 16), jnp.float32)
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
