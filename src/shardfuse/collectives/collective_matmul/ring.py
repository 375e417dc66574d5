"""The decomposed rings of the collective matmuls, written with `ppermute` and `sf.matmul`.

Collective matmul (Wang et al., "Overlap Communication with Dependent
Computation via Decomposition in Large Deep Learning Models", ASPLOS 2023;
the decomposition behind XLA's windowed einsum and Megatron's TP overlap):
an all-gather (or reduce-scatter) next to a matmul is split into N ring steps.
In step s every device

- gather ring: multiplies the chunk it received in step s - 1 while it sends
  that chunk on to its neighbour (`ppermute`), so the dot never waits for the
  transfer in flight;
- scatter ring: sends the partial sum it finished in step s - 1 while it
  multiplies its own contribution to the next chunk, then adds the received
  partial in the epilogue: `acc = sf.matmul(x_chunk, w, addend=received)`.

Bidirectional rings (as on TPU ICI and NVLink, where each link is full
duplex) split every chunk into two halves moving in opposite directions, so
each step sends half the bytes over each of two links. Every step runs under
`jax.named_scope(f"ring_step_{s}")`; N - 1 ppermutes per direction in all.

Partial sums travel and accumulate in float32 whatever the input dtype.
These functions are the building blocks; `xla.py` pairs them into custom VJPs.
"""

import jax
import jax.numpy as jnp
from jax import lax

from shardfuse.collectives.collective_matmul.base import RingPlan
from shardfuse.kernels.matmul import api as matmul_api


def _matmul(a, b, addend=None, *, implementation, precision, out_dtype=None):
    return matmul_api.matmul(
        a,
        b,
        addend=addend,
        out_dtype=out_dtype,
        implementation=implementation,
        precision=precision,
    )


def shift(x, plan: RingPlan, direction: int):
    """Sends x to device `i + direction` on the ring (and receives from `i - direction`)."""
    n = plan.size
    perm = [(j, (j + direction) % n) for j in range(n)]
    return lax.ppermute(x, plan.axis_name, perm)


def _rows(x, axis: int, start, size: int):
    return lax.dynamic_slice_in_dim(x, start, size, axis)


def _flat(x):
    return x.reshape(-1, x.shape[-1])  # [R, C]: every row of every batch


def _lane_rows(x, plan: RingPlan):
    """The static row slices of a local chunk, one per lane."""
    return [lax.slice_in_dim(x, lane.lo, lane.hi, axis=plan.axis) for lane in plan.lanes]


def gather_matmul(x, w, plan: RingPlan, *, implementation: str, out_dtype):
    """`all_gather(x, axis) @ w` as a ring: `[..., m, ..., C] @ [C, F] -> [..., N*m, ..., F]`.

    In step s, lane `d` holds rows from device `i - s*d` (received in step s-1)
    and forwards them while multiplying.
    """
    i = lax.axis_index(plan.axis_name)
    n, m = plan.size, plan.chunk
    out_shape = list(x.shape)
    out_shape[plan.axis] = n * m
    out_shape[-1] = w.shape[1]
    out = jnp.zeros(out_shape, out_dtype)
    held = _lane_rows(x, plan)
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            sent = (
                [shift(h, plan, lane.direction) for h, lane in zip(held, plan.lanes, strict=True)]
                if s < n - 1
                else held
            )
            for h, lane in zip(held, plan.lanes, strict=True):
                source = (i - s * lane.direction) % n
                y = _matmul(
                    h,
                    w,
                    implementation=implementation,
                    precision=plan.precision,
                    out_dtype=out_dtype,
                )
                out = lax.dynamic_update_slice_in_dim(out, y, source * m + lane.lo, plan.axis)
            held = sent
    return out


