"""How `triton_gpu.py` launches the attention kernels: jax-triton on a GPU, the interpreter on CPU.

The launchers of `shardfuse.kernels.triton_support`, bound to this op's kernel
module: `JaxTritonLauncher` (`jax_triton.triton_call`, the GPU path) and
`InterpretLauncher` (the Triton interpreter in a worker process, through
`jax.pure_callback`: how the tests run the kernels without a GPU).
"""

import dataclasses
import importlib

from shardfuse.kernels import triton_support

KERNELS_MODULE = "shardfuse.kernels.attention.triton_kernels"


def kernel_module():
    """The module of `@triton.jit` kernels (imports triton).

    Example:
      >>> from shardfuse.kernels.attention.triton_launch import kernel_module
      >>> kernel_module().attention_forward_kernel  # doctest: +SKIP
    """
    return importlib.import_module(KERNELS_MODULE)


@dataclasses.dataclass(frozen=True)
class JaxTritonLauncher(triton_support.JaxTritonLauncher):
    """`triton_support.JaxTritonLauncher` for the attention kernels."""

    kernels_module: str = KERNELS_MODULE


@dataclasses.dataclass(frozen=True)
class InterpretLauncher(triton_support.InterpretLauncher):
    """`triton_support.InterpretLauncher` for the attention kernels.

    Example:
      >>> from shardfuse.kernels.attention import triton_gpu
      >>> from shardfuse.kernels.attention.triton_launch import InterpretLauncher
      >>> out, lse = triton_gpu.flash_attention(  # doctest: +SKIP
      ...     config, q, k, v, q_pos, kv_pos, None, None, launcher=InterpretLauncher())
    """

    kernels_module: str = KERNELS_MODULE


def gpu_launcher() -> JaxTritonLauncher:
    """The jax-triton launcher for this machine's GPU.

    Raises:
      NotImplementedError: no NVIDIA GPU of compute capability >= 8.0, or
        triton / jax_triton missing or unusable, with the reason.

    Example:
      >>> from shardfuse.kernels.attention.triton_launch import gpu_launcher
      >>> gpu_launcher().compute_capability  # on an H100  # doctest: +SKIP
      90
    """
    return JaxTritonLauncher(compute_capability=triton_support.gpu_compute_capability())
