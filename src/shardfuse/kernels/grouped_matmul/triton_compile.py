"""Compiles the Triton grouped matmul kernels for sm_80 / sm_90 without a GPU and reads their costs.

How they are compiled and measured (`triton.compile` for a `GPUTarget` without a
device, shared memory from the metadata, registers and spills from `ptxas -v`,
16-byte aligned pointers as jax-triton assumes) is
`shardfuse.kernels.triton.compile_stats`; this module gives the shapes and configs.
"""

import dataclasses

import jax.numpy as jnp

from shardfuse.kernels.grouped_matmul import base, triton_gpu
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import ResourceUsage, compile_usage

KERNELS = (triton_gpu.FORWARD, triton_gpu.TRANSPOSED)


@dataclasses.dataclass(frozen=True)
class GroupedMatmulCompileStats(ResourceUsage):
    """Registers per thread, spill bytes and shared memory per block of one compiled kernel."""

    arch: int
    dtype: str
    kernel: str
    config: triton_gpu.KernelConfig


def compile_stats(*, arch: int, dtype: str, kernel: str, M=8192, K=4096, N=14336):
    """Compiles `kernel` with its default config for `sm_{arch}`; returns its resource use.

    The default sizes are a Mixtral-8x7B expert's up-projection at 4096 routed rows.

    Example:
      >>> from shardfuse.kernels.grouped_matmul import triton_compile
      >>> stats = triton_compile.compile_stats(  # doctest: +SKIP
      ...     arch=90, dtype="bfloat16", kernel="grouped_matmul_kernel")
      >>> stats.spill_stores, stats.ok  # doctest: +SKIP
      (0, True)
    """
    config = base.GroupedMatmulConfig(out_dtype=jnp.dtype(dtype))
    kernel_config = triton_gpu.default_config(arch, jnp.dtype(dtype), kernel)
    fn = getattr(launch.kernel_module(triton_gpu.KERNELS_MODULE), kernel)
    if kernel == triton_gpu.FORWARD:
        constexprs = triton_gpu.forward_constexprs(kernel_config, config, M, K, N, dtype)
        pointers = {"lhs_ref": dtype, "rhs_ref": dtype, "out_ref": dtype}
        pointers |= {f"{name}_ref": "int32" for name in ("tile", "group", "begin", "end", "valid")}
    else:
        constexprs = triton_gpu.transposed_constexprs(kernel_config, config, K, N, dtype)
        pointers = {"x_ref": dtype, "y_ref": dtype, "begin_ref": "int32", "end_ref": "int32"}
        pointers["out_ref"] = dtype
    usage = compile_usage(fn, constexprs, pointers, arch=arch, config=kernel_config)
    return GroupedMatmulCompileStats(
        arch=arch, dtype=dtype, kernel=kernel, config=kernel_config, **usage
    )
