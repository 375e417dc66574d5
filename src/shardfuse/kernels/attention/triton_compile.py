"""Compiles the Triton attention kernels for sm_80 / sm_90 without a GPU and reads their costs.

How a kernel is compiled and measured (`triton.compile` for a `GPUTarget`,
`ptxas -v`, jax-triton's pointer alignment) is `shardfuse.kernels.triton.compile_stats`;
this module picks the kernels, the shapes, the masking variants and the configs.

Used by `shardfuse.bench.tools.triton_compile_stats` (which writes
`bench/results/triton_compile_stats.md`) and by the compile tests.
"""

import dataclasses

import jax.numpy as jnp

from shardfuse.kernels.attention import base, triton_configs
from shardfuse.kernels.attention.triton_gpu import kernel_options
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import ResourceUsage, compile_usage, generation

KERNEL_NAMES = {
    "forward": "attention_forward_kernel",
    "delta": "attention_backward_delta_kernel",
    "dkdv": "attention_backward_dkdv_kernel",
    "dq": "attention_backward_dq_kernel",
}
_INT_POINTERS = {"q_pos_ref", "kv_pos_ref", "q_seg_ref", "kv_seg_ref", "ranges_ref"}
_FLOAT32_POINTERS = {"lse_ref", "delta_ref", "d_lse_ref"}

# The masking variants compiled: the plainest causal kernel and every option at once.
VARIANTS = {
    "causal": base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=1.0),
    "all": base.AttentionConfig(causal=True, window=(256, 0), logit_softcap=30.0, scale=1.0),
}


@dataclasses.dataclass(frozen=True)
class AttentionCompileStats(ResourceUsage):
    """What one compiled attention kernel uses per program (CUDA block)."""

    kernel: str
    arch: int
    head_dim: int
    dtype: str
    variant: str
    config: triton_configs.AttentionKernelConfig

    @property
    def acceptable(self) -> bool:
        """Shared memory within the limit and no spills (a few for a GPU-timed table entry)."""
        allowed = triton_configs.spill_allowance(
            generation(self.arch), self.head_dim, jnp.dtype(self.dtype), self.kernel, self.config
        )
        return (
            self.shared_memory <= self.shared_memory_limit
            and self.spill_stores <= allowed
            and self.spill_loads <= allowed
        )


def compile_kernel(
    kernel: str,
    *,
    arch: int,
    head_dim: int,
    dtype: str = "bfloat16",
    variant: str = "causal",
    config: triton_configs.AttentionKernelConfig | None = None,
    seq_len: int = 4096,
    num_heads: int = 16,
    num_kv_heads: int = 4,
) -> AttentionCompileStats:
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
      `AttentionCompileStats` of the compiled kernel.

    Example:
      >>> from shardfuse.kernels.attention import triton_compile
      >>> stats = triton_compile.compile_kernel("forward", arch=90, head_dim=128)  # doctest: +SKIP
      >>> stats.spill_stores, stats.shared_memory <= stats.shared_memory_limit  # doctest: +SKIP
      (0, True)
    """
    if config is None:
        config = triton_configs.default_configs(arch, head_dim, jnp.dtype(dtype)).get(kernel)
    fn = getattr(launch.kernel_module(triton_configs.KERNELS_MODULE), KERNEL_NAMES[kernel])
    shape = dict(T=seq_len, S=seq_len, H=num_heads, K=num_kv_heads, D=head_dim)
    shape["BLOCK_D"] = triton_configs.padded_head_dim(head_dim)
    attention = VARIANTS[variant]
    constexprs = dict(shape, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    constexprs.update(kernel_options(attention, jnp.dtype(dtype), has_segments=variant == "all"))
    constexprs = {name: value for name, value in constexprs.items() if name in fn.arg_names}
    pointer_dtypes = {
        name: "int32"
        if name in _INT_POINTERS
        else "float32"
        if name in _FLOAT32_POINTERS
        else dtype
        for name in fn.arg_names
    }
    usage = compile_usage(
        fn, constexprs, pointer_dtypes, arch=arch, config=config, enable_fp_fusion=True
    )
    return AttentionCompileStats(
        kernel=kernel,
        arch=arch,
        head_dim=head_dim,
        dtype=dtype,
        variant=variant,
        config=config,
        **usage,
    )
