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


def _dot(plan: RingPlan, implementation: str):
    """`dot(a, b, addend=None, out_dtype=float32)`: sf.matmul by `implementation` at the plan's
    precision, every ring step's product."""

    def dot(a, b, addend=None, out_dtype=jnp.float32):
        return matmul_api.matmul(
            a,
            b,
            addend=addend,
            out_dtype=out_dtype,
            implementation=implementation,
            precision=plan.precision,
        )

    return dot


def shift(x, plan: RingPlan, direction: int):
    """Sends x to device `i + direction` on the ring (and receives from `i - direction`)."""
    n = plan.size
    perm = [(j, (j + direction) % n) for j in range(n)]
    return lax.ppermute(x, plan.axis_name, perm)


def _pass_on(chunks, plan: RingPlan):
    """Each lane's chunk sent one hop along its lane's direction (received from the other side)."""
    return [shift(c, plan, lane.direction) for c, lane in zip(chunks, plan.lanes, strict=True)]


def _start(plan: RingPlan, chunk, lane):
    """The first row of `lane`'s part of ring chunk `chunk` (mod N) along the full axis."""
    return chunk % plan.size * plan.chunk + lane.lo


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
    dot = _dot(plan, implementation)
    out_shape = list(x.shape)
    out_shape[plan.axis] = n * m
    out_shape[-1] = w.shape[1]
    out = jnp.zeros(out_shape, out_dtype)
    held = _lane_rows(x, plan)
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            sent = _pass_on(held, plan) if s < n - 1 else held
            for h, lane in zip(held, plan.lanes, strict=True):
                source = _start(plan, i - s * lane.direction, lane)
                y = dot(h, w, out_dtype=out_dtype)
                out = lax.dynamic_update_slice_in_dim(out, y, source, plan.axis)
            held = sent
    return out


def scatter_matmul(x, w, plan: RingPlan, *, implementation: str):
    """`psum_scatter(x @ w, axis)` as a ring: x `[..., N*m, ..., C]` -> float32 `[..., m, ..., F]`.

    In step s, lane `d` adds this device's contribution to the rows of chunk
    `t = i - d*(s + 1)`, onto the partial sum received from device `i - d`;
    after N steps device i holds the full sum of its own chunk.
    """
    i = lax.axis_index(plan.axis_name)
    dot = _dot(plan, implementation)
    accs = [None] * len(plan.lanes)
    for s in range(plan.size):
        with jax.named_scope(f"ring_step_{s}"):
            received = _pass_on(accs, plan) if s > 0 else accs
            for k, lane in enumerate(plan.lanes):
                target = _start(plan, i - lane.direction * (s + 1), lane)
                accs[k] = dot(_rows(x, plan.axis, target, lane.size), w, received[k])
    return jnp.concatenate(accs, axis=plan.axis) if len(accs) > 1 else accs[0]


def gather_matmul_bwd(x, w, dy, plan: RingPlan, *, implementation: str):
    """Gradients of `all_gather(x) @ w` in one fused ring.

    `dx = psum_scatter(dy @ w^T)` (a scatter ring over dy) and
    `dw = sum_j x_j^T dy_j` (a gather ring over x, accumulated per step), both
    float32. Each step issues the two ppermutes, then its two dots.
    """
    i = lax.axis_index(plan.axis_name)
    n = plan.size
    dot = _dot(plan, implementation)
    w_t = w.T  # [F, C]
    held = _lane_rows(x, plan)
    accs = [None] * len(plan.lanes)
    dw = None
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            sent = _pass_on(held, plan) if s < n - 1 else held
            received = _pass_on(accs, plan) if s > 0 else accs
            for k, (h, lane) in enumerate(zip(held, plan.lanes, strict=True)):
                source = _start(plan, i - s * lane.direction, lane)
                dy_source = _rows(dy, plan.axis, source, lane.size)
                dw = dot(_flat(h).T, _flat(dy_source), dw)  # [C, R] @ [R, F]
                target = _start(plan, i - lane.direction * (s + 1), lane)
                dy_target = _rows(dy, plan.axis, target, lane.size)
                accs[k] = dot(dy_target, w_t, received[k])
            held = sent
    dx = jnp.concatenate(accs, axis=plan.axis) if len(accs) > 1 else accs[0]
    return dx, dw


def scatter_matmul_bwd(x, w, dy, plan: RingPlan, *, implementation: str):
    """Gradients of `psum_scatter(x @ w)` in one gather ring over dy.

    `dx = all_gather(dy) @ w^T` and `dw = sum_j x[chunk j]^T dy_j` (float32),
    both from the dy chunk received in the previous step.
    """
    i = lax.axis_index(plan.axis_name)
    n = plan.size
    dot = _dot(plan, implementation)
    w_t = w.T  # [F, C]
    dx = jnp.zeros(x.shape, jnp.float32)
    held = _lane_rows(dy, plan)
    dw = None
    for s in range(n):
        with jax.named_scope(f"ring_step_{s}"):
            sent = _pass_on(held, plan) if s < n - 1 else held
            for h, lane in zip(held, plan.lanes, strict=True):
                start = _start(plan, i - s * lane.direction, lane)
                dx = lax.dynamic_update_slice_in_dim(dx, dot(h, w_t), start, plan.axis)
                x_rows = _rows(x, plan.axis, start, lane.size)
                dw = dot(_flat(x_rows).T, _flat(h), dw)
            held = sent
    return dx, dw
