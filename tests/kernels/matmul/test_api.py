"""sf.matmul: the reference itself, validation, empty shapes and dispatch.

The numerics of every implementation (the TESTING.md matrix) are in
test_matmul_backends.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.matmul import MatmulBlockSizes
from shardfuse.kernels.matmul import api as matmul_api
from shardfuse.testing import assert_close

IMPLEMENTATIONS = ["xla", "pallas_tpu"]  # those that run on CPU (pallas_tpu interpreted)


def _inputs(shape_a, n, dtype, *, with_c=True, with_bias=True, c_dtype=jnp.float32, seed=0):
    # Scaled so that outputs and gradients are O(1): the bf16 absolute caps of
    # TESTING.md (1e-2 outputs, 5e-2 gradients) then bound real errors, not ulps.
    keys = jax.random.split(jax.random.key(seed), 4)
    a = (0.5 * jax.random.normal(keys[0], shape_a, jnp.float32)).astype(dtype)
    b = jax.random.normal(keys[1], (shape_a[-1], n), jnp.float32) / max(shape_a[-1], 1) ** 0.5
    b = b.astype(dtype)
    c = (0.1 * jax.random.normal(keys[2], (*shape_a[:-1], n), jnp.float32)).astype(c_dtype)
    bias = (0.1 * jax.random.normal(keys[3], (n,), jnp.float32)).astype(c_dtype)
    return a, b, (c if with_c else None), (bias if with_bias else None)


def _reference(a, b, c, bias, out_dtype=None):
    return sf.matmul(a, b, addend=c, bias=bias, out_dtype=out_dtype, implementation="reference")


def test_reference_is_the_formula():
    a, b, c, bias = _inputs((3, 5), 4, jnp.float32)
    expected = np.asarray(a, np.float64) @ np.asarray(b, np.float64) + np.asarray(c) + bias
    np.testing.assert_allclose(_reference(a, b, c, bias), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("implementation", ["reference", *IMPLEMENTATIONS])
def test_empty_shapes(implementation):
    b = jnp.ones((4, 3))
    assert sf.matmul(jnp.ones((0, 4)), b, implementation=implementation).shape == (0, 3)
    out = sf.matmul(
        jnp.ones((2, 0)), jnp.ones((0, 3)), bias=jnp.arange(3.0), implementation=implementation
    )
    np.testing.assert_array_equal(out, np.broadcast_to(np.arange(3.0), (2, 3)))


def test_default_dispatch_runs_on_cpu():
    a, b, c, bias = _inputs((8, 16), 4, jnp.float32)
    assert_close(sf.matmul(a, b, addend=c, bias=bias), _reference(a, b, c, bias))
    assert "xla" in matmul_api.candidates(None)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(a=np.ones((3, 4), np.int32)), TypeError, "a has dtype int32"),
        (dict(a=np.ones((3, 4), np.float64)), TypeError, "a has dtype float64"),
        (dict(a=jnp.ones((4,))), ValueError, r"a has rank 1 .*\[\.\.\., M, C\]"),
        (dict(b=jnp.ones((2, 4, 5))), ValueError, r"b has rank 3 .*\[C, N\]"),
        (dict(b=jnp.ones((5, 5))), ValueError, "a .* has C=4, b .* has C=5"),
        (dict(b=jnp.ones((4, 5), jnp.bfloat16)), TypeError, "a and b must share one dtype"),
        (
            dict(addend=jnp.ones((3, 4))),
            ValueError,
            r"addend has shape \(3, 4\); expected .*\(3, 5",
        ),
        (dict(bias=jnp.ones((3,))), ValueError, r"bias has shape \(3,\); expected \[N\]"),
        (dict(out_dtype=jnp.int8), TypeError, "out_dtype=int8 is not supported"),
        (dict(implementation="cuda"), ValueError, "implementation='cuda' is not one of"),
        (dict(block_sizes=(8, 8, 8)), TypeError, "block_sizes must be a MatmulBlockSizes"),
        (dict(a="x"), TypeError, "a must be an array"),
    ],
)
def test_bad_input(kwargs, error, match):
    args = dict(a=jnp.ones((3, 4)), b=jnp.ones((4, 5)))
    args.update(kwargs)
    a, b = args.pop("a"), args.pop("b")
    if isinstance(a, str):
        with pytest.raises(error, match=match):
            matmul_api.base.validate(a, b)
        return
    with pytest.raises(error, match=match):
        sf.matmul(a, b, **args)


def test_block_sizes_must_be_positive():
    with pytest.raises(ValueError, match="block_m=0 must be a positive int"):
        MatmulBlockSizes(block_m=0)
