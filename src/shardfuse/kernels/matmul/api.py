"""Public matmul entry point (`sf.matmul`); the implementations are declared in the registry.

`matmul` validates once, before anything is traced, then calls the requested
implementation (`implementation=` a name, a sequence of names tried in order,
or None for the platform's preference; see `kernels/registry.py`): a backend
that raises `NotImplementedError` (valid input it cannot handle: dtype,
shape, platform) hands over to the next one.
"""

import math
import warnings

import jax
import jax.numpy as jnp

from shardfuse.kernels import registry
from shardfuse.kernels.matmul import base

_MODULE = "shardfuse.kernels.matmul."

# Backend modules are imported on first use only, so that optional
# dependencies (triton, jax_triton) are never imported by `import shardfuse`.
MATMUL = registry.register(
    "matmul",
    description="a @ b (+ addend) (+ bias), float32 accumulation, the add in the epilogue",
    backends=[
        registry.Backend(
            "reference",
            _MODULE + "reference",
            "reference_matmul",
            "the oracle: one einsum at float32 accumulation, then the adds in float32",
        ),
        registry.Backend(
            "xla",
            _MODULE + "xla",
            "matmul",
            "one XLA GEMM, the adds and the cast fused into its epilogue",
        ),
        registry.Backend(
            "pallas_tpu",
            _MODULE + "pallas_tpu",
            "matmul",
            "tiled Pallas TPU (Mosaic) GEMM, float32 VMEM accumulator seeded with the addend",
            registry.pallas_tpu_status,
        ),
        registry.Backend(
            "triton",
            _MODULE + "triton_gpu",
            "matmul",
            "tiled Triton GEMM through jax-triton, the adds in its epilogue",
            registry.triton_status,
        ),
    ],
    # What `implementation=None` tries, best first, per platform. On GPUs XLA's
    # GEMM (cuBLAS with the add in its epilogue) stays the default: the Triton
    # kernel is checked (interpreter, sm_80/sm_90 compiles) but has not been
    # timed on a GPU.
    preference=registry.kernel_preference(gpu=("xla",), cuda=("xla",)),
)
IMPLEMENTATIONS = MATMUL.names
PREFERENCE = MATMUL.preference  # the registry's own dict: tests patch it in place


def load_implementation(name: str):
    """Returns the backend function `name`, or raises NotImplementedError saying why not."""
    return MATMUL.load(name)


def candidates(implementation) -> tuple[str, ...]:
    """The implementations to try, best first; raises ValueError for an unknown name."""
    return MATMUL.candidates(implementation)


def _as_array(x):
    return x if x is None or isinstance(x, jax.Array) else jnp.asarray(x)


def matmul(
    a,
    b,
    *,
    addend=None,
    bias=None,
    out_dtype=None,
    implementation=None,
    block_sizes: base.MatmulBlockSizes | None = None,
    precision=None,
    c=None,
):
    """Matmul-plus-reduce: `a @ b (+ addend) (+ bias)` with float32 accumulation and a fused add.

        out[..., M, N] = cast(sum_C a[..., M, C] b[C, N] + addend[..., M, N] + bias[N])

    The products accumulate in float32 (HIGHEST precision for float32 inputs),
    `addend` and `bias` are added in float32 in the epilogue and the sum is
    cast to `out_dtype` once. This is the step of a reduce-scatter ring:
    `acc = matmul(x, w_chunk, addend=incoming_partial_sum, out_dtype=jnp.float32)`.

    Args:
      a: `[..., M, C]` float32, bfloat16 or float16; leading dims are batch dims.
      b: `[C, N]`, same dtype as `a`.
      addend: optional `[..., M, N]` (the output shape), any supported float
        dtype (float32 partial sums are typical).
      bias: optional `[N]`, any supported float dtype.
      out_dtype: result dtype; default `a.dtype`.
      implementation: None (the platform's preference: pallas_tpu on TPU, else
        xla), one of "reference", "xla", "pallas_tpu", "triton", or a sequence
        of them tried in order (each NotImplementedError hands over to the next).
      block_sizes: optional `MatmulBlockSizes(block_m, block_n, block_k)` for the
        tiled kernels.
      precision: None (HIGHEST for float32 inputs, DEFAULT for 16-bit), a
        `jax.lax.Precision` or its name; as `precision` of `jnp.dot`. Backends
        that cannot honour it raise NotImplementedError (dispatch falls back).
      c: deprecated name of `addend` (it clashes with the axis glossary's C);
        still accepted for one release, with a DeprecationWarning.

    Returns:
      `[..., M, N]` in `out_dtype`.

    Raises:
      ValueError: ranks or shapes that do not fit, or an unknown implementation.
      TypeError: non-array inputs, integer or float64 dtypes, `a` and `b` of
        different dtypes, a bad `out_dtype` or `block_sizes`, or both `addend`
        and `c`.
      NotImplementedError: the named implementation cannot run these inputs
        here (with None or a sequence: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> x = jax.random.normal(jax.random.key(0), (2, 16, 32), jnp.bfloat16)
      >>> w = jax.random.normal(jax.random.key(1), (32, 8), jnp.bfloat16)
      >>> partial = jnp.ones((2, 16, 8), jnp.float32)
      >>> out = sf.matmul(x, w, addend=partial, out_dtype=jnp.float32)
      >>> out.shape, out.dtype
      ((2, 16, 8), dtype('float32'))
    """
    if c is not None:
        if addend is not None:
            raise TypeError("sf.matmul got both addend= and its deprecated name c=; pass addend=")
        warnings.warn(
            "sf.matmul(c=...) is deprecated; use addend=...", DeprecationWarning, stacklevel=2
        )
        addend = c
    # Validate before converting: jnp.asarray would silently turn float64 into float32.
    config = base.validate(
        a,
        b,
        addend=addend,
        bias=bias,
        out_dtype=out_dtype,
        block_sizes=block_sizes,
        precision=precision,
    )
    a, b, addend, bias = (_as_array(x) for x in (a, b, addend, bias))
    MATMUL.candidates(implementation)  # an unknown name fails before anything runs
    if math.prod(base.output_shape(a, b)) == 0 or a.shape[-1] == 0:
        # Nothing to tile: every backend would return the epilogue of zeros.
        return load_implementation("reference")(config, a, b, addend, bias)
    return MATMUL.run(
        implementation, lambda name: load_implementation(name)(config, a, b, addend, bias)
    )
