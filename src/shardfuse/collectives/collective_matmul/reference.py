"""The collective matmul oracles: JAX's own collectives next to one reference matmul.

    all_gather_matmul:     matmul(all_gather(x, tiled=True), w)
    matmul_reduce_scatter: psum_scatter(matmul(x, w) in float32, tiled=True)
    matmul_all_reduce:     psum(matmul(x, w) in float32)

The matmul is `sf.matmul(..., implementation="reference")` (float32
accumulation, HIGHEST precision for float32); partial sums are reduced in
float32 and cast to x's dtype once. Autodiff gives the gradients. This is also
the "plain XLA collective" form the benchmarks compare the rings against.
"""

import jax.numpy as jnp
from jax import lax

from shardfuse.collectives.collective_matmul.base import RingPlan
from shardfuse.kernels.matmul import api as matmul_api


def _matmul(a, b, out_dtype, precision=None):
    return matmul_api.matmul(
        a, b, out_dtype=out_dtype, implementation="reference", precision=precision
    )


def all_gather_matmul(x, w, plan: RingPlan):
    """`all_gather(x, axis=plan.axis, tiled=True) @ w`."""
    gathered = lax.all_gather(x, plan.axis_name, axis=plan.axis, tiled=True)
    return _matmul(gathered, w, x.dtype, plan.precision)


def matmul_reduce_scatter(x, w, plan: RingPlan):
    """`psum_scatter(x @ w, scatter_dimension=plan.axis, tiled=True)`, reduced in float32."""
    partial = _matmul(x, w, jnp.float32, plan.precision)
    return lax.psum_scatter(
        partial, plan.axis_name, scatter_dimension=plan.axis, tiled=True
    ).astype(x.dtype)


def matmul_all_reduce(x, w, plan: RingPlan | None, axis_name: str, precision=None):
    """`psum(x @ w)`, reduced in float32."""
    del plan
    return lax.psum(_matmul(x, w, jnp.float32, precision), axis_name).astype(x.dtype)
