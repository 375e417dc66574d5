"""The triton implementation of sf.matmul: the Triton kernel behind a JAX custom VJP.

`a [..., M, C]` is flattened to `[M', C]` and the kernel of `triton_kernels.py`
computes `a @ b (+ addend) (+ bias)` with float32 accumulation and the add fused
into its epilogue. The backward runs the same kernel twice: `da = g @ b^T`,
`db = a^T @ g` (operands transposed by XLA, the cotangent cast to the input
dtype), `daddend = g`, `dbias = sum g`.

Launch configurations (`CONFIGS`) per GPU generation and input class start
from the Triton matmul tutorial's A100/H100 choices: 128 x 128 tiles with 8
warps for 16-bit inputs (BLOCK_K 32 with 4 stages on sm_80, 64 with 3 stages
on sm_90; 4 warps spilled 240 bytes on sm_80 once the `addend` tile joins the
accumulator), 64 x 64 x 32 for float32 (IEEE dots, no TF32). Every entry compiles
for its architecture with 0 register spills and shared memory within the
per-block limit (`tests/kernels/matmul/test_triton.py` checks it without a GPU
through `compile_stats`). They were not timed on a GPU: re-tune with `shardfuse bench`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from shardfuse.kernels.matmul import base
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import generation

KERNELS_MODULE = "shardfuse.kernels.matmul.triton_kernels"
KERNEL = "matmul_plus_reduce_kernel"
GROUP_M = 8
_INT32_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class MatmulKernelConfig:
    """Tile shape and launch options of the kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


CONFIGS = {
    ("sm80", "16bit"): MatmulKernelConfig(128, 128, 32, num_warps=8, num_stages=4),
    ("sm90", "16bit"): MatmulKernelConfig(128, 128, 64, num_warps=8, num_stages=3),
    ("sm80", "float32"): MatmulKernelConfig(64, 64, 32, num_warps=4, num_stages=3),
    ("sm90", "float32"): MatmulKernelConfig(64, 64, 32, num_warps=4, num_stages=3),
}


def default_config(compute_capability: int, dtype) -> MatmulKernelConfig:
    kind = "float32" if jnp.dtype(dtype) == jnp.float32 else "16bit"
    return CONFIGS[(generation(compute_capability), kind)]


def _with_blocks(config: MatmulKernelConfig, blocks: base.MatmulBlockSizes) -> MatmulKernelConfig:
    sizes = {}
    for name in ("block_m", "block_n", "block_k"):
        value = getattr(blocks, name)
        if value is not None:
            if value < 16 or value & (value - 1):
                raise NotImplementedError(
                    f"triton matmul needs {name} to be a power of two >= 16, got {value}"
                )
            sizes[name] = value
    return dataclasses.replace(config, **sizes)


def kernel_constexprs(config: MatmulKernelConfig, M, N, C, *, dtype, has_addend, has_bias) -> dict:
    """The kernel's `tl.constexpr` arguments: sizes, tiles and options (IEEE dots for float32)."""
    return dict(
        M=M,
        N=N,
        C=C,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=GROUP_M,
        HAS_ADDEND=has_addend,
        HAS_BIAS=has_bias,
        IEEE=jnp.dtype(dtype) == jnp.float32,
    )


def _matmul_2d(launcher, a, b, addend, bias, out_dtype, blocks):
    """The kernel on `a [M, C]`, `b [C, N]`, optional `addend [M, N]` and `bias [N]`."""
    M, C = a.shape
    N = b.shape[1]
    config = _with_blocks(default_config(launcher.compute_capability, a.dtype), blocks)
    # Unused operands still need a pointer; the kernel never reads them.
    dummy = jnp.zeros((1,), jnp.float32)
    grid = (math.ceil(M / config.block_m) * math.ceil(N / config.block_n),)
    constexprs = kernel_constexprs(
        config, M, N, C, dtype=a.dtype, has_addend=addend is not None, has_bias=bias is not None
    )
    (out,) = launcher(
        KERNEL,
        [a, b, dummy if addend is None else addend, dummy if bias is None else bias],
        [jax.ShapeDtypeStruct((M, N), out_dtype)],
        grid,
        config,
        constexprs,
    )
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _matmul(launcher, a, b, addend, bias, config: base.MatmulConfig):
    a2 = a.reshape(-1, a.shape[-1])  # [M', C]
    addend2 = None if addend is None else addend.reshape(-1, addend.shape[-1])
    out = _matmul_2d(launcher, a2, b, addend2, bias, config.out_dtype, config.block_sizes)
    return out.reshape(base.output_shape(a, b))


def _matmul_fwd(launcher, a, b, addend, bias, config):
    return _matmul(launcher, a, b, addend, bias, config), (a, b, addend, bias)


def _matmul_bwd(launcher, config, residuals, g):
    def product(x, y, out_dtype):
        return _matmul_2d(launcher, x, y, None, None, out_dtype, config.block_sizes)

    return base.backward(product, residuals, g)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(config: base.MatmulConfig, a, b, addend, bias, *, launcher=None):
    """`a [..., M, C] @ b [C, N] (+ addend) (+ bias)` on validated inputs through the Triton kernel.

    Args:
      config: from `base.validate`.
      a, b, addend, bias: validated operands.
      launcher: None for jax-triton on this machine's GPU, or
        `triton.launch.InterpretLauncher()` (the Triton interpreter on CPU).

    Raises:
      NotImplementedError: no usable NVIDIA GPU / triton / jax-triton (launcher=None),
        block sizes that are not powers of two >= 16, or sizes whose element
        offsets overflow int32.
    """
    rows = a.size // max(a.shape[-1], 1)
    sizes = (rows * a.shape[-1], b.size, rows * b.shape[1])
    if max(sizes) >= _INT32_LIMIT:
        raise NotImplementedError(f"triton matmul indexes with int32; operand sizes {sizes}")
    _with_blocks(MatmulKernelConfig(16, 16, 16, 4, 1), config.block_sizes)  # refuse before tracing
    base.require_default_precision(config, a.dtype, "triton")
    launcher = launch.resolve(launcher, KERNELS_MODULE)
    return _matmul(launcher, a, b, addend, bias, config)
