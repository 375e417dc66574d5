"""The triton implementation of sf.grouped_matmul: the kernels of `triton_kernels.py` behind the
op's custom VJP (`base.differentiable`).

The forward launches one program per (row-tile visit, column tile), the visits
from `tiles.visits` (computed on the device, so one compiled program serves
every routing); the inputs' gradient is the same kernel with rhs's strides
swapped; the weights' gradient one program per (group, A tile, B tile).

Launch configurations (`CONFIGS`) per GPU generation and input class follow
the Triton matmul tutorial's A100/H100 choices, as `sf.matmul`'s kernel does:
128 x 128 output tiles with 8 warps for 16-bit inputs, 64 x 64 for float32
(IEEE dots); the weights' gradient steps through a group's rows 32 or 64 at a
time. Every entry compiles for its architecture with 0 register spills and
shared memory within the per-block limit (`triton_compile`, checked in
`tests/kernels/grouped_matmul/test_triton.py` without a GPU). Not tuned on a
GPU: `shardfuse bench --suite grouped_matmul` times them where one is present.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from shardfuse.kernels.grouped_matmul import base, tiles
from shardfuse.kernels.precision import dot_precision
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import generation

KERNELS_MODULE = "shardfuse.kernels.grouped_matmul.triton_kernels"
FORWARD = "grouped_matmul_kernel"
TRANSPOSED = "grouped_matmul_transposed_kernel"
_INT32_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and launch options of one kernel, named as `tiles.BlockSizes` names them: rows
    (the transposed kernel's contracted dim), K and N (the weights' gradient's dims)."""

    block_m: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int


CONFIGS = {
    ("sm80", "16bit", FORWARD): KernelConfig(128, 32, 128, num_warps=8, num_stages=4),
    ("sm90", "16bit", FORWARD): KernelConfig(128, 64, 128, num_warps=8, num_stages=3),
    # 4 warps spilled 44 bytes on sm_80 (IEEE float32 dots there are FMA loops): 8 do not.
    ("sm80", "float32", FORWARD): KernelConfig(64, 32, 64, num_warps=8, num_stages=3),
    ("sm90", "float32", FORWARD): KernelConfig(64, 32, 64, num_warps=4, num_stages=3),
    ("sm80", "16bit", TRANSPOSED): KernelConfig(32, 128, 128, num_warps=8, num_stages=4),
    ("sm90", "16bit", TRANSPOSED): KernelConfig(64, 128, 128, num_warps=8, num_stages=3),
    ("sm80", "float32", TRANSPOSED): KernelConfig(32, 64, 64, num_warps=4, num_stages=3),
    ("sm90", "float32", TRANSPOSED): KernelConfig(32, 64, 64, num_warps=4, num_stages=3),
}


def default_config(compute_capability: int, dtype, kernel: str) -> KernelConfig:
    """The launch config of `kernel` for this GPU and input dtype, `tiles.block_sizes` applied."""
    kind = "float32" if jnp.dtype(dtype) == jnp.float32 else "16bit"
    config = CONFIGS[(generation(compute_capability), kind, kernel)]
    sizes = tiles.current_block_sizes()
    chosen = {
        field: value
        for field, value in (
            ("block_m", sizes.block_m),
            ("block_k", sizes.block_k),
            ("block_n", sizes.block_n),
        )
        if value is not None
    }
    for name, value in chosen.items():
        if value < 16 or value & (value - 1):
            raise NotImplementedError(
                f"triton grouped matmul needs {name} to be a power of two >= 16, got {value}"
            )
    return dataclasses.replace(config, **chosen)


def _ieee(config: base.GroupedMatmulConfig, dtype) -> bool:
    return jnp.dtype(dtype) == jnp.float32 and dot_precision(dtype, config.precision) == (
        jax.lax.Precision.HIGHEST
    )


