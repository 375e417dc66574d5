"""The matmul oracle: one einsum at float32 accumulation, then the epilogue.

    out[..., m, n] = sum_c a[..., m, c] b[c, n]  (+ addend[..., m, n])  (+ bias[n])

`Precision.HIGHEST` for float32 inputs (no TF32 / bf16 passes), float32
accumulation for every input dtype, the additions in float32, one cast to
`out_dtype` at the end. No tiling, no custom_vjp: gradients are autodiff's.
"""

import jax.numpy as jnp

from shardfuse.kernels.matmul import base
from shardfuse.kernels.precision import dot_precision


def reference_matmul(config: base.MatmulConfig, a, b, addend, bias):
    """`a [..., M, C] @ b [C, N] (+ addend [..., M, N]) (+ bias [N])` on validated inputs."""
    acc = jnp.einsum(
        "...MC,CN->...MN",
        a,
        b,
        preferred_element_type=jnp.float32,
        precision=dot_precision(a.dtype, config.precision),
    )
    return base.epilogue(acc, addend, bias, config.out_dtype)
