"""Grouped matmul as XLA's ragged dot: `lax.ragged_dot_general`, forward and both gradients.

The forward is a ragged dot with ragged non-contracting rows (`lhs [M, K]`
against `rhs [G, K, N]`, or `[G, N, K]` contracting rhs's last dim), the
weights' gradient one with a ragged contracting dim (`x [M, A]`, `y [M, B]` ->
`[G, A, B]`); `base.differentiable` makes the pair the op's VJP. Under an
offset (expert parallelism) the rows are rotated so that the local groups
start at row 0 (`jnp.roll` by `-start`, O(M*K) memory), and the result rotated
back: rows past the local groups come out zero, as the ragged dot defines them.

How XLA runs it depends on the platform: TPUs and GPUs have a ragged dot
instruction (`chlo.ragged_dot`); on CPU, jax 0.10-0.12 lower it through a
dense expansion (a masked `[G, M, K]` copy of `lhs`, G times the FLOPs and
memory), which is why it is not CPU's default.
"""

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.grouped_matmul import base
from shardfuse.kernels.precision import dot_precision


def _rotate(x, start, sign: int):
    return x if start is None else jnp.roll(x, sign * start, axis=0)


def forward(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start):
    """`out [M, N]` = `lhs [M, K]` by group against `rhs`, float32 accumulation."""
    contract = 2 if config.transpose_rhs else 1
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [contract]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    out = lax.ragged_dot_general(
        _rotate(lhs, start, -1),
        rhs,
        sizes,
        numbers,
        precision=dot_precision(lhs.dtype, config.precision),
        preferred_element_type=jnp.float32,
    )  # [M, N]
    return _rotate(out, start, 1).astype(config.out_dtype)


def transposed(config: base.GroupedMatmulConfig, x, y, sizes, start, out_dtype):
    """`[G, A, B]`: `x [M, A]^T @ y [M, B]` over each local group's rows (0 for empty groups)."""
    numbers = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    out = lax.ragged_dot_general(
        _rotate(x, start, -1),
        _rotate(y, start, -1),
        sizes,
        numbers,
        precision=dot_precision(x.dtype, config.precision),
        preferred_element_type=jnp.float32,
    )  # [G, A, B]
    return out.astype(out_dtype)


grouped_matmul = base.differentiable(forward, transposed)
