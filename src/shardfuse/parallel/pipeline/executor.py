"""Runs a `ScheduleTable` in one SPMD program: `lax.scan` over ticks, `ppermute` between stages.

The program is one `jax.shard_map` over EVERY axis of the mesh (a full-manual
region: the layers inside run per shard, see `shardfuse.layers._sharding`).
Device `s` of the pipeline axis holds chunks `c = 0..v-1` of the stack
(virtual stage `c * p + s`, `L / (p v)` layers each) and, per tick `t`, reads
its action `(kind, microbatch, chunk)` from the table's row `t`:

- F: `y = stage(x_in)` with `x_in` the microbatch itself (virtual stage 0) or
  the activation received earlier; `y` goes to the next virtual stage by
  `ppermute`; on the last virtual stage the head and the loss run instead,
  and the loss gradient `dy` is kept for the backward.
- B: the stage VJP: by default (`residuals="recompute"`) recomputing the
  forward from the kept stage input (the stage's residuals are never stored
  across ticks); with `residuals="stored"` the F tick kept the residuals of
  the stage's VJP (`residuals.StageVJP`) in ring buffers next to the stage
  input, and B applies the VJP to them without a forward. The input
  gradient goes to the previous virtual stage by `ppermute` (on virtual
  stage 0 it is the gradient of the pipeline's input, kept in a `[b, m, ...]`
  buffer the size of the batch only when asked for: `input_gradient=False`
  when the caller does not differentiate the input); without a split
  backward the parameter gradient is accumulated too.
- W (zero-bubble): the parameter gradient of a microbatch whose B ran earlier
  (recomputed, or from the same stored residuals as its B).

A tick computes only what its action needs (`lax.switch` on the action:
F = stage forward and, on the last stage, the head; B = the stage VJP; W =
the weight VJP) when neither the stage nor the head communicates. When they
do (tensor, sequence or data parallel layers inside the stage), every device
must run the same collectives in the same order, which per-device branches
break (the CPU runtime hangs): every tick then evaluates the whole stage VJP
and the head, and keeps what its action needs. Either way the results are
selected with `jnp.where`, never multiplied by 0: NaN in unused buffers or
bubble ticks never reaches a result.

Stage inputs, output gradients (and stored residuals) wait in ring buffers of
`table.buffer_slots` slots per chunk (microbatch `i` in slot `i % slots`):
`p` for 1F1B and zero-bubble, about `(v + 1) p` for interleaved, `m` for
GPipe. The table sets the scan length; nothing is unrolled.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardfuse.kernels.vma import to_varying, varying_axes
from shardfuse.parallel.pipeline.residuals import StageVJP, check_residuals
from shardfuse.parallel.pipeline.schedule import B, F, W


def arrival_tables(table):
    """Per (tick, stage): whether an activation / a gradient arrives, and its chunk and slot.

    An F on stage `s` (not the last virtual stage) is received by stage
    `s + 1` (chunk `c + 1` when it wraps from `p - 1` to 0) one tick later; a
    B on a virtual stage > 0 by stage `s - 1` (chunk `c - 1` when it wraps).
    Returns six int32 arrays `[ticks, p]`: forward valid, chunk, slot and
    backward valid, chunk, slot.
    """
    p, v, slots = table.num_stages, table.virtual_stages, table.buffer_slots
    ticks = table.num_ticks
    out = np.zeros((6, ticks, p), np.int32)
    for t in range(ticks - 1):
        for s in range(p):
            k, i, c = table.kind[t, s], table.microbatch[t, s], table.chunk[t, s]
            vs = c * p + s
            if k == F and vs < p * v - 1:
                to = (s + 1) % p
                out[0:3, t + 1, to] = (1, c + (s == p - 1), i % slots)
            if k == B and vs > 0:
                to = (s - 1) % p
                out[3:6, t + 1, to] = (1, c - (s == 0), i % slots)
    return out


def _varying_of(struct) -> frozenset:
    manual = getattr(struct, "manual_axis_type", None)
    vma = getattr(struct, "vma", None) or getattr(manual, "varying", None)
    return frozenset(vma or ())


def _typed_carry(body, carry, xs_row):
    """`carry` cast to vary over every axis the scan body makes it vary over (a fixed point)."""
    for _ in range(4):
        out = jax.eval_shape(lambda c: body(c, xs_row)[0], carry)
        grown = jax.tree.map(
            lambda c, o: to_varying(c, varying_axes(c) | _varying_of(o)), carry, out
        )
        same = all(
            varying_axes(a) == varying_axes(b)
            for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(grown), strict=True)
        )
        carry = grown
        if same:
            return carry
    return carry


def _inexact(struct) -> bool:
    return jnp.issubdtype(struct.dtype, jnp.inexact)


def _take(tree, index):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 0, keepdims=False), tree)


def _put(buffer, index, value, keep, axis=0):
    """`buffer[index] = value` (along `axis`) where `keep`, else unchanged (a select, NaN-safe)."""
    old = lax.dynamic_index_in_dim(buffer, index, axis, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, value, old), index, axis)


def _microbatch(tree, index):
    """Microbatch `index` of `[b, m, ...]` leaves: `[b, ...]`."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, 1, keepdims=False), tree)


