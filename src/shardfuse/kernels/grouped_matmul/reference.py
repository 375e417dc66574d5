"""The grouped matmul oracle: an explicit loop over groups, each a masked dense product.

    out[m] = lhs[m] @ rhs[j]   for the rows m of local group j;   0 for every other row

For each local group `j` (a `lax.fori_loop`, so that G = 256 compiles as fast as
G = 1) the rows outside the group are zeroed in `lhs` with a select (not a
multiply, so NaN in another group's rows never reaches this one), the whole
`[M, K] @ [K, N]` product is taken at `Precision.HIGHEST` for float32 inputs
with float32 accumulation, and added to a float32 `[M, N]` carry; the sum is
cast once. G times the FLOPs of the op, memory O(M*K + M*N): slow and plain on
purpose. No custom_vjp: gradients are autodiff's through the loop.
"""

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.grouped_matmul import base
from shardfuse.kernels.precision import dot_precision


def reference_grouped_matmul(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start):
    """`out [M, N]` on validated inputs in the normal form of `base.local_groups`."""
    M = lhs.shape[0]
    owner = base.row_groups(sizes, start, M)  # [M]
    precision = dot_precision(lhs.dtype, config.precision)
    contract = "KN" if not config.transpose_rhs else "NK"

    def add_group(j, acc):
        rows = jnp.where((owner == j)[:, None], lhs, 0)  # [M, K], other rows 0
        product = jnp.einsum(
            f"MK,{contract}->MN", rows, rhs[j], precision=precision,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return acc + product

    acc = jnp.zeros(base.output_shape(lhs, rhs, config), jnp.float32)
    acc = lax.fori_loop(0, rhs.shape[0], add_group, acc)
    return acc.astype(config.out_dtype)
