"""Compiles the Triton decode-attention kernel for sm_80 / sm_90 without a GPU; reads its costs.

How a kernel is compiled and measured (`triton.compile` for a `GPUTarget`,
`ptxas -v`, jax-triton's pointer alignment) is `shardfuse.kernels.triton.compile_stats`;
this module picks the shapes, the masking variants and the config. Used by
`shardfuse.bench.tools.triton_compile_stats` and the compile tests.
"""

import dataclasses

import jax.numpy as jnp

from shardfuse.kernels.decode_attention import base, triton_gpu
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import ResourceUsage, compile_usage

# The masking variants compiled: plain causal decode, and window + softcap at once.
VARIANTS = {
    "causal": base.DecodeConfig(window=None, logit_softcap=None, scale=1.0),
    "all": base.DecodeConfig(window=(4096, 0), logit_softcap=30.0, scale=1.0),
}


@dataclasses.dataclass(frozen=True)
class DecodeCompileStats(ResourceUsage):
    """What the compiled decode kernel uses per program (CUDA block)."""

    arch: int
    head_dim: int
    dtype: str
    variant: str
    rows: int  # G * T query rows per program
    config: triton_gpu.DecodeKernelConfig


def compile_kernel(
    *,
    arch: int,
    head_dim: int,
    dtype: str = "bfloat16",
    variant: str = "all",
    num_heads: int = 32,
    num_kv_heads: int = 8,
    num_queries: int = 1,
    cache_len: int = 32768,
    config: triton_gpu.DecodeKernelConfig | None = None,
) -> DecodeCompileStats:
    """Compiles the decode kernel for `sm_{arch}` and returns its register and memory use.

    Args:
      arch: 80 (A100) or 90 (H100).
      head_dim: D; the tile width is the next power of two >= 16.
      dtype: "bfloat16", "float16" or "float32" inputs.
      variant: a key of `VARIANTS`.
      num_heads, num_kv_heads, num_queries: H, K and T of the constexpr shape
        (the program holds `G * T` rows, G = H // K).
      cache_len: S.
      config: the launch config; default: the tuned one for arch and dtype.

    Example:
      >>> from shardfuse.kernels.decode_attention import triton_compile
      >>> stats = triton_compile.compile_kernel(arch=90, head_dim=128)  # doctest: +SKIP
      >>> stats.spill_stores + stats.spill_loads  # doctest: +SKIP
      0
    """
    if config is None:
        config = triton_gpu.default_config(
            arch, head_dim, jnp.dtype(dtype), (num_heads // num_kv_heads) * num_queries
        )
    fn = getattr(launch.kernel_module(triton_gpu.KERNELS_MODULE), triton_gpu.KERNEL_NAME)
    H, K, T, S = num_heads, num_kv_heads, num_queries, cache_len
    split = triton_gpu.split_size(S, None, config.block_n)
    constexprs = triton_gpu.kernel_constexprs(
        VARIANTS[variant], jnp.dtype(dtype), T=T, S=S, H=H, K=K, D=head_dim, split=split,
        tile=config,
    )  # fmt: skip
    pointer_dtypes = {name: dtype for name in fn.arg_names}
    pointer_dtypes.update(lengths_ref="int32", out_ref="float32", lse_ref="float32")
    usage = compile_usage(
        fn, constexprs, pointer_dtypes, arch=arch, config=config, enable_fp_fusion=True
    )
    return DecodeCompileStats(
        arch=arch,
        head_dim=head_dim,
        dtype=dtype,
        variant=variant,
        rows=(H // K) * T,
        config=config,
        **usage,
    )
