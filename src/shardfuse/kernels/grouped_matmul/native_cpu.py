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

Also here: `swiglu_experts`, a mixture-of-experts layer's routed SwiGLU experts fused
(`native/moe_experts.cc`: the rows' sort by expert, both grouped matmuls on the kernels
above, the activation and the unsort in one custom call forward and one backward), which
`sf.layers.ParallelMoE` runs on the CPU where its experts have no biases.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

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


# --- the fused routed SwiGLU experts (native/moe_experts.cc) --------------------------------

_EXPERTS_FORWARD = "shardfuse_moe_experts_forward"
_EXPERTS_BACKWARD = "shardfuse_moe_experts_backward"


@functools.cache
def _has_fused_experts() -> bool:
    """Whether the loaded extension has the fused experts' kernels (an older build has not)."""
    return _EXPERTS_FORWARD in extension.extension_module().registrations()


def swiglu_experts_supported(rows, gate_up, down) -> bool:
    """Whether `swiglu_experts` runs these operands here: the CPU backend with an extension
    that has the fused kernels, rows `[R, F]` and experts `[G, F, 2H]`, `[G, H, F]` all float32
    or all bfloat16, on one device or inside `shard_map` (callers fall back otherwise)."""
    try:
        _check(rows, gate_up, down, out_dtype=rows.dtype)
    except NotImplementedError:
        return False
    if not _has_fused_experts():
        return False
    shapes = rows.ndim == 2 and gate_up.ndim == 3 and down.ndim == 3
    return (
        shapes
        and rows.dtype == gate_up.dtype == down.dtype
        and gate_up.shape[1] == rows.shape[1] == down.shape[2]
        and gate_up.shape[2] == 2 * down.shape[1]
        and gate_up.shape[0] == down.shape[0]
    )


@jax.custom_vjp
def _swiglu_experts(rows, ids, gate_up, down):
    return swiglu_experts_forward(rows, ids, gate_up, down)[0]


def swiglu_experts_forward(rows, ids, gate_up, down):
    """`swiglu_experts`' forward custom call alone, for callers that write their own VJP:
    `(y, h)`, `y` as `swiglu_experts` gives it and `h [R, 2H]` the up projection of the
    rows sorted by expert (what `swiglu_experts_backward` takes; rows past the held ones
    zero). No checks: the operands must pass `swiglu_experts_supported`, `ids` int32, all
    of one varying type inside `shard_map` (`vma.match_varying`).

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.kernels.grouped_matmul import native_cpu
      >>> ids = jnp.array([1, 5, 0], jnp.int32)
      >>> y, h = native_cpu.swiglu_experts_forward(
      ...     jnp.ones((3, 4)), ids, jnp.ones((2, 4, 6)), jnp.ones((2, 3, 4)))
      >>> y.shape, h.shape
      ((3, 4), (3, 6))
    """
    R, H = rows.shape[0], down.shape[1]
    out_types = (
        vma.ffi_result(rows.shape, rows.dtype, rows),
        vma.ffi_result((R, 2 * H), rows.dtype, rows),
    )
    call = jax.ffi.ffi_call(_EXPERTS_FORWARD, out_types, vmap_method="sequential")
    return call(rows, ids, gate_up, down)


def swiglu_experts_backward(rows, ids, gate_up, down, h, dy):
    """`swiglu_experts`' backward custom call alone: `(d_rows, d_gate_up, d_down)` from the
    forward's operands, its `h` (`swiglu_experts_forward`) and the output's cotangent `dy`
    `[R, F]` (rows whose id is not held get a zero `d_rows`). No checks, as
    `swiglu_experts_forward`.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.kernels.grouped_matmul import native_cpu
      >>> rows, ids = jnp.ones((3, 4)), jnp.array([1, 5, 0], jnp.int32)
      >>> gate_up, down = jnp.ones((2, 4, 6)), jnp.ones((2, 3, 4))
      >>> y, h = native_cpu.swiglu_experts_forward(rows, ids, gate_up, down)
      >>> d_rows, d_gate_up, d_down = native_cpu.swiglu_experts_backward(
      ...     rows, ids, gate_up, down, h, jnp.ones_like(y))
      >>> d_rows[1].tolist()  # row 1's expert is not held
      [0.0, 0.0, 0.0, 0.0]
    """
    out_types = tuple(vma.ffi_result(x.shape, x.dtype, rows) for x in (rows, gate_up, down))
    call = jax.ffi.ffi_call(_EXPERTS_BACKWARD, out_types, vmap_method="sequential")
    return call(rows, ids, gate_up, down, h, dy.astype(rows.dtype))


def _swiglu_experts_fwd(rows, ids, gate_up, down):
    y, h = swiglu_experts_forward(rows, ids, gate_up, down)
    # The up projection (the backward's residual): named as the unfused path names it, so
    # that remat policies saving "moe_up" keep it.
    h = checkpoint_name(h, "moe_up")
    return y, (rows, ids, gate_up, down, h)


def _swiglu_experts_bwd(residuals, dy):
    d_rows, d_gate_up, d_down = swiglu_experts_backward(*residuals, dy)
    return d_rows, None, d_gate_up, d_down


_swiglu_experts.defvjp(_swiglu_experts_fwd, _swiglu_experts_bwd)


def swiglu_experts(rows, ids, gate_up, down):
    """The routed SwiGLU experts on unsorted rows in one custom call each way (forward and
    backward): `y[r] = (silu(gate) * up)(rows[r] @ gate_up[ids[r]]) @ down[ids[r]]`, zero
    for a row whose id is outside `[0, G)` (another shard's expert, or a dropped or padding
    slot).

    The C++ kernels sort the rows by expert (a stable counting sort), run the grouped
    matmuls and the activation between them, and scatter the results back; the backward
    recomputes the sort and the activation from the saved up projection `h [R, 2H]` (named
    "moe_up" for remat policies). What XLA would run as some thirty ops a layer (the sort,
    gathers, scatters, the activation and their transposes) is two custom calls. The same
    multiply-adds as the unfused grouped matmuls (`executed_macs` counts them).

    Args:
      rows: `[R, F]` float32 or bfloat16.
      ids: `[R]` int32, each row's expert among this shard's G.
      gate_up: `[G, F, 2H]`, interleaved `(gate_0, up_0, gate_1, ...)` columns (the layers'
        "swiglu"), of the rows' dtype.
      down: `[G, H, F]`, of the rows' dtype.

    Returns:
      `[R, F]` in the rows' dtype; differentiable in rows, gate_up and down.

    Raises:
      NotImplementedError: `swiglu_experts_supported` is False for these operands.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.kernels.grouped_matmul import native_cpu
      >>> rows = jnp.ones((3, 4))
      >>> gate_up, down = jnp.ones((2, 4, 6)), jnp.ones((2, 3, 4))
      >>> y = native_cpu.swiglu_experts(rows, jnp.array([1, 5, 0]), gate_up, down)
      >>> [round(v, 2) for v in y[:, 0].tolist()]  # 3 x silu(4) x 4; row 1's expert: not held
      [47.14, 0.0, 47.14]
    """
    if not swiglu_experts_supported(rows, gate_up, down):
        raise NotImplementedError(
            "swiglu_experts runs float32 or bfloat16 rows [R, F] and experts [G, F, 2H], "
            "[G, H, F] of one dtype, on the CPU, per device, with the native extension"
        )
    ids = ids.astype(jnp.int32)
    rows, ids, gate_up, down = vma.match_varying(rows, ids, gate_up, down)
    return _swiglu_experts(rows, ids, gate_up, down)
