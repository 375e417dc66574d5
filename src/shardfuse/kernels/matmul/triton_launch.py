"""How `triton_gpu.py` launches the matmul kernel: jax-triton on a GPU, the interpreter on CPU.

The launchers of `shardfuse.kernels.triton_support`, bound to this op's kernel
module: `JaxTritonLauncher` (`jax_triton.triton_call`, the GPU path) and
`InterpretLauncher` (the Triton interpreter in a worker process, through
`jax.pure_callback`: how the tests run the kernel without a GPU).
"""

import dataclasses
import importlib

from shardfuse.kernels import triton_support

KERNELS_MODULE = "shardfuse.kernels.matmul.triton_kernels"


def kernel_module():
    """The module of `@triton.jit` matmul kernels (imports triton)."""
    return importlib.import_module(KERNELS_MODULE)


@dataclasses.dataclass(frozen=True)
class JaxTritonLauncher(triton_support.JaxTritonLauncher):
    """`triton_support.JaxTritonLauncher` for the matmul kernel."""

    kernels_module: str = KERNELS_MODULE


@dataclasses.dataclass(frozen=True)
class InterpretLauncher(triton_support.InterpretLauncher):
    """`triton_support.InterpretLauncher` for the matmul kernel (slow: keep shapes small)."""

    kernels_module: str = KERNELS_MODULE


def gpu_launcher() -> JaxTritonLauncher:
    """The jax-triton launcher for this machine's GPU (NotImplementedError without one)."""
    return JaxTritonLauncher(compute_capability=triton_support.gpu_compute_capability())
