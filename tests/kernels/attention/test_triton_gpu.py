"""The Triton attention kernels on an NVIDIA GPU through jax-triton: dispatch and fallback.

Marked `gpu`: skipped without one (`python -m pytest -m gpu` runs them). The
TESTING.md matrix runs on the GPU as the `triton_gpu` backend of
test_attention_backends.py, and on CPU under the Triton interpreter as
`triton_interpret`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("jax_triton")


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
