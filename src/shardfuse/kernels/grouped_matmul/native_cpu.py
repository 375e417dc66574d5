"""Grouped matmul on the CPU: C++ kernels (`native/grouped_matmul.cc`) as XLA FFI custom calls.

Two kernels, the forward and the weights' gradient, make the op with
`base.differentiable` (the inputs' gradient is the forward with rhs's layout
flipped): blocked GEMMs per group in the GotoBLAS manner, on the attention
kernels' register-tiled float32 micro-kernels and thread pool. Work items (a
group's block of up to 192 output rows by 256 columns) are scheduled
dynamically over the kernels' threads (the attention kernels': `default_threads`; one
per 8M multiply-adds at most, so a small call runs on its caller), largest
first; each packs the 256 x 256 weight block it multiplies into its thread's
buffer (bfloat16 converted there), accumulates in float32 and casts once. Each
output element is one item's, summed in a fixed order: runs are bitwise equal.
The FLOPs are the op's own (2 M K N forward, twice that backward) and XLA sees
no temporary beyond the operands (each thread's buffers are the kernel's: 0.6 MiB).

float32 and bfloat16 inputs and results; products always at full float32
precision (any `precision` is met or exceeded); operands on one device or
inside `shard_map`. Anything else (float16, another platform, a build without
the extension, operands XLA partitions outside `shard_map`) raises
NotImplementedError, so that dispatch falls back to `xla`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse.kernels import vma
from shardfuse.kernels.attention import native_cpu as extension
from shardfuse.kernels.grouped_matmul import base

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_FORWARD = "shardfuse_grouped_matmul"
_TRANSPOSED = "shardfuse_grouped_matmul_transposed"


def _check(*operands, out_dtype):
    """NotImplementedError for valid inputs these kernels do not run."""
    ok, why = extension.status(jax.default_backend())  # loads and registers the kernels
    if not ok:
        raise NotImplementedError(f"implementation 'native_cpu': {why}")
    for x in operands:
        if axes := vma.partitioned_axes(x):
            raise NotImplementedError(
                "implementation 'native_cpu' runs per device (inside shard_map, or on one "
                f"device); its operands are partitioned over mesh axes {list(axes)} "
                "outside shard_map"
            )
    for dtype in (operands[0].dtype, out_dtype):
        if jnp.dtype(dtype) not in _DTYPES:
            raise NotImplementedError(
                f"implementation 'native_cpu' supports float32 and bfloat16; got {dtype}"
            )


def executed_macs() -> int:
    """Multiply-adds this process's grouped matmul kernels have executed so far.

    A profiling counter kept by the kernels themselves (their work items: the rows of the
    local groups times the columns times the depth; rows no group owns cost nothing):
    what XLA's cost analysis cannot see inside their custom calls. Read it before and
    after a call; the difference is that call's work, on every device of the process.

    Raises:
      NotImplementedError: the extension is not built, or predates the counter.

    Example:
      >>> import jax.numpy as jnp, shardfuse as sf
      >>> from shardfuse.kernels.grouped_matmul import native_cpu
      >>> before = native_cpu.executed_macs()
      >>> out = sf.grouped_matmul(jnp.ones((6, 4)), jnp.ones((2, 4, 3)), jnp.array([2, 1]),
      ...                         implementation="native_cpu")
      >>> native_cpu.executed_macs() - before  # rows 0-2 (3 of 6) x 3 columns x depth 4
      36
    """
    module = extension.extension_module()
    if not hasattr(module, "grouped_matmul_macs"):
        raise NotImplementedError("the native extension predates grouped_matmul_macs; rebuild it")
    return int(module.grouped_matmul_macs())


def _start(start):
    start = jnp.zeros((), jnp.int32) if start is None else start
    return start.reshape(1)


def forward(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start):
    """`out [M, N]`: the forward kernel (rhs `[G, K, N]`, or `[G, N, K]` transposed)."""
    _check(lhs, rhs, out_dtype=config.out_dtype)
    lhs, rhs, sizes, start = vma.match_varying(lhs, rhs, sizes, _start(start))
    out_type = vma.ffi_result(base.output_shape(lhs, rhs, config), config.out_dtype, lhs)
    call = jax.ffi.ffi_call(_FORWARD, out_type, vmap_method="sequential")
    return call(lhs, rhs, sizes, start, transpose_rhs=np.bool_(config.transpose_rhs))


def transposed(config: base.GroupedMatmulConfig, x, y, sizes, start, out_dtype):
    """`[G, A, B]`: `x [M, A]^T @ y [M, B]` over each local group's rows (0 for empty groups)."""
    _check(x, y, out_dtype=out_dtype)
    x, y, sizes, start = vma.match_varying(x, y, sizes, _start(start))
    shape = (sizes.shape[0], x.shape[1], y.shape[1])
    call = jax.ffi.ffi_call(
        _TRANSPOSED, vma.ffi_result(shape, out_dtype, x), vmap_method="sequential"
    )
    return call(x, y, sizes, start)


_grouped_matmul = base.differentiable(forward, transposed)


def grouped_matmul(config: base.GroupedMatmulConfig, lhs, rhs, sizes, start):
    """The native CPU kernels on validated inputs; differentiable (`base.differentiable`)."""
    _check(lhs, rhs, out_dtype=config.out_dtype)  # refuse before tracing: dispatch falls back
    return _grouped_matmul(config, lhs, rhs, sizes, start)
