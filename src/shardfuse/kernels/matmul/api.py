"""Public matmul entry point (`sf.matmul`) and the dispatch over implementations.

`matmul` validates once, before anything is traced, then calls the requested
implementation, or with `implementation=None` the best one for the platform:
a backend that raises `NotImplementedError` (valid input it cannot handle:
dtype, shape, platform) hands over to the next one.
"""

import math

import jax
import jax.numpy as jnp

from shardfuse.kernels import dispatch
from shardfuse.kernels.matmul import base

# name -> (module, function). Modules are imported on first use only, so that
# optional dependencies (triton, jax_triton) are never imported by `import shardfuse`.
IMPLEMENTATIONS = {
    "reference": ("shardfuse.kernels.matmul.reference", "reference_matmul"),
    "xla": ("shardfuse.kernels.matmul.xla", "matmul"),
    "pallas_tpu": ("shardfuse.kernels.matmul.pallas_tpu", "matmul"),
    "triton": ("shardfuse.kernels.matmul.triton_gpu", "matmul"),
}

# What `implementation=None` tries, best first, per platform. On GPUs XLA's GEMM
# (cuBLAS with the add in its epilogue) stays the default: the Triton kernel is
# checked (interpreter, sm_80/sm_90 compiles) but has not been timed on a GPU.
PREFERENCE = {
    "tpu": ("pallas_tpu", "xla"),
    "gpu": ("xla",),
    "cuda": ("xla",),
    "rocm": ("xla",),
    "cpu": ("xla",),
}


def load_implementation(name: str):
    """Returns the backend function `name`, or raises NotImplementedError saying why not."""
    return dispatch.load("matmul", IMPLEMENTATIONS, name)


def candidates(implementation) -> tuple[str, ...]:
    """The implementations to try, best first; raises ValueError for an unknown name."""
    return dispatch.candidates(IMPLEMENTATIONS, PREFERENCE, implementation)


def _as_array(x):
    return x if x is None or isinstance(x, jax.Array) else jnp.asarray(x)


def matmul(
    a,
    b,
    *,
    c=None,
    bias=None,
    out_dtype=None,
    implementation: str | None = None,
    block_sizes: base.MatmulBlockSizes | None = None,
    precision=None,
):
    """Matmul-plus-reduce: `a @ b (+ c) (+ bias)` with float32 accumulation and a fused add.

        out[..., m, n] = cast(sum_c a[..., m, c] b[c, n] + c[..., m, n] + bias[n])

    The products accumulate in float32 (HIGHEST precision for float32 inputs),
    `c` and `bias` are added in float32 in the epilogue and the sum is cast to
    `out_dtype` once. This is the step of a reduce-scatter ring:
    `acc = matmul(x, w_chunk, c=incoming_partial_sum, out_dtype=jnp.float32)`.

    Args:
      a: `[..., M, C]` float32, bfloat16 or float16; leading dims are batch dims.
      b: `[C, N]`, same dtype as `a`.
      c: optional addend `[..., M, N]` (the output shape), any supported float
        dtype (float32 partial sums are typical).
      bias: optional `[N]`, any supported float dtype.
      out_dtype: result dtype; default `a.dtype`.
      implementation: None (best for the platform), "reference", "xla",
        "pallas_tpu" or "triton".
      block_sizes: optional `MatmulBlockSizes(block_m, block_n, block_k)` for the
        tiled kernels.
      precision: None (HIGHEST for float32 inputs, DEFAULT for 16-bit), a
        `jax.lax.Precision` or its name; as `precision` of `jnp.dot`. Backends
        that cannot honour it raise NotImplementedError (dispatch falls back).

    Returns:
      `[..., M, N]` in `out_dtype`.

    Raises:
      ValueError: ranks or shapes that do not fit, or an unknown implementation.
      TypeError: non-array inputs, integer or float64 dtypes, `a` and `b` of
        different dtypes, a bad `out_dtype` or `block_sizes`.
      NotImplementedError: the requested implementation cannot run these inputs
        here (with `implementation=None`: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> x = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (32, 8), jnp.bfloat16)
      >>> partial = jnp.ones((2, 16, 8), jnp.float32)
      >>> out = sf.matmul(x, w, c=partial, out_dtype=jnp.float32)
      >>> out.shape, out.dtype
      ((2, 16, 8), dtype('float32'))
    """
    # Validate before converting: jnp.asarray would silently turn float64 into float32.
    config = base.validate(
        a, b, c=c, bias=bias, out_dtype=out_dtype, block_sizes=block_sizes, precision=precision
    )
    a, b, c, bias = (_as_array(x) for x in (a, b, c, bias))
    names = candidates(implementation)
    if math.prod(base.output_shape(a, b)) == 0 or a.shape[-1] == 0:
        # Nothing to tile: every backend would return the epilogue of zeros.
        return load_implementation("reference")(config, a, b, c, bias)
    return dispatch.run(
        "matmul",
        names,
        implementation is not None,
        lambda name: load_implementation(name)(config, a, b, c, bias),
    )
