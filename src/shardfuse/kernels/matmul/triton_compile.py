"""Compiles the Triton matmul kernel for sm_80 / sm_90 without a GPU and reads its costs.

How it is compiled and measured (`triton.compile` for a `GPUTarget` without a
device, shared memory from the metadata, registers and spills from `ptxas -v`,
16-byte aligned pointers as jax-triton assumes) is
`shardfuse.kernels.triton.compile_stats`; this module gives the shapes and config.
"""

import dataclasses

import jax.numpy as jnp

from shardfuse.kernels.matmul import triton_gpu
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import ResourceUsage, compile_usage


@dataclasses.dataclass(frozen=True)
class MatmulCompileStats(ResourceUsage):
    """Registers per thread, spill bytes and shared memory per block of the compiled matmul."""

    arch: int
    dtype: str
    config: triton_gpu.MatmulKernelConfig


def compile_stats(*, arch: int, dtype: str, M=4096, N=4096, C=4096, has_addend=True, has_bias=True):
    """Compiles the kernel with its default config for `sm_{arch}` and returns `MatmulCompileStats`.

    Example:
      >>> from shardfuse.kernels.matmul import triton_compile
      >>> triton_compile.compile_stats(arch=90, dtype="bfloat16").ok  # doctest: +SKIP
      True
    """
    config = triton_gpu.default_config(arch, jnp.dtype(dtype))
    fn = getattr(launch.kernel_module(triton_gpu.KERNELS_MODULE), triton_gpu.KERNEL)
    constexprs = triton_gpu.kernel_constexprs(
        config, M, N, C, dtype=dtype, has_addend=has_addend, has_bias=has_bias
    )
    pointer_dtypes = {
        "a_ref": dtype,
        "b_ref": dtype,
        "addend_ref": "float32",
        "bias_ref": "float32",
        "out_ref": dtype,
    }
    usage = compile_usage(fn, constexprs, pointer_dtypes, arch=arch, config=config)
    return MatmulCompileStats(arch=arch, dtype=dtype, config=config, **usage)