def _put_at(buffer, first, second, value, keep):
    """`buffer[first, second] = value` where `keep`: one slice read and written (NaN-safe)."""
    old = buffer[first, second]
    start = (first, second) + (0,) * value.ndim
    return lax.dynamic_update_slice(buffer, jnp.where(keep, value, old)[None, None], start)


def _put2(buffer, first, second, value, keep):
    inner = lax.dynamic_index_in_dim(buffer, first, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(buffer, _put(inner, second, value, keep), first, 0)


_COLLECTIVES = ("psum", "all_gather", "ppermute", "all_to_all", "reduce_scatter", "pmax", "pmin")


def _has_collectives(jaxpr) -> bool:
    """Whether a (closed) jaxpr, sub-jaxprs included, communicates across devices."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if any(name in eqn.primitive.name for name in _COLLECTIVES):
            return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    if _has_collectives(sub):
                        return True
    return False


def _tick_compute(kind, operands, stage_fn, head_fn, head_params, split, plan=None):
    """One tick's stage work: `(y, d_params, d_x, loss_sum, weight_sum, d_head, d_y, stored)`.

    `operands` is `(params, x_in, cotangent, targets, weights, stored)`:
    `stored = (buffers, chunk, slot)`, the residual buffers and where this
    action's microbatch's residuals are (`plan`, a `residuals.StageVJP`;
    `([], ...)` and `plan=None` when the backward recomputes the stage
    forward): only the branches that use them read them. The last output is
    the residuals of this tick's forward, to keep (`[]` when recomputing).

    Without collectives in the stage or the head, a `lax.switch` on the action
    computes only what it needs (F: the stage forward and the head; B: the
    stage VJP, from the stored residuals or recomputing the forward, input
    gradient only when the backward is split; W: the weight VJP) and zeros for
    the rest. With collectives (tensor, sequence, data parallel stages),
    every device must run the same ops in the same order: every tick then
    evaluates the forward, the whole VJP and the head, and the caller keeps
    what the action needs (`jnp.where`).
    """

    def stage_vjp(params, x_in, stored, cotangent):
        if plan is None:
            y, vjp_fn = jax.vjp(stage_fn, params, x_in)
            return y, vjp_fn(to_varying(cotangent, varying_axes(y)))
        buffers, chunk, slot = stored
        leaves = [buffer[chunk, slot] for buffer in buffers]
        cotangent = to_varying(cotangent, _varying_of(plan.output))
        return None, plan.backward(params, x_in, leaves, cotangent)

    def uniform(params, x_in, cotangent, targets, weights, stored):
        y, new_stored = stage_forward(params, x_in)
        _, (d_params, d_x) = stage_vjp(params, x_in, stored, cotangent)
        (loss_sum, weight_sum), head_vjp = jax.vjp(
            lambda hp, y: head_fn(hp, y, targets, weights), head_params, y
        )
        d_head, d_y = head_vjp((jnp.ones_like(loss_sum), jnp.zeros_like(weight_sum)))
        return y, d_params, d_x, loss_sum, weight_sum, d_head, d_y, new_stored

    def stage_forward(params, x_in):
        if plan is None:
            return stage_fn(params, x_in), []
        return plan.forward(params, x_in)

    if _has_collectives(jax.make_jaxpr(uniform)(*operands)):
        return uniform(*operands)
    template = jax.eval_shape(uniform, *operands)

    def typed(tree):
        return jax.tree.map(
            lambda a, t: to_varying(a.astype(t.dtype), _varying_of(t)), tree, template
        )

    zeros = jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), template)

    def idle(params, x_in, cotangent, targets, weights, stored):
        return typed(zeros)

    def forward(params, x_in, cotangent, targets, weights, stored):
        y, new_stored = stage_forward(params, x_in)
        (loss_sum, weight_sum), head_vjp = jax.vjp(
            lambda hp, y: head_fn(hp, y, targets, weights), head_params, y
        )
        d_head, d_y = head_vjp((jnp.ones_like(loss_sum), jnp.zeros_like(weight_sum)))
        return typed((y, zeros[1], zeros[2], loss_sum, weight_sum, d_head, d_y, new_stored))

    def backward(params, x_in, cotangent, targets, weights, stored):
        if plan is not None:  # the weight gradient is dead code when split (XLA removes it)
            _, (d_params, d_x) = stage_vjp(params, x_in, stored, cotangent)
            d_params = zeros[1] if split else d_params
        elif split:  # input gradient only; the weight gradient is a later W
            y, input_vjp = jax.vjp(lambda x: stage_fn(params, x), x_in)
            (d_x,) = input_vjp(to_varying(cotangent, varying_axes(y)))
            d_params = zeros[1]
        else:
            _, (d_params, d_x) = stage_vjp(params, x_in, stored, cotangent)
        return typed((zeros[0], d_params, d_x, *zeros[3:]))

    def weight(params, x_in, cotangent, targets, weights, stored):
        if plan is not None:
            _, (d_params, _) = stage_vjp(params, x_in, stored, cotangent)
        else:
            y, weight_vjp = jax.vjp(lambda p: stage_fn(p, x_in), params)
            (d_params,) = weight_vjp(to_varying(cotangent, varying_axes(y)))
        return typed((zeros[0], d_params, *zeros[2:]))

    return lax.switch(kind, (idle, forward, backward, weight), *operands)


def run_schedule(
    table,
    *,
    stage_fn,
    head_fn,
    pipeline_axis,
    stage_params,
    head_params,
    x,
    targets,
    weights,
    poison=False,
    residuals="recompute",
    input_gradient=True,
):
    """The per-shard program (call it inside a full-manual `jax.shard_map`).

    Args:
      table: the `ScheduleTable`.
      stage_fn: `stage_fn(chunk_params, x) -> y`, one chunk's layers on local activations.
      head_fn: `head_fn(head_params, y, targets, weights) -> (loss_sum, weight_sum)` on the
        last virtual stage (None in forward-only runs).
      pipeline_axis: the pipeline mesh axis.
      stage_params: this device's chunks, leaves `[v, L/(p v), ...]`.
      head_params: the head's local parameters (None in forward-only runs).
      x: `[b, m, ...]` local microbatches (microbatch `i` is `x[:, i]`: the batch
        reshaped, never transposed, so that no copy of it is made); targets,
        weights: `[b, m, ...]` (or None).
      poison: fill every buffer and every unused transfer with NaN (tests).
      residuals: "recompute" (a B or W tick reruns the stage forward from the
        kept stage input) or "stored" (the F tick keeps the stage VJP's
        residuals in ring buffers `[v, slots, ...]` per leaf, the stage
        input's slots; B and W apply the VJP to them, no forward).
      input_gradient: keep the gradient of `x` (a `[b, m, ...]` buffer, the
        size of the input); False when the input is not differentiated: `dx`
        is then None and no buffer of the batch's size is allocated.

    Returns:
      forward-only: `y` `[b, m, ...]` (the last stage's outputs; zeros elsewhere).
      training: `(loss_sum, weight_sum, stage_grads, head_grads, dx)`, unreduced
      over the pipeline axis except the stage gradients (`dx` None without
      `input_gradient`).
    """
    p, v = table.num_stages, table.virtual_stages
    slots = table.buffer_slots
    forward_only = table.forward_only
    split = table.split_backward
    stored_mode = check_residuals(residuals) == "stored" and not forward_only
    stage = lax.axis_index(pipeline_axis)
    fill = jnp.nan if poison else 0.0
    act = x[:, 0]
    tables = np.stack([table.kind, table.microbatch, table.chunk, *arrival_tables(table)], -1)
    perm_forward = [(s, (s + 1) % p) for s in range(p)]
    perm_backward = [(s, (s - 1) % p) for s in range(p)]

    def pick(row):
        kind, i, c, f_ok, f_c, f_slot, b_ok, b_c, b_slot = (
            lax.dynamic_index_in_dim(row, stage, 0, keepdims=False)[j] for j in range(9)
        )
        return (
            kind,
            jnp.maximum(i, 0),
            jnp.maximum(c, 0),
            f_ok == 1,
            f_c,
            f_slot,
            b_ok == 1,
            b_c,
            b_slot,
        )

    def tick(carry, row):
        kind, i, c, f_ok, f_c, f_slot, b_ok, b_c, b_slot = pick(row)
        slot = i % slots
        first = (c == 0) & (stage == 0)
        last = (c == v - 1) & (stage == p - 1)
        carry = dict(carry)
        carry["inputs"] = _put2(carry["inputs"], f_c, f_slot, carry["from_prev"], f_ok)
        x_in = jnp.where(first, _microbatch(x, i), carry["inputs"][c, slot])
        params = _take(stage_params, c)
        is_f = kind == F
        if forward_only:
            y = stage_fn(params, x_in)
            carry["out"] = _put(carry["out"], i, y, is_f & last, axis=1)
            send_f, send_b = y, None
        else:
            carry["grads_in"] = _put2(carry["grads_in"], b_c, b_slot, carry["from_next"], b_ok)
            cotangent = carry["grads_in"][c, slot]
            plan = StageVJP(stage_fn, params, x_in) if stored_mode else None
            stored = (carry["stored"], c, slot)
            operands = (
                params,
                x_in,
                cotangent,
                _microbatch(targets, i),
                _microbatch(weights, i),
                stored,
            )
            y, d_params, d_x, loss_sum, weight_sum, d_head, d_y, new_stored = _tick_compute(
                kind, operands, stage_fn, head_fn, head_params, split, plan
            )
            carry["stored"] = [
                _put_at(buf, c, slot, new, is_f)
                for buf, new in zip(carry["stored"], new_stored, strict=True)
            ]
            head_tick = is_f & last
            carry["grads_in"] = _put2(carry["grads_in"], c, slot, d_y.astype(y.dtype), head_tick)
            carry["loss"] = jnp.where(head_tick, carry["loss"] + loss_sum, carry["loss"])
            carry["weight"] = jnp.where(head_tick, carry["weight"] + weight_sum, carry["weight"])
            carry["head_grads"] = jax.tree.map(
                lambda acc, g: jnp.where(head_tick, acc + g, acc), carry["head_grads"], d_head
            )
            weight_tick = (kind == W) if split else (kind == B)
            carry["stage_grads"] = jax.tree.map(
                lambda acc, g: _put(acc, c, _take(acc, c) + g, weight_tick),
                carry["stage_grads"],
                d_params,
            )
            is_b = kind == B
            if input_gradient:
                carry["dx"] = _put(carry["dx"], i, d_x, is_b & first, axis=1)
            send_f, send_b = y, jnp.where(is_b, d_x, fill)
        send_f = jnp.where(is_f, send_f, fill)
        carry["from_prev"] = lax.ppermute(send_f, pipeline_axis, perm_forward)
        if send_b is not None:
            carry["from_next"] = lax.ppermute(send_b, pipeline_axis, perm_backward)
        return carry, None

    # Activations and their gradients vary over the pipeline and over what x varies over.
    act_axes = varying_axes(x) | {pipeline_axis}
    buffer = to_varying(jnp.full((v, slots, *act.shape), fill, act.dtype), act_axes)
    incoming = to_varying(jnp.full(act.shape, fill, act.dtype), act_axes)
    carry = dict(inputs=buffer, from_prev=incoming)
    if forward_only:
        carry["out"] = jnp.zeros(x.shape, x.dtype)
    else:
        carry.update(
            grads_in=buffer,
            from_next=incoming,
            loss=jnp.zeros((), jnp.float32),
            weight=jnp.zeros((), jnp.float32),
            head_grads=jax.tree.map(jnp.zeros_like, head_params),
            stage_grads=jax.tree.map(jnp.zeros_like, stage_params),
            stored=[],
        )
        if input_gradient:
            carry["dx"] = jnp.zeros(x.shape, x.dtype)
        if stored_mode:
            # Residuals vary over the pipeline too (each stage keeps its own microbatches').
            plan = StageVJP(stage_fn, _take(stage_params, 0), incoming)
            carry["stored"] = [
                to_varying(
                    jnp.full((v, slots, *r.shape), fill if _inexact(r) else 0, r.dtype),
                    _varying_of(r) | {pipeline_axis},
                )
                for r in plan.stored
            ]
    if not forward_only:
        # The head's parameters are the same on every stage; made to vary over the pipeline
        # here, so that each tick's VJP does not sum the head gradients of every stage (the
        # transpose of the implicit cast), only the caller's final psum does.
        head_params = jax.tree.map(
            lambda a: to_varying(a, frozenset((pipeline_axis,))), head_params
        )
        carry["head_grads"] = jax.tree.map(jnp.zeros_like, head_params)
    rows = jnp.asarray(tables)
    carry = _typed_carry(tick, carry, rows[0])
    carry, _ = lax.scan(tick, carry, rows)
    if forward_only:
        return carry["out"]
    dx = carry["dx"] if input_gradient else None
    return carry["loss"], carry["weight"], carry["stage_grads"], carry["head_grads"], dx
