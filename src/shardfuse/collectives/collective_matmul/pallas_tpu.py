"""The pallas_tpu implementation: fused remote-DMA ring kernels under `jax.custom_vjp`.

The forward passes are the fused kernels of `pallas_tpu_kernels.py` (remote
DMAs double-buffered under the matmuls, with a credit handshake,
bidirectional). x is laid out for them as a 2-D `[rows, C]` matrix whose rows
are grouped by the gathered / scattered axis (that axis moved to the front,
the other non-contracted axes flattened behind it), so a chunk, or half a
chunk for a bidirectional lane, is a contiguous block of rows.

The backward passes are fused kernels too: `dx` of all-gather-matmul is a
matmul-reduce-scatter of dy by w^T and vice versa, and `dw`, a sum over ring
steps of `x_j^T dy_j`, is the gather-accumulate kernel (the ring of the
all-gather kernel, each step adding a transposed-LHS product into a float32
VMEM accumulator). Where the transposed problems do not fit the kernels
(NotImplementedError), the backward runs the xla ring (`ring.py`) instead.

Off TPU the kernels run in TPU interpret mode (`pltpu.InterpretParams`), which
simulates the remote DMAs and semaphores across the CPU devices;
`pallas_interpret.interpret_mode(params)` picks its options (race detection,
DMA execution mode), and `interpret_mode(False)` forces the real kernels for
`lower(lowering_platforms=("tpu",))`.
"""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

from shardfuse.collectives.collective_matmul import pallas_tpu_kernels as kernels
from shardfuse.collectives.collective_matmul import ring
from shardfuse.collectives.collective_matmul.base import RingPlan, ring_vjp
from shardfuse.kernels.matmul import base as matmul_base
from shardfuse.kernels.pallas_interpret import current_interpret_params

# Per-device bytes the VMEM-resident kernels accept (operands, output, buffers).
VMEM_BUDGET_BYTES = 24 * 2**20

_HANDSHAKE = contextvars.ContextVar("shardfuse_collective_handshake", default=True)


@contextlib.contextmanager
def without_handshake():
    """Drop the credit handshake of the kernels traced inside: a deliberately racy kernel
    for testing the race detector (`shardfuse._compat.race_detector_params()`), never for use."""
    token = _HANDSHAKE.set(False)
    try:
        yield
    finally:
        _HANDSHAKE.reset(token)


def handshake() -> bool:
    """Whether kernels traced here wait for credits (False inside `without_handshake`)."""
    return _HANDSHAKE.get()


