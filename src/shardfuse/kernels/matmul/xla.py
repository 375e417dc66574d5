"""Matmul-plus-reduce as one XLA GEMM with the add in its epilogue.

`a [..., M, C]` is flattened to one `[M', C]` operand so the product is a
single 2-D `dot_general` with a float32 result (`preferred_element_type`),
followed by `+ addend` and `+ bias` in float32 and one cast. XLA fuses the adds
and the cast into the GEMM's output (cuBLASLt epilogue with beta = 1 on GPU,
an output fusion on TPU), so the accumulator `addend` of a reduce-scatter ring
step is read once and never round-trips through memory in `out_dtype`.

Autodiff gives the backward (two GEMMs, `dA = dO b^T`, `dB = a^T dO`).
"""

import jax.numpy as jnp
from jax import lax

from shardfuse.kernels.matmul import base
from shardfuse.kernels.precision import dot_precision


def matmul(config: base.MatmulConfig, a, b, addend, bias):
    """`a [..., M, C] @ b [C, N] (+ addend) (+ bias)` on validated inputs, float32 accumulation."""
    out_shape = base.output_shape(a, b)
    a2 = a.reshape(-1, a.shape[-1])  # [M', C], M' = prod(leading dims) * M
    acc = lax.dot_general(
        a2,
        b,
        (((1,), (0,)), ((), ())),
        precision=dot_precision(a.dtype, config.precision),
        preferred_element_type=jnp.float32,
    ).reshape(out_shape)  # [..., M, N]
    return base.epilogue(acc, addend, bias, config.out_dtype)
