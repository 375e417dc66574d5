"""Runs a `LockstepTable` in one SPMD program: a scan over ticks, `ppermute` between stages.

The program is one `jax.shard_map` over EVERY axis of the mesh (a full-manual
region: the layers inside run per shard, see `shardfuse.collectives.sharding.in_manual_region`).
Device `s` of the pipeline axis holds chunks `c = 0..v-1` of the stack
(virtual stage `c * p + s`, `L / (p v)` layers each). Each tick
(`lockstep.LockstepTable`) has an F slot and a B slot per stage:

- F: `y = stage(x_in)` with `x_in` the microbatch itself (virtual stage 0) or
  the activation received in the previous tick; `y` goes to the next
  virtual stage by `ppermute`; on the last virtual stage the head and the
  loss run on `y`, and the loss gradient `dy` is kept for the B slot (of
  the same tick: on the last virtual stage a microbatch's F, head and B run
  in one tick).
- B: the stage VJP, by default (`residuals="recompute"`) recomputing the
  forward from the kept stage input; with `residuals="stored"` the F slot
  kept the residuals of the stage's VJP (`residuals.StageVJP`) in ring
  buffers next to the stage input, and B applies the VJP to them without a
  forward. The input gradient goes to the previous virtual stage; the
  parameter gradient is accumulated (zb-h1's W runs inside B: see below).

Every stage runs the same ops in every tick (no per-stage branch), so tensor,
sequence or data parallel collectives inside a stage or the head are legal:
a stage with nothing in a slot computes on a dummy, and its results are
dropped with `jnp.where` (never multiplied by 0: NaN in unused buffers never
reaches a result). What a tick runs is fixed per tick by the table, not per
stage: the scan is cut into segments of consecutive ticks that use the same
slots (F only in the fill, F + head + B in the steady state, B only in the
drain; a repeating pattern such as interleaved's becomes a scan of scans),
each a `lax.scan` whose body holds exactly those slots. So every device
executes the table's lockstep work (`LockstepTable.work`) and nothing more:
the steady state is all real work, the fill and drain waste at most the
bubble, and the head runs in the ticks where the last stage needs it, not in
every tick.

Why not a per-stage `lax.switch` (each stage only its own action): in
lockstep a tick lasts as long as its slowest stage, and in every tick of
these tables some stage uses every slot in use (tested), so a switch saves
no time over a masked slot. The head is the exception: only the last stage
needs it, so it runs in a `lax.cond` on the stage index where a branch may
hold collectives (`branches_may_hold_collectives`: not on XLA:CPU with
other mesh axes, whose collectives wait for every device of the op), and
`Stack.apply_stage_layers` skips uneven stages' padding rows likewise.

zb-h1 runs as 1F1B, its W inside B: a separate W could save at most
`(p - 1) w` per step (aligned W slots), or reach the paper's bubble with
per-stage branches (no collectives), and only with a weight gradient that
costs `w`; JAX's VJP of a stage reruns the chain of cotangents (and,
recomputing, the forward) for it. The bound and the numbers: docs/pipeline.md.

Stage inputs, output gradients (and stored residuals) wait in ring buffers of
`table.buffer_slots` slots per chunk (microbatch `i` in slot `i % slots`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardfuse.collectives.sharding import branches_may_hold_collectives
from shardfuse.kernels.vma import to_varying, varying_axes
from shardfuse.parallel.pipeline.residuals import StageVJP, check_residuals

# Columns of the per-(tick, stage) table the scan reads.
_F_MB, _F_C, _B_MB, _B_C, _FA_OK, _FA_C, _FA_SLOT, _BA_OK, _BA_C, _BA_SLOT = range(10)


def arrival_tables(table):
    """`[ticks, p, 10]` int32: each stage's F and B `(microbatch, chunk)` and its arrivals.

    Columns: F microbatch, F chunk, B microbatch, B chunk (-1 when empty),
    then forward arrival valid, chunk, slot and backward arrival valid,
    chunk, slot. An F on virtual stage `k < v p - 1` in tick t is received
    by virtual stage `k + 1` (stage `s + 1`, chunk `c + 1` when it wraps) in
    tick t + 1; a B on `k > 0` by virtual stage `k - 1`.
    """
    p, v, slots = table.num_stages, table.virtual_stages, table.buffer_slots
    ticks = table.num_ticks
    out = np.zeros((ticks, p, 10), np.int32)
    out[..., 0:2] = table.forward
    out[..., 2:4] = table.backward
    for t in range(ticks - 1):
        for s in range(p):
            i, c = (int(a) for a in table.forward[t, s])
            if i >= 0 and c * p + s < p * v - 1:
                out[t + 1, (s + 1) % p, 4:7] = (1, c + (s == p - 1), i % slots)
            i, c = (int(a) for a in table.backward[t, s])
            if i >= 0 and c * p + s > 0:
                out[t + 1, (s - 1) % p, 7:10] = (1, c - (s == 0), i % slots)
    return out


def segments(active):
    """The scan plan: runs of ticks that use the same slots, repeating patterns folded.

    `active` is `LockstepTable.active()`, bool `[ticks, 3]`. Returns a list of
    `("scan", mask, start, length)` and `("repeat", start, count, parts)`
    items, `parts` a list of `(mask, offset, length)` within one period.

    Example usage::

      >>> import numpy as np
      >>> from shardfuse.parallel.pipeline.executor import segments
      >>> a = np.array([[1, 0, 0]] * 2 + [[1, 1, 1], [1, 0, 1]] * 3 + [[0, 0, 1]], bool)
      >>> segments(a)  # doctest: +NORMALIZE_WHITESPACE
      [('scan', (True, False, False), 0, 2),
       ('repeat', 2, 3, [((True, True, True), 0, 1), ((True, False, True), 1, 1)]),
       ('scan', (False, False, True), 8, 1)]
    """
    runs = []  # (mask, start, length)
    for t, row in enumerate(np.asarray(active, bool)):
        mask = tuple(bool(a) for a in row)
        if runs and runs[-1][0] == mask:
            runs[-1] = (mask, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((mask, t, 1))
    out, n = [], 0
    while n < len(runs):
        best = None  # (count, k)
        for k in range(1, 5):
            pattern = [(r[0], r[2]) for r in runs[n : n + k]]
            if len(pattern) < k:
                break
            count = 1
            while [(r[0], r[2]) for r in runs[n + count * k : n + (count + 1) * k]] == pattern:
                count += 1
            if count > 1 and (best is None or count * k > best[0] * best[1]):
                best = (count, k)
        if best is None:
            out.append(("scan", *runs[n]))
            n += 1
            continue
        count, k = best
        start = runs[n][1]
        parts = [(mask, s - start, length) for mask, s, length in runs[n : n + k]]
        out.append(("repeat", start, count, parts))
        n += count * k
    return out


def _varying_of(struct) -> frozenset:
    if not isinstance(struct, jax.ShapeDtypeStruct):  # an array or a tracer
        return varying_axes(struct)
    manual = getattr(struct, "manual_axis_type", None)
    vma = getattr(struct, "vma", None) or getattr(manual, "varying", None)
    return frozenset(vma or ())


def _typed_carry(bodies, carry, xs_row):
    """`carry` cast to vary over every axis any scan body makes it vary over (a fixed point)."""
    for _ in range(4):
        grown = carry
        for body in bodies:
            out = jax.eval_shape(lambda c, body=body: body(c, xs_row)[0], grown)
            grown = jax.tree.map(
                lambda c, o: to_varying(c, varying_axes(c) | _varying_of(o)), grown, out
            )
        same = all(
            varying_axes(a) == varying_axes(b)
            for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(grown), strict=True)
        )
        carry = grown
        if same:
            return carry
    return carry


def _zeros_like_typed(struct):
    """Zeros of `struct`'s shape and dtype, varying over the same manual axes."""
    return to_varying(jnp.zeros(struct.shape, struct.dtype), _varying_of(struct))


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
    aux_counts=None,
    stats=False,
):
    """The per-shard program (call it inside a full-manual `jax.shard_map`).

    Args:
      table: the `LockstepTable` (`lockstep.lockstep_table`).
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
      residuals: "recompute" (a B reruns the stage forward from the kept
        stage input) or "stored" (the F slot keeps the stage VJP's residuals
        in ring buffers `[v, slots, ...]` per leaf; B applies the VJP to
        them, no forward).
      input_gradient: keep the gradient of `x` (a `[b, m, ...]` buffer, the
        size of the input); False when the input is not differentiated: `dx`
        is then None and no buffer of the batch's size is allocated.
      aux_counts: None, or float32 `[m]` (the same on every device): then
        `stage_fn(chunk_params, x) -> (y, aux)`, `aux` a scalar term of the
        loss per microbatch (a MoE chunk's weighted aux losses, the same on
        every device of the stage), and microbatch `i`'s terms count
        `aux_counts[i] * aux` (its tokens' weight: `accumulate`'s `sum + count x
        aux`): added to `loss_sum` (once, on the first device along every axis
        but the pipeline's), and their gradients flow from the cotangent
        `aux_counts[i]` in the stage's B, next to the output gradient.
      stats: `stage_fn(chunk_params, x) -> (out, stats)` (`out` as above), `stats`
        a pytree of arrays `[L/(p v), ...]` not differentiated (a MoE chunk's
        layers' `MoEStats`): summed over each chunk's microbatches (F slots).

    Returns:
      forward-only: `y` `[b, m, ...]` (the last stage's outputs; zeros elsewhere).
      training: `(loss_sum, weight_sum, stage_grads, head_grads, dx, stats_sums)`,
      unreduced over the pipeline axis except the stage gradients (`dx` None without
      `input_gradient`; `loss_sum` holds the stages' aux terms with `aux_counts`;
      `stats_sums` None without `stats`, else this device's chunks' `[v, ...]`).
    """
    p, v = table.num_stages, table.virtual_stages
    slots = table.buffer_slots
    forward_only = table.forward_only
    stored_mode = check_residuals(residuals) == "stored" and not forward_only
    stage = lax.axis_index(pipeline_axis)
    fill = jnp.nan if poison else 0.0
    act = x[:, 0]
    perm_forward = [(s, (s + 1) % p) for s in range(p)]
    perm_backward = [(s, (s - 1) % p) for s in range(p)]
    with_aux = aux_counts is not None and not forward_only

    def split(out):  # a stage's output: (y, aux or None)
        return out if aux_counts is not None else (out, None)

    def call_stage(params, x_in):  # (y, aux or None, stats or None)
        out, chunk_stats = stage_fn(params, x_in) if stats else (stage_fn(params, x_in), None)
        return (*split(out), chunk_stats)

    def first_replica(value, vma):
        """`value` on the first device of every axis but the pipeline's in `vma`, else 0."""
        for axis in sorted(vma - {pipeline_axis}):
            value = jnp.where(lax.axis_index(axis) == 0, value, jnp.zeros_like(value))
        return value

    def aux_cotangent(aux_type, i):
        """The cotangent of microbatch `i`'s aux output: its count, once per replica."""
        vma = _varying_of(aux_type)
        count = first_replica(aux_counts[i].astype(aux_type.dtype), vma)
        return to_varying(count, vma)

    def pick(row):
        return lax.dynamic_index_in_dim(row, stage, 0, keepdims=False)

    def chunk_input(carry, i, c):
        first = (c == 0) & (stage == 0)
        return jnp.where(first, _microbatch(x, i), carry["inputs"][c, i % slots]), first

    def forward_slot(carry, mine, with_head):
        has_f = mine[_F_MB] >= 0
        i, c = jnp.maximum(mine[_F_MB], 0), jnp.maximum(mine[_F_C], 0)
        x_in, _ = chunk_input(carry, i, c)
        params = _take(stage_params, c)
        last = has_f & (c == v - 1) & (stage == p - 1)
        if forward_only:
            y, _, _ = call_stage(params, x_in)
            carry["out"] = _put(carry["out"], i, y, last, axis=1)
        elif stored_mode:
            plan = StageVJP(stage_fn, params, x_in, has_aux=stats)
            out, new_stored, *chunk_stats = plan.forward(params, x_in)
            y, aux = split(out)
            carry["stored"] = [
                _put_at(buf, c, i % slots, new, has_f)
                for buf, new in zip(carry["stored"], new_stored, strict=True)
            ]
        else:
            y, aux, *chunk_stats = call_stage(params, x_in)
        if stats and not forward_only:  # the chunk's statistics, summed over microbatches
            carry["stats"] = jax.tree.map(
                lambda acc, new: _put(acc, c, _take(acc, c) + new, has_f),
                carry["stats"],
                chunk_stats[0],
            )
        if with_aux:  # microbatch i's aux terms, weighted by its tokens
            term = aux_counts[i] * aux.astype(jnp.float32)
            carry["aux"] = jnp.where(has_f, carry["aux"] + term, carry["aux"])
        if with_head:
            tokens, token_weights = _microbatch(targets, i), _microbatch(weights, i)

            def head(y):
                (loss_sum, weight_sum), head_vjp = jax.vjp(
                    lambda hp, y: head_fn(hp, y, tokens, token_weights), head_params, y
                )
                d_head, d_y = head_vjp((jnp.ones_like(loss_sum), jnp.zeros_like(weight_sum)))
                return loss_sum, weight_sum, d_head, d_y.astype(y.dtype)

            if branches_may_hold_collectives(pipeline_axis):
                # Only the last stage runs the head; the others take zeros.
                types = jax.eval_shape(head, y)
                loss_sum, weight_sum, d_head, d_y = lax.cond(
                    stage == p - 1, head, lambda y: jax.tree.map(_zeros_like_typed, types), y
                )
            else:  # XLA:CPU with collectives in the stage: every stage, kept where `last`
                loss_sum, weight_sum, d_head, d_y = head(y)
            slot = i % slots
            carry["grads_in"] = _put2(carry["grads_in"], c, slot, d_y, last)
            carry["loss"] = jnp.where(last, carry["loss"] + loss_sum, carry["loss"])
            carry["weight"] = jnp.where(last, carry["weight"] + weight_sum, carry["weight"])
            carry["head_grads"] = jax.tree.map(
                lambda acc, g: jnp.where(last, acc + g, acc), carry["head_grads"], d_head
            )
        carry["from_prev"] = lax.ppermute(jnp.where(has_f, y, fill), pipeline_axis, perm_forward)
        return carry

    def backward_slot(carry, mine):
        has_b = mine[_B_MB] >= 0
        i, c = jnp.maximum(mine[_B_MB], 0), jnp.maximum(mine[_B_C], 0)
        slot = i % slots
        x_in, first = chunk_input(carry, i, c)
        params = _take(stage_params, c)
        cotangent = carry["grads_in"][c, slot]

        def stage_cotangent(out_type):
            y_type, aux_type = split(out_type)
            d_y = to_varying(cotangent, _varying_of(y_type))
            return (d_y, aux_cotangent(aux_type, i)) if aux_counts is not None else d_y

        if stored_mode:
            plan = StageVJP(stage_fn, params, x_in, has_aux=stats)
            leaves = [buffer[c, slot] for buffer in carry["stored"]]
            d_params, d_x = plan.backward(params, x_in, leaves, stage_cotangent(plan.output))
        else:
            out, vjp_fn, *_ = jax.vjp(stage_fn, params, x_in, has_aux=stats)
            d_params, d_x = vjp_fn(stage_cotangent(out))
        carry["stage_grads"] = jax.tree.map(
            lambda acc, g: _put(acc, c, _take(acc, c) + g, has_b), carry["stage_grads"], d_params
        )
        if input_gradient:
            carry["dx"] = _put(carry["dx"], i, d_x, has_b & first, axis=1)
        send = jnp.where(has_b, d_x, fill)
        carry["from_next"] = lax.ppermute(send, pipeline_axis, perm_backward)
        return carry

    def make_tick(mask):
        do_f, do_head, do_b = mask

        def tick(carry, row):
            mine = pick(row)
            carry = dict(carry)
            carry["inputs"] = _put2(
                carry["inputs"],
                mine[_FA_C],
                mine[_FA_SLOT],
                carry["from_prev"],
                mine[_FA_OK] == 1,
            )
            if not forward_only:
                carry["grads_in"] = _put2(
                    carry["grads_in"],
                    mine[_BA_C],
                    mine[_BA_SLOT],
                    carry["from_next"],
                    mine[_BA_OK] == 1,
                )
            if do_f:
                carry = forward_slot(carry, mine, do_head and not forward_only)
            if do_b and not forward_only:
                carry = backward_slot(carry, mine)
            return carry, None

        return tick

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
            stage_grads=jax.tree.map(jnp.zeros_like, stage_params),
            stored=[],
        )
        if input_gradient:
            carry["dx"] = jnp.zeros(x.shape, x.dtype)
        if with_aux:  # the stage's aux terms, sum over microbatches of count x aux
            carry["aux"] = jnp.zeros((), jnp.float32)
        if stored_mode:
            # Residuals vary over the pipeline too (each stage keeps its own microbatches').
            plan = StageVJP(stage_fn, _take(stage_params, 0), incoming, has_aux=stats)
            carry["stored"] = [
                to_varying(
                    jnp.full((v, slots, *r.shape), fill if _inexact(r) else 0, r.dtype),
                    _varying_of(r) | {pipeline_axis},
                )
                for r in plan.stored
            ]
        # The head's parameters are the same on every stage; made to vary over the pipeline
        # here, so that each tick's VJP does not sum the head gradients of every stage (the
        # transpose of the implicit cast), only the caller's final psum does.
        head_params = jax.tree.map(
            lambda a: to_varying(a, frozenset((pipeline_axis,))), head_params
        )
        carry["head_grads"] = jax.tree.map(jnp.zeros_like, head_params)
        if stats:  # per chunk: [v, L/(p v), ...], typed by the scan bodies
            chunk = jax.eval_shape(stage_fn, _take(stage_params, 0), incoming)[1]
            carry["stats"] = jax.tree.map(lambda a: jnp.zeros((v, *a.shape), a.dtype), chunk)
    rows = jnp.asarray(arrival_tables(table))
    plan = segments(table.active())
    masks = {mask for item in plan for mask in _masks(item)}
    ticks = {mask: make_tick(mask) for mask in masks}
    carry = _typed_carry([ticks[mask] for mask in sorted(masks)], carry, rows[0])
    for item in plan:
        if item[0] == "scan":
            _, mask, start, length = item
            carry, _ = lax.scan(ticks[mask], carry, rows[start : start + length])
            continue
        _, start, count, parts = item
        period = sum(length for _, _, length in parts)
        block = rows[start : start + count * period].reshape(count, period, *rows.shape[1:])

        def outer(carry, block_rows, parts=parts):
            for mask, offset, length in parts:
                carry, _ = lax.scan(ticks[mask], carry, block_rows[offset : offset + length])
            return carry, None

        carry, _ = lax.scan(outer, carry, block)
    if forward_only:
        return carry["out"]
    dx = carry["dx"] if input_gradient else None
    loss = carry["loss"]
    if with_aux:  # the aux terms, counted once per replica of the stage
        # (the caller sums the loss over every axis it varies over: the aux terms, the
        # same on every device of a stage, count on one)
        both = varying_axes(loss) | varying_axes(carry["aux"])
        aux = first_replica(to_varying(carry["aux"], both), both)
        loss = to_varying(loss, both) + aux
    stats_sums = carry["stats"] if stats else None
    return loss, carry["weight"], carry["stage_grads"], carry["head_grads"], dx, stats_sums


def _masks(item):
    if item[0] == "scan":
        return [item[1]]
    return [mask for mask, _, _ in item[3]]