def manual_mesh_axes(plan: RingPlan) -> tuple[str, ...]:
    """The mesh axes of the shard_map the kernels run in (all manual, else
    NotImplementedError); the fused ring attention's kernels read them too."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(mesh.axis_names)
    if set(getattr(mesh, "manual_axes", axes)) != set(axes):
        raise NotImplementedError(
            "pallas_tpu collective matmuls need every mesh axis manual in the shard_map; "
            f"manual: {tuple(mesh.manual_axes)}, mesh: {axes}"
        )
    return axes


def _to_rows(x, axis: int):
    """x `[..., M, ..., C]` -> (`[M R, C]` grouped by the M axis, R, the moved shape)."""
    moved = jnp.moveaxis(x, axis, 0)  # [M, *rest, C]
    row_factor = math.prod(moved.shape[1:-1])
    return moved.reshape(-1, x.shape[-1]), row_factor, moved.shape


def _from_rows(y2, moved_shape, axis: int, rows: int):
    """`[rows R, F]` -> `[..., rows, ..., F]` with the row axis back at `axis`."""
    shape = (rows, *moved_shape[1:-1], y2.shape[-1])
    return jnp.moveaxis(y2.reshape(shape), 0, axis)


def _check_supported(dtype, widths, working_set: int, plan: RingPlan, row_factor: int):
    """NotImplementedError for what the VMEM-resident kernels cannot take (dispatch falls back)."""
    if jnp.dtype(dtype) == jnp.float16:
        raise NotImplementedError("pallas_tpu collective matmuls support float32 and bfloat16")
    if working_set > VMEM_BUDGET_BYTES:
        raise NotImplementedError(
            f"pallas_tpu collective matmul keeps operands in VMEM: {working_set} bytes per "
            f"device exceed {VMEM_BUDGET_BYTES}"
        )
    if current_interpret_params() is False:  # real Mosaic: (8, 128) tiles for the row blocks
        sublane = 8 if jnp.dtype(dtype) == jnp.float32 else 16
        rows = [lane.size * row_factor for lane in plan.lanes]
        if any(r % sublane for r in rows) or any(width % 128 for width in widths):
            raise NotImplementedError(
                f"pallas_tpu collective matmul on TPU needs lane rows {rows} divisible by "
                f"{sublane} and widths {tuple(widths)} divisible by 128"
            )


def _nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays)


def _gather_forward(x, w, plan: RingPlan, mesh_axes):
    """`all_gather(x) @ w` through the fused kernel."""
    x2, row_factor, moved = _to_rows(x, plan.axis)
    out_bytes = plan.size * x2.shape[0] * w.shape[1] * x.dtype.itemsize
    working_set = _nbytes(x, w) + out_bytes + 2 * _nbytes(x2)
    _check_supported(x.dtype, (x.shape[-1], w.shape[1]), working_set, plan, row_factor)
    y2 = kernels.all_gather_matmul_call(
        x2, w, plan, mesh_axes, row_factor,
        out_dtype=x.dtype, interpret=current_interpret_params(), handshake=handshake(),
    )  # fmt: skip
    return _from_rows(y2, moved, plan.axis, plan.size * plan.chunk)


def _scatter_forward(x, w, plan: RingPlan, mesh_axes):
    """float32 `psum_scatter(x @ w)` through the fused kernel."""
    x2, row_factor, moved = _to_rows(x, plan.axis)
    buffers = 4 * plan.chunk * row_factor * w.shape[1] * 4
    working_set = _nbytes(x, w) + buffers
    _check_supported(x.dtype, (x.shape[-1], w.shape[1]), working_set, plan, row_factor)
    y2 = kernels.matmul_reduce_scatter_call(
        x2,
        w,
        plan,
        mesh_axes,
        row_factor,
        interpret=current_interpret_params(),
        handshake=handshake(),
    )
    return _from_rows(y2, moved, plan.axis, plan.chunk)


def _gather_accumulate(gathered, local, plan: RingPlan, mesh_axes):
    """float32 `[H, G]` = sum_j local[chunk j]^T gathered_j through the fused kernel.

    gathered: this device's `[..., m, ..., G]`; local: `[..., N m, ..., H]`.
    """
    g2, row_factor, _ = _to_rows(gathered, plan.axis)
    l2, _, _ = _to_rows(local, plan.axis)
    working_set = _nbytes(g2, l2) + 2 * _nbytes(g2) + 4 * l2.shape[1] * g2.shape[1]
    widths = (g2.shape[1], l2.shape[1])
    _check_supported(gathered.dtype, widths, working_set, plan, row_factor)
    return kernels.gather_accumulate_call(
        g2,
        l2,
        plan,
        mesh_axes,
        row_factor,
        interpret=current_interpret_params(),
        handshake=handshake(),
    )


def _all_gather_matmul_grads(x, w, dy, plan, mesh_axes):
    dx = _scatter_forward(dy, w.T, plan, mesh_axes)  # psum_scatter(dy @ w^T)
    return dx, _gather_accumulate(x, dy, plan, mesh_axes).T  # sum_j x_j^T dy_j


def _matmul_reduce_scatter_grads(x, w, dy, plan, mesh_axes):
    dx = _gather_forward(dy, w.T, plan, mesh_axes)  # all_gather(dy) @ w^T
    return dx, _gather_accumulate(dy, x, plan, mesh_axes)  # sum_j x[chunk j]^T dy_j


def _or_xla_ring(kernel_grads, ring_grads):
    """`kernel_grads`, or the xla ring's `ring_grads` where the transposed problems do not
    fit the kernels (NotImplementedError)."""

    def grads(x, w, dy, plan, mesh_axes):
        try:
            return kernel_grads(x, w, dy, plan, mesh_axes)
        except NotImplementedError:
            return ring_grads(x, w, dy, plan, implementation="xla")

    return grads


def _scatter_forward_cast(x, w, plan, mesh_axes):
    return _scatter_forward(x, w, plan, mesh_axes).astype(x.dtype)


_all_gather_matmul = ring_vjp(
    _gather_forward,
    _or_xla_ring(_all_gather_matmul_grads, ring.gather_matmul_bwd),
    name="all_gather_matmul",
)
_matmul_reduce_scatter = ring_vjp(
    _scatter_forward_cast,
    _or_xla_ring(_matmul_reduce_scatter_grads, ring.scatter_matmul_bwd),
    name="matmul_reduce_scatter",
)


def _check_precision(plan: RingPlan, dtype):
    """The fused kernels multiply at the default precision: refuse any other."""
    config = matmul_base.MatmulConfig(out_dtype=jnp.dtype(dtype), precision=plan.precision)
    matmul_base.require_default_precision(config, dtype, "pallas_tpu collective")


def all_gather_matmul(x, w, plan: RingPlan):
    """`all_gather(x, axis=plan.axis, tiled=True) @ w` through the fused kernel."""
    _check_precision(plan, x.dtype)
    return _all_gather_matmul(x, w, plan, manual_mesh_axes(plan))


def matmul_reduce_scatter(x, w, plan: RingPlan):
    """`psum_scatter(x @ w, scatter_dimension=plan.axis, tiled=True)` through the fused kernel."""
    _check_precision(plan, x.dtype)
    return _matmul_reduce_scatter(x, w, plan, manual_mesh_axes(plan))


def matmul_all_reduce(x, w, plan, axis_name, precision=None):
    """No fused all-reduce kernel: NotImplementedError (dispatch falls back to the xla ring)."""
    raise NotImplementedError(
        "pallas_tpu has no fused matmul_all_reduce; use implementation='xla' (the ring all-reduce)"
    )