def scatter_matmul(x, w, plan: RingPlan, *, implementation: str):
    """`psum_scatter(x @ w, axis)` as a ring: x `[..., N*m, ..., C]` -> float32 `[..., m, ..., F]`.

    In step s, lane `d` adds this device's contribution to the rows of chunk
    `t = i - d*(s + 1)`, onto the partial sum received from device `i - d`;
    after N steps device i holds the full sum of its own chunk.
    """
    i = lax.axis_index(plan.axis_name)
    n, m = plan.size, plan.chunk
    accs = [None] * len(plan.lanes)
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            received = (
                [shift(a, plan, lane.direction) for a, lane in zip(accs, plan.lanes, strict=True)]
                if s > 0
                else accs
            )
            for k, lane in enumerate(plan.lanes):
                target = (i - lane.direction * (s + 1)) % n
                rows = _rows(x, plan.axis, target * m + lane.lo, lane.size)
                accs[k] = _matmul(
                    rows,
                    w,
                    received[k],
                    implementation=implementation,
                    precision=plan.precision,
                    out_dtype=jnp.float32,
                )
    return jnp.concatenate(accs, axis=plan.axis) if len(accs) > 1 else accs[0]


def gather_matmul_bwd(x, w, dy, plan: RingPlan, *, implementation: str):
    """Gradients of `all_gather(x) @ w` in one fused ring.

    `dx = psum_scatter(dy @ w^T)` (a scatter ring over dy) and
    `dw = sum_j x_j^T dy_j` (a gather ring over x, accumulated per step), both
    float32. Each step issues the two ppermutes, then its two dots.
    """
    i = lax.axis_index(plan.axis_name)
    n, m = plan.size, plan.chunk
    w_t = w.T  # [F, C]
    held = _lane_rows(x, plan)
    accs = [None] * len(plan.lanes)
    dw = None
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            sent = (
                [shift(h, plan, lane.direction) for h, lane in zip(held, plan.lanes, strict=True)]
                if s < n - 1
                else held
            )
            received = (
                [shift(a, plan, lane.direction) for a, lane in zip(accs, plan.lanes, strict=True)]
                if s > 0
                else accs
            )
            for k, (h, lane) in enumerate(zip(held, plan.lanes, strict=True)):
                source = (i - s * lane.direction) % n
                dy_source = _rows(dy, plan.axis, source * m + lane.lo, lane.size)
                dw = _matmul(
                    _flat(h).T,  # [C, R]
                    _flat(dy_source),  # [R, F]
                    dw,
                    implementation=implementation,
                    precision=plan.precision,
                    out_dtype=jnp.float32,
                )
                target = (i - lane.direction * (s + 1)) % n
                dy_target = _rows(dy, plan.axis, target * m + lane.lo, lane.size)
                accs[k] = _matmul(
                    dy_target,
                    w_t,
                    received[k],
                    implementation=implementation,
                    precision=plan.precision,
                    out_dtype=jnp.float32,
                )
            held = sent
    dx = jnp.concatenate(accs, axis=plan.axis) if len(accs) > 1 else accs[0]
    return dx, dw


def scatter_matmul_bwd(x, w, dy, plan: RingPlan, *, implementation: str):
    """Gradients of `psum_scatter(x @ w)` in one gather ring over dy.

    `dx = all_gather(dy) @ w^T` and `dw = sum_j x[chunk j]^T dy_j` (float32),
    both from the dy chunk received in the previous step.
    """
    i = lax.axis_index(plan.axis_name)
    n, m = plan.size, plan.chunk
    w_t = w.T  # [F, C]
    dx = jnp.zeros(x.shape, jnp.float32)
    held = _lane_rows(dy, plan)
    dw = None
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            sent = (
                [shift(h, plan, lane.direction) for h, lane in zip(held, plan.lanes, strict=True)]
                if s < n - 1
                else held
            )
            for h, lane in zip(held, plan.lanes, strict=True):
                start = (i - s * lane.direction) % n * m + lane.lo
                dx_rows = _matmul(
                    h,
                    w_t,
                    implementation=implementation,
                    precision=plan.precision,
                    out_dtype=jnp.float32,
                )
                dx = lax.dynamic_update_slice_in_dim(dx, dx_rows, start, plan.axis)
                x_rows = _rows(x, plan.axis, start, lane.size)
                dw = _matmul(
                    _flat(x_rows).T,
                    _flat(h),
                    dw,
                    implementation=implementation,
                    precision=plan.precision,
                    out_dtype=jnp.float32,
                )
            held = sent
    return dx, dw
