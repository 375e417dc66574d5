"""Compiles the Triton matmul kernel for sm_80 / sm_90 without a GPU and reads its costs.

As `kernels/attention/triton_compile.py` (whose `ptxas -v` reader this uses):
`triton.compile` lowers the kernel for a `GPUTarget` without a device, the
compiled metadata gives shared memory per block, and `ptxas -v` (the one in
the triton wheel) gives registers and spill bytes. Pointers are 16-byte
aligned as jax-triton assumes.
"""

import dataclasses

import jax.numpy as jnp

from shardfuse.kernels import triton_support
from shardfuse.kernels.attention.triton_configs import SHARED_MEMORY_LIMIT
from shardfuse.kernels.matmul import triton_gpu
from shardfuse.kernels.matmul.triton_launch import kernel_module

_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclasses.dataclass(frozen=True)
class CompileStats(triton_support.ResourceUsage):
    """Registers per thread, spill bytes and shared memory per block of the compiled matmul."""

    arch: int
    dtype: str
    config: triton_gpu.KernelConfig


def compile_stats(*, arch: int, dtype: str, M=4096, N=4096, C=4096, has_c=True, has_bias=True):
    """Compiles the kernel with its default config for `sm_{arch}` and returns `CompileStats`.

    Example:
      >>> from shardfuse.kernels.matmul import triton_compile
      >>> triton_compile.compile_stats(arch=90, dtype="bfloat16").ok  # doctest: +SKIP
      True
    """
    import triton
    from triton.backends.compiler import GPUTarget

    config = triton_gpu.default_config(arch, jnp.dtype(dtype))
    fn = getattr(kernel_module(), triton_gpu.KERNEL)
    constexprs = dict(
        M=M,
        N=N,
        C=C,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=triton_gpu.GROUP_M,
        HAS_C=has_c,
        HAS_BIAS=has_bias,
        IEEE=dtype == "float32",
    )
    pointer_types = {
        "a_ref": dtype,
        "b_ref": dtype,
        "c_ref": "float32",
        "bias_ref": "float32",
        "out_ref": dtype,
    }
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "*" + _TRITON_TYPES[pointer_types[name]]
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        triton.compiler.ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )
    registers, stores, loads = triton_support.ptxas_usage(compiled.asm["ptx"], arch)
    generation = "sm80" if arch < 90 else "sm90"
    return CompileStats(
        arch=arch,
        dtype=dtype,
        config=config,
        registers=registers,
        spill_stores=stores,
        spill_loads=loads,
        shared_memory=compiled.metadata.shared,
        shared_memory_limit=SHARED_MEMORY_LIMIT[generation],
    )
