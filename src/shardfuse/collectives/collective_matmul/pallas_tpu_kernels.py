"""Fused Pallas TPU kernels of the collective matmuls: remote DMAs under the MXU.

One kernel per op runs the whole ring (the decomposition of Wang et al.,
ASPLOS 2023, as in the Pallas TPU distributed-computing guide,
https://docs.jax.dev/en/latest/pallas/tpu/distributed.html): in step s each
device starts `pltpu.make_async_remote_copy` of what its neighbour needs next
and multiplies the current chunk while the DMA flies.

- all-gather-matmul: the chunk received in step s-1 is forwarded from the
  receive buffer it sits in, and multiplied; its product lands in the output
  rows of the chunk's source device.
- gather-accumulate (the weight gradients): the same ring as all-gather-matmul,
  each step adding `local[rows of the chunk]^T @ chunk` into a float32 VMEM
  accumulator.
- matmul-reduce-scatter: this device's contribution to chunk `i - d(s+1)` is
  multiplied first, then the partial sum received in step s-1 is added
  (the epilogue of a matmul-plus-reduce) and the float32 result is sent on.

Double buffering: receive buffers alternate between two slots, so the DMA of
step s writes slot `s % 2` while slot `(s - 1) % 2` is read. Handshake: a
fast upstream device could still overwrite a slot its downstream neighbour is
reading (two steps behind); so before the DMA of step s >= 2 the sender waits
for a credit on a REGULAR semaphore, which the receiver signals once it has
finished reading that slot (its matmul and its own forwarding DMA are done).
Credits are signalled exactly as often as they are awaited, so every
semaphore ends at zero. `handshake=False` removes them: the planted race the
race-detector test must catch. A barrier with both neighbours precedes the
first DMA. Bidirectional rings run two lanes (half of each chunk's rows each
way) with their own buffers and semaphores.

Operands live whole in VMEM (no HBM tiling inside a step): the kernels are
for per-device working sets of a few MiB; larger ones raise
NotImplementedError and dispatch falls back to the xla ring.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.collectives.collective_matmul.base import Lane, RingPlan
from shardfuse.kernels import vma
from shardfuse.kernels.precision import dot_precision


def ring_table(plan: RingPlan, mesh_axes: tuple[str, ...], row_factor: int, *, scatter: bool):
    """int32 `[2 A + N L]` indices the kernel reads from SMEM, computed outside it.

    Entries: the mesh coordinates (A = number of mesh axes) of ring neighbours
    `i + 1` and `i - 1`, then for each step s and lane l the first row of the
    chunk rows it multiplies: source `i - s d` (all-gather) or target
    `i - (s + 1) d` (reduce-scatter), times `m R`, plus the lane's offset.
    (Computing them here keeps the kernel free of axis-index arithmetic.)
    """
    n = plan.size
    i = lax.axis_index(plan.axis_name)
    entries = []
    for direction in (+1, -1):
        for axis in mesh_axes:
            if axis == plan.axis_name:
                entries.append(lax.rem(i + direction + n, n))
            else:
                entries.append(lax.axis_index(axis))
    chunk_rows = plan.chunk * row_factor
    for s in range(n):
        for lane in plan.lanes:
            shift = lane.direction * (s + 1 if scatter else s)
            index = lax.rem(i - shift + (s + 1) * n, n)
            entries.append(index * chunk_rows + lane.lo * row_factor)
    return jnp.stack([jnp.asarray(e, jnp.int32) for e in entries])


def neighbour(table_ref, direction: int, num_axes: int):
    """Mesh coordinates of ring neighbour `i + direction` (direction = +1 or -1).

    Remote DMAs and semaphore signals take them as `device_id` without a
    `device_id_type`: mesh coordinates are the default on every supported JAX, and
    newer JAX deprecates the argument. Inside a kernel whose SMEM `table_ref` is a
    `ring_table` (the collective matmuls' and the fused ring attention's):

        pl.semaphore_signal(credit, 1, device_id=neighbour(table_ref, -1, num_axes))
    """
    first = 0 if direction == +1 else num_axes
    return tuple(table_ref[first + a] for a in range(num_axes))


def send_to_neighbour(src, dst, send_sem, recv_sem, *, slot, table_ref, direction, num_axes):
    """Starts the DMA of `src` into the ring neighbour's `dst[slot]` (semaphores `[slot]`).

    Inside a kernel (see `neighbour`); returns the started copy, to `wait()` on:

        copy = send_to_neighbour(chunk_ref, recv_ref, send_sem, recv_sem, slot=s % 2,
                                 table_ref=table_ref, direction=+1, num_axes=num_axes)
    """
    copy = pltpu.make_async_remote_copy(
        src,
        dst.at[slot],
        send_sem.at[slot],
        recv_sem.at[slot],
        device_id=neighbour(table_ref, direction, num_axes),
    )
    copy.start()
    return copy


def _row_start(table_ref, step: int, lane: int, num_lanes: int, num_axes: int):
    return table_ref[2 * num_axes + step * num_lanes + lane]


def barrier_with_neighbours(table_ref, num_axes: int):
    """Both ring neighbours have entered the kernel (their buffers exist) before any DMA.

    The first statement of a ring kernel (see `neighbour`):
    `barrier_with_neighbours(table_ref, num_axes)`.
    """
    barrier = pltpu.get_barrier_semaphore()
    for direction in (+1, -1):
        pl.semaphore_signal(
            barrier,
            1,
            device_id=neighbour(table_ref, direction, num_axes),
        )
    pl.semaphore_wait(barrier, 2)


def _lane_rows(lane: Lane, row_factor: int):
    return lane.lo * row_factor, lane.size * row_factor


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=dot_precision(a.dtype))


def _gather_ring(
    table_ref, local_ref, scratch, consume, *, plan: RingPlan, num_axes, row_factor, handshake
):
    """Runs the all-gather ring of `local_ref` (this device's `[m R, G]` chunk).

    In step s every lane waits for the rows received in step s - 1, forwards
    them (after a credit, from step 2 on), calls `consume(lane_index, step,
    rows_ref, first_row)` on them while the DMA flies (`first_row`: where the
    rows sit in the gathered `[N m R, G]` order), then waits for its send and
    hands the slot back upstream. Scratch per lane: buffers `[2, rows, G]`, DMA
    send and receive semaphores `[2]`, a REGULAR credit semaphore.
    """
    n = plan.size
    num_lanes = len(plan.lanes)
    lanes = [scratch[4 * k : 4 * k + 4] for k in range(num_lanes)]
    barrier_with_neighbours(table_ref, num_axes)
    pending = [None] * num_lanes  # the DMA each lane started in the previous step
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            held, started = [], []
            for k, lane in enumerate(plan.lanes):
                buf, send_sem, recv_sem, credit = lanes[k]
                lo, rows = _lane_rows(lane, row_factor)
                if s == 0:
                    src = local_ref.at[pl.ds(lo, rows)]
                else:
                    pending[k].wait_recv()  # the chunk for this step has arrived
                    src = buf.at[(s - 1) % 2]
                held.append(src)
                copy = None
                if s <= n - 2:
                    if handshake and s >= 2:
                        pl.semaphore_wait(credit, 1)  # downstream freed slot s % 2
                    copy = send_to_neighbour(
                        src, buf, send_sem, recv_sem, slot=s % 2, table_ref=table_ref,
                        direction=lane.direction, num_axes=num_axes,
                    )  # fmt: skip
                started.append(copy)
            for k, lane in enumerate(plan.lanes):
                lo, _ = _lane_rows(lane, row_factor)
                first = _row_start(table_ref, s, k, num_lanes, num_axes)
                consume(k, s, held[k], pl.multiple_of(first, math.gcd(plan.chunk * row_factor, lo)))
            for k, lane in enumerate(plan.lanes):
                credit = lanes[k][3]
                if started[k] is not None:
                    started[k].wait_send()
                if handshake and 1 <= s <= n - 3:  # slot (s - 1) % 2 is free again
                    upstream = neighbour(table_ref, -lane.direction, num_axes)
                    pl.semaphore_signal(credit, 1, device_id=upstream)
            pending = started


def all_gather_matmul_kernel(table_ref, x_ref, w_ref, out_ref, *scratch, plan: RingPlan, **ring):
    """table_ref (SMEM, `ring_table`), x_ref `[m R, C]` (this device's chunk), w_ref `[C, F]`,
    out_ref `[N m R, F]`: each received chunk times w, stored at its source's rows."""

    def consume(k, step, rows_ref, first):
        rows = rows_ref.shape[0]
        product = _dot(rows_ref[...], w_ref[...])
        out_ref[pl.ds(first, rows), :] = product.astype(out_ref.dtype)

    _gather_ring(table_ref, x_ref, scratch, consume, plan=plan, **ring)


def gather_accumulate_kernel(table_ref, g_ref, l_ref, acc_ref, *scratch, plan: RingPlan, **ring):
    """table_ref (SMEM), g_ref `[m R, G]` (this device's chunk, gathered by the ring),
    l_ref `[N m R, H]` (local, full rows), acc_ref float32 `[H, G]`:

        acc = sum_j l[rows of chunk j]^T g_j

    the weight gradient of a collective matmul (`dw` of all-gather-matmul with
    g = x, l = dy, transposed; of matmul-reduce-scatter with g = dy, l = x),
    accumulated step by step while the chunks travel.
    """
    acc_ref[...] = jnp.zeros_like(acc_ref)

    def consume(k, step, rows_ref, first):
        rows = rows_ref.shape[0]
        local = l_ref[pl.ds(first, rows), :]  # [rows, H]
        acc_ref[...] += lax.dot_general(
            local,
            rows_ref[...],
            (((0,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=dot_precision(local.dtype),
        )  # [H, G]

    _gather_ring(table_ref, g_ref, scratch, consume, plan=plan, **ring)


def matmul_reduce_scatter_kernel(
    table_ref, x_ref, w_ref, out_ref, *scratch, plan: RingPlan, num_axes, row_factor, handshake
):
    """table_ref (SMEM, `ring_table`), x_ref `[N m R, C]`, w_ref `[C, F]`, out_ref `[m R, F]`
    (this device's chunk of the sum).

    Scratch per lane: float32 send and receive buffers `[2, rows, F]`, DMA send
    and receive semaphores `[2]`, a REGULAR credit semaphore.
    """
    n = plan.size
    num_lanes = len(plan.lanes)
    lanes = [scratch[5 * k : 5 * k + 5] for k in range(num_lanes)]
    barrier_with_neighbours(table_ref, num_axes)
    pending = [None] * len(plan.lanes)
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            started = []
            for k, lane in enumerate(plan.lanes):
                send_buf, recv_buf, send_sem, recv_sem, credit = lanes[k]
                lo, rows = _lane_rows(lane, row_factor)
                start = _row_start(table_ref, s, k, num_lanes, num_axes)
                start = pl.multiple_of(start, math.gcd(plan.chunk * row_factor, lo))
                # This device's contribution first: it does not wait for the DMA in flight.
                partial = _dot(x_ref[pl.ds(start, rows), :], w_ref[...])
                if s >= 1:
                    pending[k].wait_recv()
                    partial = partial + recv_buf[(s - 1) % 2]
                    if handshake and s <= n - 3:  # slot (s - 1) % 2 is free again
                        upstream = neighbour(table_ref, -lane.direction, num_axes)
                        pl.semaphore_signal(credit, 1, device_id=upstream)
                copy = None
                if s == n - 1:
                    out_ref[pl.ds(lo, rows), :] = partial.astype(out_ref.dtype)
                else:
                    # Slot s % 2 was last sent from in step s - 2, waited for in step s - 1.
                    send_buf[s % 2] = partial
                    if handshake and s >= 2:
                        pl.semaphore_wait(credit, 1)  # downstream added its slot s % 2
                    copy = send_to_neighbour(
                        send_buf.at[s % 2], recv_buf, send_sem, recv_sem, slot=s % 2,
                        table_ref=table_ref, direction=lane.direction, num_axes=num_axes,
                    )  # fmt: skip
                if pending[k] is not None:
                    pending[k].wait_send()
                started.append(copy)
            pending = started


def _gather_scratch(plan: RingPlan, row_factor: int, width: int, dtype):
    scratch = []
    for lane in plan.lanes:
        scratch += [
            pltpu.VMEM((2, lane.size * row_factor, width), dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.REGULAR,
        ]
    return scratch


def _ring_call(
    kernel, a, b, plan, mesh_axes, row_factor, *, scatter, out_shape, scratch, collective_id,
    name, interpret, handshake,
):  # fmt: skip
    """`pallas_call` of one ring kernel on 2-D operands `a`, `b`: the ring table in SMEM,
    the operands and the result whole in VMEM, DMA scratch per lane."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.pallas_call(
        functools.partial(
            kernel,
            plan=plan,
            num_axes=len(mesh_axes),
            row_factor=row_factor,
            handshake=handshake,
        ),
        out_shape=out_shape,
        in_specs=[smem, vmem, vmem],
        out_specs=vmem,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=collective_id),
        interpret=interpret,
        name=name,
    )(ring_table(plan, mesh_axes, row_factor, scatter=scatter), a, b)


def all_gather_matmul_call(x2, w, plan, mesh_axes, row_factor, *, out_dtype, interpret, handshake):
    """The pallas_call of the all-gather-matmul kernel on 2-D operands."""
    return _ring_call(
        all_gather_matmul_kernel, x2, w, plan, mesh_axes, row_factor, scatter=False,
        out_shape=vma.shape_dtype_struct((plan.size * x2.shape[0], w.shape[1]), out_dtype, x2),
        scratch=_gather_scratch(plan, row_factor, x2.shape[1], x2.dtype), collective_id=0,
        name="shardfuse_all_gather_matmul", interpret=interpret, handshake=handshake,
    )  # fmt: skip


def gather_accumulate_call(g2, l2, plan, mesh_axes, row_factor, *, interpret, handshake):
    """The pallas_call of the gather-accumulate kernel: float32 `[H, G]` = sum_j l_j^T g_j."""
    return _ring_call(
        gather_accumulate_kernel, g2, l2, plan, mesh_axes, row_factor, scatter=False,
        out_shape=vma.shape_dtype_struct((l2.shape[1], g2.shape[1]), jnp.float32, g2),
        scratch=_gather_scratch(plan, row_factor, g2.shape[1], g2.dtype), collective_id=2,
        name="shardfuse_gather_accumulate", interpret=interpret, handshake=handshake,
    )  # fmt: skip


def matmul_reduce_scatter_call(
    x2, w, plan, mesh_axes, row_factor, *, interpret, handshake, out_dtype=jnp.float32
):
    """The pallas_call of the matmul-reduce-scatter kernel on 2-D operands (float32 result)."""
    scratch = []
    for lane in plan.lanes:
        rows = lane.size * row_factor
        scratch += [
            pltpu.VMEM((2, rows, w.shape[1]), jnp.float32),
            pltpu.VMEM((2, rows, w.shape[1]), jnp.float32),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SemaphoreType.REGULAR,
        ]
    return _ring_call(
        matmul_reduce_scatter_kernel, x2, w, plan, mesh_axes, row_factor, scatter=True,
        out_shape=vma.shape_dtype_struct((plan.chunk * row_factor, w.shape[1]), out_dtype, x2),
        scratch=scratch, collective_id=1, name="shardfuse_matmul_reduce_scatter",
        interpret=interpret, handshake=handshake,
    )  # fmt: skip
