"""The precision of the products in every kernel: one rule for attention, matmul and collectives.

Float32 inputs multiply at `Precision.HIGHEST` (no TF32 or bf16 passes, so
float32 results match the float32 oracle); 16-bit inputs at `DEFAULT` (the
native MXU / tensor-core path). Accumulation is float32 in both cases; that
is each kernel's `preferred_element_type`, not a precision.

`SUPPORTED_DTYPES` is the one list of input dtypes the ops accept; a backend
that runs fewer (TPUs have no float16 MXU path) derives its list from it.
"""

import jax.numpy as jnp
from jax import lax

# The input dtypes every op validates against (attention, matmul, collective matmul).
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dot_precision(dtype, precision: lax.Precision | None = None) -> lax.Precision:
    """`precision` if given, else HIGHEST for float32 inputs and DEFAULT for 16-bit ones.

    Example:
      >>> dot_precision(jnp.float32).name, dot_precision(jnp.bfloat16).name
      ('HIGHEST', 'DEFAULT')
      >>> dot_precision(jnp.float32, lax.Precision.DEFAULT).name
      'DEFAULT'
    """
    if precision is not None:
        return precision
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
