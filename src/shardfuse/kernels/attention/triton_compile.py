"""Compiles the Triton attention kernels for sm_80 / sm_90 without a GPU and reads their costs.

`triton.compile` lowers a kernel to PTX and a cubin for a `GPUTarget`
without a device; shared memory per block comes from the compiled kernel's
metadata, registers per thread and spill bytes from `ptxas -v`, run with the
ptxas that ships in the triton wheel (the one triton itself uses for that
architecture). The kernels are compiled the way jax-triton compiles them:
every pointer 16-byte aligned, shapes and options as `tl.constexpr`.

Used by `scripts/triton_compile_stats.py` (which writes
`bench/results/triton_compile_stats.md`) and by the compile tests.
"""

import dataclasses

import jax.numpy as jnp

from shardfuse.kernels import triton_support
from shardfuse.kernels.attention import base, triton_configs
from shardfuse.kernels.attention.triton_gpu import kernel_options

KERNEL_NAMES = {
    "forward": "attention_forward_kernel",
    "delta": "attention_backward_delta_kernel",
    "dkdv": "attention_backward_dkdv_kernel",
    "dq": "attention_backward_dq_kernel",
}
_INT_POINTERS = {"q_pos_ref", "kv_pos_ref", "q_seg_ref", "kv_seg_ref", "ranges_ref"}
_FLOAT32_POINTERS = {"lse_ref", "delta_ref", "d_lse_ref"}
_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# The masking variants compiled: the plainest causal kernel and every option at once.
VARIANTS = {
    "causal": base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0),
    "all": base.AttentionConfig(causal=True, window=(256, 0), logit_softcap=30.0, scale=1.0),
}


@dataclasses.dataclass(frozen=True)
class CompileStats(triton_support.ResourceUsage):
    """What one compiled attention kernel uses per program (CUDA block)."""

    kernel: str
    arch: int
    head_dim: int
    dtype: str
    variant: str
    config: triton_configs.KernelConfig


def compile_kernel(
    kernel: str,
    *,
    arch: int,
    head_dim: int,
    dtype: str = "bfloat16",
    variant: str = "causal",
    config: triton_configs.KernelConfig | None = None,
    seq_len: int = 4096,
    num_heads: int = 16,
    num_kv_heads: int = 4,
) -> CompileStats:
    """Compiles one kernel for `sm_{arch}` and returns its register and memory use.

    Args:
      kernel: "forward", "delta", "dkdv" or "dq".
      arch: 80 (A100) or 90 (H100).
      head_dim: D; the tile width is the next power of two >= 16.
      dtype: "bfloat16", "float16" or "float32" inputs.
      variant: a key of `VARIANTS` (which masks and options are compiled in).
      config: the launch config; default: the tuned one for arch, D and dtype.
      seq_len, num_heads, num_kv_heads: T = S, H and K of the constexpr shape.

    Returns:
      `CompileStats` of the compiled kernel.

    Example:
      >>> from shardfuse.kernels.attention import triton_compile
      >>> stats = triton_compile.compile_kernel("forward", arch=90, head_dim=128)  # doctest: +SKIP
      >>> stats.spill_stores, stats.shared_memory <= stats.shared_memory_limit  # doctest: +SKIP
      (0, True)
    """
    import triton
    from triton.backends.compiler import GPUTarget

    from shardfuse.kernels.attention.triton_launch import kernel_module

    if config is None:
        config = triton_configs.default_configs(arch, head_dim, jnp.dtype(dtype)).get(kernel)
    fn = getattr(kernel_module(), KERNEL_NAMES[kernel])
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(
            "the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 when triton "
            "was imported); compile them in a process without it"
        )
    T = S = seq_len
    shape = dict(T=T, S=S, H=num_heads, K=num_kv_heads, D=head_dim)
    shape["BLOCK_D"] = triton_configs.padded_head_dim(head_dim)
    attention = VARIANTS[variant]
    constexprs = dict(shape, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    constexprs.update(kernel_options(attention, jnp.dtype(dtype), has_segments=variant == "all"))
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in _INT_POINTERS:
            signature[name] = "*i32"
        elif name in _FLOAT32_POINTERS:
            signature[name] = "*fp32"
        else:
            signature[name] = "*" + _TRITON_TYPES[dtype]
        attrs[(index,)] = [["tt.divisibility", 16]]  # jax-triton's alignment assumption
    compiled = triton.compile(
        triton.compiler.ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(
            num_warps=config.num_warps, num_stages=config.num_stages, enable_fp_fusion=True
        ),
    )
    registers, spill_stores, spill_loads = triton_support.ptxas_usage(compiled.asm["ptx"], arch)
    generation = triton_configs.generation(arch)
    return CompileStats(
        kernel=kernel,
        arch=arch,
        head_dim=head_dim,
        dtype=dtype,
        variant=variant,
        config=config,
        registers=registers,
        spill_stores=spill_stores,
        spill_loads=spill_loads,
        shared_memory=compiled.metadata.shared,
        shared_memory_limit=triton_configs.SHARED_MEMORY_LIMIT[generation],
    )