def forward_constexprs(kernel_config, config, M, K, N, dtype) -> dict:
    """The forward kernel's `tl.constexpr` arguments."""
    stride_k, stride_n = (1, K) if config.transpose_rhs else (N, 1)
    return dict(
        M=M,
        K=K,
        N=N,
        RHS_STRIDE_K=stride_k,
        RHS_STRIDE_N=stride_n,
        BLOCK_M=kernel_config.block_m,
        BLOCK_N=kernel_config.block_n,
        BLOCK_K=kernel_config.block_k,
        IEEE=_ieee(config, dtype),
    )


def transposed_constexprs(kernel_config, config, A, B, dtype) -> dict:
    """The transposed kernel's `tl.constexpr` arguments."""
    return dict(
        A=A,
        B=B,
        BLOCK_A=kernel_config.block_k,
        BLOCK_B=kernel_config.block_n,
        BLOCK_M=kernel_config.block_m,
        IEEE=_ieee(config, dtype),
    )


def _forward(launcher, config, lhs, rhs, sizes, start):
    M, K = lhs.shape
    N = base.output_shape(lhs, rhs, config)[1]
    kernel_config = default_config(launcher.compute_capability, lhs.dtype, FORWARD)
    visits = tiles.visits(sizes, start, M, kernel_config.block_m, forward=True)
    grid = (visits.tile.shape[0], -(-N // kernel_config.block_n))
    (out,) = launcher(
        FORWARD,
        [lhs, rhs, visits.tile, visits.group, visits.begin, visits.end, visits.valid],
        [jax.ShapeDtypeStruct((M, N), config.out_dtype)],
        grid,
        kernel_config,
        forward_constexprs(kernel_config, config, M, K, N, lhs.dtype),
    )
    return out


def _transposed(launcher, config, x, y, sizes, start, out_dtype):
    A, B = x.shape[1], y.shape[1]
    G = sizes.shape[0]
    kernel_config = default_config(launcher.compute_capability, x.dtype, TRANSPOSED)
    start = jnp.zeros((), jnp.int32) if start is None else start
    ends = start + jnp.cumsum(sizes)  # [G]
    grid = (G, -(-A // kernel_config.block_k), -(-B // kernel_config.block_n))
    (out,) = launcher(
        TRANSPOSED,
        [x, y, (ends - sizes).astype(jnp.int32), ends.astype(jnp.int32)],
        [jax.ShapeDtypeStruct((G, A, B), out_dtype)],
        grid,
        kernel_config,
        transposed_constexprs(kernel_config, config, A, B, x.dtype),
    )
    return out


@functools.cache
def _differentiable(launcher):
    return base.differentiable(
        functools.partial(_forward, launcher), functools.partial(_transposed, launcher)
    )


def grouped_matmul(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start, *, launcher=None):
    """The Triton kernels on validated inputs; differentiable (`base.differentiable`).

    Args:
      config, lhs, rhs, sizes, start: as every backend's (`base.local_groups`).
      launcher: None for jax-triton on this machine's GPU, or
        `triton.launch.InterpretLauncher()` (the Triton interpreter on CPU).

    Raises:
      NotImplementedError: no usable NVIDIA GPU / triton / jax-triton (launcher=None),
        tiles that are not powers of two >= 16, or operands whose element offsets
        overflow int32.
    """
    M, K = lhs.shape
    N = base.output_shape(lhs, rhs, config)[1]
    sizes_of = (M * K, M * N, rhs.shape[0] * K * N)
    if max(sizes_of[:2]) >= _INT32_LIMIT or K * N >= _INT32_LIMIT:
        raise NotImplementedError(f"triton grouped matmul indexes with int32; sizes {sizes_of}")
    default_config(90, lhs.dtype, FORWARD)  # refuse bad tiles before tracing
    launcher = launch.resolve(launcher, KERNELS_MODULE)
    return _differentiable(launcher)(config, lhs, rhs, sizes, start)
