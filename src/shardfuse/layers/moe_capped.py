"""The CPU's capped expert-parallel segment of `sf.layers.ParallelMoE`: routed rows through
the dense dispatch in chunks of `expert_dispatch.dense_chunk` rows a destination, the fused
SwiGLU experts (`native_cpu.swiglu_experts_forward` / `_backward`) and the combine, with
the full-size dispatch where the routing overflows the chunks, in one custom VJP."""

import functools

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from shardfuse.collectives import expert_dispatch
from shardfuse.kernels.grouped_matmul import native_cpu as native_cpu_gmm


def _capped_forward(rows, sorted_e, gate_up, down, *, num_experts, axis_name, chunk):
    """The dense dispatch of `chunk` rows a destination, the fused SwiGLU experts on the
    receive buffer and the combine: `(y [A, F], residuals)`."""
    ep = lax.axis_size(axis_name)
    with jax.named_scope("dispatch"):
        received, received_e, plan = expert_dispatch.dispatch(
            rows, sorted_e, num_experts=num_experts, axis_name=axis_name,
            implementation="dense", chunk=chunk,
        )  # fmt: skip
    with jax.named_scope("experts"):
        local = received_e - lax.axis_index(axis_name) * (num_experts // ep)
        y_received, h = native_cpu_gmm.swiglu_experts_forward(received, local, gate_up, down)
    with jax.named_scope("combine"):
        y = expert_dispatch.combine(y_received, plan, axis_name=axis_name, implementation="dense")
    return y, (received, local, h, plan["flat"], plan["dest"])


def _capped_backward(saved, gate_up, down, dy, *, axis_name, chunk):
    """`_capped_forward`'s VJP from its residuals: `(d_rows, d_gate_up, d_down)`, the
    combine's transpose and the dispatch's (each one all-to-all) around the fused
    experts' backward."""
    received, local, h, flat, dest = saved
    plan = dict(flat=flat, dest=dest, chunk=chunk)
    with jax.named_scope("combine"):  # the scopes of what each part transposes
        dy_received = expert_dispatch.combine_transpose(dy, plan, axis_name=axis_name)
    with jax.named_scope("experts"):
        d_received, d_gate_up, d_down = native_cpu_gmm.swiglu_experts_backward(
            received, local, gate_up, down, h, dy_received
        )
    with jax.named_scope("dispatch"):
        d_rows = expert_dispatch.combine(d_received, plan, axis_name=axis_name,
                                         implementation="dense")  # fmt: skip
    return d_rows, d_gate_up, d_down


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def capped_expert_parallel(rows, sorted_e, gate_up, down, overflow, num_experts, axis_name,
                           chunk):  # fmt: skip
    """Routed rows through their experts' devices and back on the CPU (per shard, inside
    `shard_map`): the dense dispatch of `chunk` rows a destination
    (`expert_dispatch.dense_chunk`), the fused SwiGLU experts
    (`native_cpu.swiglu_experts_forward`) and the combine, forward and backward; where
    `overflow` (int32, the same on every device of the expert axis) is nonzero, some
    destination gets more rows than `chunk`, and the full-size dispatch runs instead, its
    backward recomputing its forward. The same result either way (dropless).

    The receive buffers, the experts' saved up projection and the four all-to-alls hold
    and move `EP x chunk` rows instead of `EP x A`: half of them at `EP = 4`. A custom VJP
    around `lax.cond` so that the backward keeps only the capped path's residuals (JAX's
    own VJP of a `cond` keeps both branches', zeros for the branch not taken).

    Args:
      rows: `[A, F]` this device's routed rows sorted by expert (`sort_slots`).
      sorted_e: `[A]` int32 their experts, `num_experts` for a dropped row.
      gate_up, down: this device's experts `[E / EP, F, 2H]`, `[E / EP, H, F]`.
      overflow: int32 scalar, nonzero where the capped dispatch would leave rows behind.
      num_experts: E.
      axis_name: the expert axis, of size EP.
      chunk: rows per destination of the capped dispatch.

    Returns:
      `[A, F]`: each row's expert output (zero for dropped rows).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from shardfuse.collectives import expert_dispatch
      >>> from shardfuse.layers.moe_capped import capped_expert_parallel
      >>> mesh = jax.make_mesh((4,), ("expert",), devices=jax.devices()[:4],
      ...                      axis_types=(jax.sharding.AxisType.Auto,))
      >>> rows, e = jnp.ones((4 * 8, 4)), jnp.tile(jnp.arange(8, dtype=jnp.int32), 4)
      >>> def f(rows, e, gate_up, down):
      ...     chunk = expert_dispatch.dense_chunk(8, 4)  # 4 rows a destination, of 8
      ...     over = expert_dispatch.overflows(e, num_experts=8, ep=4, chunk=chunk)
      ...     return capped_expert_parallel(rows, e, gate_up, down, over, 8, "expert", chunk)
      >>> y = jax.shard_map(f, mesh=mesh, in_specs=(P("expert"), P("expert"), P("expert"),
      ...                   P("expert")), out_specs=P("expert"))(
      ...     rows, e, jnp.ones((8, 4, 6)), jnp.ones((8, 3, 4)))
      >>> round(float(y[0, 0]), 2)  # 3 x silu(4) x 4
      47.14
    """
    return _capped_expert_parallel_fwd(
        rows, sorted_e, gate_up, down, overflow, num_experts, axis_name, chunk
    )[0]


def _capped_expert_parallel_fwd(rows, sorted_e, gate_up, down, overflow, num_experts,
                                axis_name, chunk):  # fmt: skip
    kw = dict(num_experts=num_experts, axis_name=axis_name)
    n = lax.axis_size(axis_name) * chunk

    def capped():
        return _capped_forward(rows, sorted_e, gate_up, down, chunk=chunk, **kw)

    def full():  # its residuals are not kept: the backward recomputes them
        y, (received, local, h, flat, dest) = _capped_forward(
            rows, sorted_e, gate_up, down, chunk=rows.shape[0], **kw
        )
        return y, (received[:n], local[:n], h[:n], flat, dest)

    y, (received, local, h, flat, dest) = lax.cond(overflow > 0, full, capped)
    # Named as the unfused path names them, for remat policies.
    saved = (checkpoint_name(received, "moe_dispatch"), local, checkpoint_name(h, "moe_up"),
             flat, dest)  # fmt: skip
    return y, (rows, sorted_e, gate_up, down, overflow, saved)


def _capped_expert_parallel_bwd(num_experts, axis_name, chunk, residuals, dy):
    rows, sorted_e, gate_up, down, overflow, saved = residuals

    def capped():
        return _capped_backward(saved, gate_up, down, dy, axis_name=axis_name, chunk=chunk)

    def full():
        A = rows.shape[0]
        _, again = _capped_forward(rows, sorted_e, gate_up, down, num_experts=num_experts,
                                   axis_name=axis_name, chunk=A)  # fmt: skip
        return _capped_backward(again, gate_up, down, dy, axis_name=axis_name, chunk=A)

    d_rows, d_gate_up, d_down = lax.cond(overflow > 0, full, capped)
    return d_rows, None, d_gate_up, d_down, None


capped_expert_parallel.defvjp(_capped_expert_parallel_fwd, _capped_expert_parallel_bwd)


__all__ = ["capped_expert_parallel"]
