"""Gradient accumulation over microbatches, token-weighted, reduced once per step.

`accumulate(loss_fn, num_microbatches, mesh=...)(model, batch)` returns
`(loss, grads)` equal to those of the whole batch in one go, where `loss_fn`
returns `(sum_loss, num_tokens)` and the loss is `sum(sum_loss) /
sum(num_tokens)` over the whole batch (token weighting: microbatches or
shards with more real tokens weigh more; normalizing per microbatch, the
bug of transformers#34191, does not happen here).

The algorithm, one program:

1. ONE `jax.shard_map` over every axis of the mesh (a full-manual region,
   where `shardfuse.layers` run per shard). The batch is split over the
   batch axes (`batch_spec`, default `P((data, fsdp))`), each device splits
   its rows into `num_microbatches`, and a `lax.scan` runs them in turn.
2. Per microbatch, the gradient of the local `sum_loss` with respect to the
   local parameters, made "varying" over the batch axes first
   (`lax.pcast(..., to="varying")`): JAX then inserts no all-reduce, each
   device keeps its partial gradient (pytorch/xla#5760 is the bug of
   all-reducing every microbatch). Tensor-parallel reductions inside the
   layers are unchanged.
3. The partial gradients are summed in one float32 buffer per parameter,
   sharded like the gradients the stage asks for: zero 0/1 like the
   parameters; zero 2 over fsdp, each gradient reduce-scattered over fsdp
   inside the backward pass, as soon as it is produced: the parameters stay
   replicated for the forward, and the variable differentiated is a "sink"
   of the shard's shape, tied to the parameter by `fsdp.scatter_gradient`
   (identity forward, reduce-scatter transpose). A `Stack` ties each
   layer's slice inside its layer scan (its parameters' gradients are
   sharded after the layer axis, `zero.shard_spec(first_dim=1)`), so the
   largest gradient alive is one layer's (or a table's: the parameters
   outside a Stack are tied where the loss reads them, reduce-scattered
   once their whole gradient is done) beside the sharded buffer. With
   `scatter="step"`, a whole local buffer reduce-scattered once after the
   scan instead (the count of reductions that of one microbatch, for the
   memory of unsharded gradients while accumulating: PyTorch FSDP's
   `no_sync`); zero 3: the layers' gathers already reduce-scatter
   (`shardfuse.layers.fsdp`), and plain parameters sharded over fsdp (an
   embedding) are all-gathered on entry to each microbatch, with the same
   reduce-scatter backward; the replicated leaves (norm scales, biases) are
   tied as under zero 2.
4. After the scan, ONE reduction over the remaining batch axes (a psum over
   data, fsdp for unsharded buffers, sequence) and the division by the
   total token count. `sum_loss` and `num_tokens` are summed over exactly
   the axes they vary on (`jax.typeof(x)` vma), with the same multiplicity.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.sharding import entry_axes, is_spec, spec_axes
from shardfuse.kernels.vma import to_varying, varying_axes
from shardfuse.layers import fsdp as fsdp_lib
from shardfuse.parallel import zero as zero_lib
from shardfuse.parallel.pipeline.schedule import check_count

SCATTER_MODES = ("microbatch", "step")


def _scattered_dim(param_spec, grad_spec, ndim: int):
    """The dimension the gradient buffer is sharded on beyond the parameter (ZeRO-2), or None."""
    param = list(param_spec) + [None] * (ndim - len(param_spec))
    grad = list(grad_spec) + [None] * (ndim - len(grad_spec))
    for dim, (a, b) in enumerate(zip(param, grad, strict=True)):
        if entry_axes(a) != entry_axes(b):
            return dim
    return None


def _dim_or(param_spec, grad_spec, ndim: int) -> int:
    """`_scattered_dim`, -1 for None (a pytree leaf)."""
    dim = _scattered_dim(param_spec, grad_spec, ndim)
    return -1 if dim is None else dim


def _layer_param_ids(model) -> set:
    """ids of the `nnx.Param`s owned by shardfuse layers (they gather their own zero=3 shards)."""
    ids = set()
    for _, node in nnx.iter_graph(model):
        # the layers holding their own ZeRO settings (linear, attention, norm) gather their shards
        if isinstance(getattr(node, "zero", None), fsdp_lib.ZeroOptions):
            for _, variable in nnx.iter_graph(node):
                if isinstance(variable, nnx.Variable):
                    ids.add(id(variable))
    return ids


def _plain_gather_dims(model, state, mesh, fsdp_axis):
    """Per parameter: the dimension a plain (non-layer) parameter is fsdp-sharded on, or -1."""
    layer_ids = _layer_param_ids(model)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))

    def dim_of(path, variable):
        if fsdp_axis is None or id(params.get(path)) in layer_ids:
            return -1
        spec = variable.get_metadata().get("out_sharding") or P()
        for dim, entry in enumerate(spec):
            if fsdp_axis in entry_axes(entry):
                if entry_axes(entry) != (fsdp_axis,):
                    raise NotImplementedError(
                        f"parameter {'.'.join(map(str, path))} has spec {spec}: accumulate "
                        f"gathers plain parameters sharded over {fsdp_axis!r} alone on a dimension"
                    )
                return dim
        return -1

    flat = nnx.to_flat_state(state)
    dims = {path: dim_of(path, variable) for path, variable in flat}
    return nnx.as_pure(nnx.from_flat_state([(p, nnx.Param(d)) for p, d in dims.items()]))


def check_batch(batch, batch_specs, mesh, num_microbatches: int):
    """ValueError unless every batch leaf's leading size divides into microbatches per shard."""
    leaves = jax.tree.leaves(batch)
    specs = jax.tree.leaves(batch_specs, is_leaf=is_spec)
    if not leaves:
        raise ValueError("batch is empty: accumulate needs at least one array")
    for x, spec in zip(leaves, specs, strict=True):
        shards = 1
        for name in entry_axes(spec[0] if len(spec) else None):
            shards *= mesh.shape[name]
        size = x.shape[0] if x.ndim else 0
        if size == 0 or size % (shards * num_microbatches):
            raise ValueError(
                f"the batch size {size} (a batch array of shape {tuple(x.shape)}) must be a "
                f"positive multiple of num_microbatches={num_microbatches} x {shards} batch "
                f"shards (spec {spec})"
            )


def accumulate(
    loss_fn,
    num_microbatches: int = 1,
    *,
    mesh,
    zero=0,
    fsdp_axis: str | None = axes.FSDP,
    data_axis: str | None = axes.DATA,
    batch_spec=None,
    reduce_dtype=jnp.float32,
    wrt=nnx.Param,
    scatter: str = "microbatch",
    has_aux: bool = False,
):
    """`fn(model, batch) -> (loss, grads)`: token-weighted gradients over microbatches.

    `loss_fn(model, microbatch) -> (sum_loss, num_tokens)` runs per shard,
    inside one `jax.shard_map` over every axis of `mesh`: `model`'s
    parameters are this device's shards (`shardfuse.layers` run per shard
    there; a plain module sees its parameter shards, replicated ones whole)
    and `microbatch` is this device's part of one microbatch. It returns the
    sum of the per-token losses and the number of tokens counted (e.g. a
    padding mask's sum). The result: `loss = total sum_loss / total tokens`
    and `grads` (an `nnx.State` of `wrt` variables, float32) its gradients,
    summed over microbatches in one float32 buffer and reduced over the batch
    axes once per call (see the module docstring for the algorithm).

    Args:
      loss_fn: per-shard `(model, microbatch) -> (sum_loss, num_tokens)`.
      num_microbatches: M >= 1; each device's batch rows split into M.
      mesh: the mesh of the model.
      zero: ZeRO stage 0 to 3 (`shardfuse.parallel.zero`): the gradients
        come out sharded like the parameters (0, 1, 3) or over fsdp (2, 3); or
        the run's `shardfuse.layers.fsdp.ZeroOptions`, resolved on the mesh
        already (then `fsdp_axis` is not read).
      fsdp_axis: the ZeRO axis (default "fsdp"; ignored when the mesh lacks it).
      data_axis: the data-parallel axis (default "data"; ignored when absent).
      batch_spec: PartitionSpec of the batch arrays (one for all, or a pytree
        matching the batch); default `P((data_axis, fsdp_axis))`, the batch
        dimension over the data-parallel axes. Add the sequence axis on the
        second dimension for context parallelism, e.g. `P(("data", "fsdp"), "sequence")`.
      reduce_dtype: dtype of the accumulation buffer and the reductions (float32).
      wrt: the variables differentiated (default `nnx.Param`).
      scatter: ZeRO-2's reduce-scatter over fsdp: "microbatch" (default: each
        gradient, a `Stack`'s per layer, reduce-scattered inside the backward
        pass into a buffer sharded over fsdp, every microbatch) or "step" (a
        whole local float32 buffer, reduce-scattered once per call: as many
        reductions as one microbatch, unsharded gradient memory meanwhile).
        Other stages ignore it, except zero=3, whose layers reduce-scatter in
        their backward: "step" raises there.
      has_aux: `loss_fn` returns `((sum_loss, num_tokens), aux)`, `aux` a pytree of
        arrays the same on every device (e.g. a MoE model's `MoEStats`, already
        summed over the batch axes by the layers; a value varying over an axis is
        averaged over it); `fn` then returns `(loss, grads, aux)`, `aux` combined over
        the microbatches: floating leaves averaged, integer leaves (counts) summed.

    Returns:
      `fn(model, batch) -> (loss, grads)` (or `(loss, grads, aux)` with `has_aux`);
      call it inside `nnx.jit` (it is traceable) or eagerly.

    Raises:
      ValueError: `num_microbatches` < 1, `zero` not in 0..3, an axis not in
        the mesh, or (at call time) a batch size that does not divide into
        `num_microbatches` per shard.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from shardfuse.layers import ParallelMLP
      >>> from shardfuse.parallel.accumulate import accumulate
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> mlp = ParallelMLP(8, 16, mesh=mesh, rngs=nnx.Rngs(0))
      >>> def loss_fn(model, batch):
      ...     y = model(batch["x"])
      ...     return jnp.sum(batch["mask"] * jnp.sum(y * y, -1)), jnp.sum(batch["mask"])
      >>> batch = dict(x=jnp.ones((8, 4, 8)), mask=jnp.ones((8, 4)))
      >>> loss, grads = accumulate(loss_fn, 2, mesh=mesh)(mlp, batch)
      >>> grads["up"]["kernel"][...].shape
      (8, 16)
    """
    num_microbatches = check_count("num_microbatches", num_microbatches)
    resolved = fsdp_lib.zero_options(mesh, zero=zero, fsdp_axis=fsdp_axis)
    zero, fsdp_axis = resolved.stage, resolved.fsdp_axis
    if scatter not in SCATTER_MODES:
        raise ValueError(f"scatter={scatter!r} must be one of {SCATTER_MODES}")
    if scatter == "step" and zero == 3:
        raise ValueError(
            "scatter='step' needs zero <= 2: under zero=3 the layers reduce-scatter each "
            "weight's gradient in their backward, once per microbatch"
        )
    if data_axis is not None and data_axis not in mesh.axis_names:
        if data_axis != axes.DATA:
            raise ValueError(
                f"data_axis={data_axis!r} is not an axis of the mesh; its axes are "
                f"{tuple(mesh.axis_names)}"
            )
        data_axis = None
    batch_axes = fsdp_lib.batch_axes(data_axis, fsdp_axis)
    default_spec = P(batch_axes)
    reduce_dtype = jnp.dtype(reduce_dtype)

    def run(model, batch):
        specs_in = batch_spec if batch_spec is not None else default_spec
        batch_specs = (
            jax.tree.map(lambda _: specs_in, batch) if isinstance(specs_in, P) else specs_in
        )
        check_batch(batch, batch_specs, mesh, num_microbatches)
        graphdef, params, rest = nnx.split(model, wrt, ...)
        param_specs = zero_lib.param_specs(params)
        grad_specs = zero_lib.sharded_specs(params, mesh, resolved, stage=2)
        rest_specs = zero_lib.param_specs(rest)
        gather_dims = _plain_gather_dims(model, params, mesh, fsdp_axis if zero == 3 else None)
        reduce_axes = set()
        for spec in jax.tree.leaves(batch_specs, is_leaf=is_spec):
            reduce_axes |= set(spec_axes(spec))
        body = functools.partial(
            _per_shard,
            loss_fn=loss_fn,
            graphdef=graphdef,
            num_microbatches=num_microbatches,
            reduce_axes=frozenset(reduce_axes),
            param_specs=param_specs,
            grad_specs=grad_specs,
            gather_dims=gather_dims,
            fsdp_axis=fsdp_axis,
            reduce_dtype=reduce_dtype,
            scatter_once=scatter == "step",
            has_aux=has_aux,
        )
        in_specs = (param_specs, rest_specs, batch_specs)
        args = zero_lib.put((nnx.as_pure(params), nnx.as_pure(rest), batch), in_specs, mesh)
        out_specs = (P(), grad_specs, P()) if has_aux else (P(), grad_specs)
        out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
        grads = nnx.State(_restore(params, out[1]))
        return (out[0], grads, out[2]) if has_aux else (out[0], grads)

    return run


def _aval_axes(aval) -> frozenset:
    """The manual axes an abstract value varies over (jax 0.10 and 0.11 spellings)."""
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def _restore(params, grads):
    """`grads` (pure) as an `nnx.State` of the same variable types as `params`."""
    flat = []
    for (path, variable), (_, value) in zip(
        nnx.to_flat_state(params), nnx.to_flat_state(nnx.State(grads)), strict=True
    ):
        flat.append((path, variable.replace(value)))
    return nnx.from_flat_state(flat)


def _per_shard(
    params,
    rest,
    batch,
    *,
    loss_fn,
    graphdef,
    num_microbatches,
    reduce_axes,
    param_specs,
    grad_specs,
    gather_dims,
    fsdp_axis,
    reduce_dtype,
    scatter_once=False,
    has_aux=False,
):
    """The body of the full-manual region: scan over microbatches, then one reduction."""
    m = num_microbatches
    micro = jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch)

    def vary(x, spec):  # partial gradients per device: no reduction over the batch axes
        return to_varying(x, frozenset(reduce_axes - set(spec_axes(spec))) | varying_axes(x))

    def gather(x, dim):  # a plain parameter sharded over fsdp: gathered on entry (ZeRO-3)
        if dim < 0:
            return x
        options = fsdp_lib.ZeroOptions(3, fsdp_axis, True, reduce_dtype)
        return fsdp_lib.gather(options, x, dim, x.dtype)

    def scatter(g, param_spec, grad_spec):  # ZeRO-2: reduce-scatter into the sharded buffer
        dim = _scattered_dim(param_spec, grad_spec, g.ndim)
        if dim is None:
            return g
        return lax.psum_scatter(g, fsdp_axis, scatter_dimension=dim, tiled=True)

    # ZeRO-2 (and zero=3's replicated leaves): the dimension each gradient is
    # reduce-scattered on inside the backward pass (-1: none, or scatter="step").
    scatter_dims = jax.tree.map(
        lambda ps, gs, x: -1 if scatter_once else _dim_or(ps, gs, x.ndim),
        param_specs,
        grad_specs,
        params,
        is_leaf=is_spec,
    )

    def sink(full, dim):  # the differentiated variable of a scattered leaf: the shard's shape
        if dim < 0:
            return full
        shape = list(full.shape)
        shape[dim] //= lax.axis_size(fsdp_axis)
        return to_varying(jnp.zeros(shape, reduce_dtype), varying_axes(full))

    def micro_grads(params, mb):
        # Tie the parameters to this microbatch: XLA may then not hoist the zero=3
        # gathers out of the loop (which would keep every gathered weight alive).
        params_now, mb = lax.optimization_barrier((params, mb))
        fulls = jax.tree.map(vary, params_now, param_specs, is_leaf=None)

        def loss(diff):
            scatters = {}  # id of the value the model holds -> its GradientScatter

            def tie(d, full, dim):
                if dim < 0:
                    return d
                tied = fsdp_lib.scatter_gradient(full, d, fsdp_axis, dim)
                scatters[id(tied)] = fsdp_lib.GradientScatter(full, d, fsdp_axis, dim)
                return tied

            p = jax.tree.map(tie, diff, fulls, scatter_dims)
            p = jax.tree.map(gather, p, gather_dims)
            with fsdp_lib.scattering_gradients(scatters):
                out = loss_fn(nnx.merge(graphdef, p, rest), mb)
            (s, n), aux = out if has_aux else (out, None)
            return s, (n, jax.lax.stop_gradient(aux))

        diff = jax.tree.map(sink, fulls, scatter_dims)
        (s, (n, aux)), g = jax.value_and_grad(loss, has_aux=True)(diff)
        g = jax.tree.map(lambda x: x.astype(reduce_dtype), g)
        return g, s.astype(reduce_dtype), n.astype(reduce_dtype), aux

    def microstep(acc, mb):
        g, s, n, aux = micro_grads(params, mb)
        return jax.tree.map(lambda a, x: a + x, acc, g), (s, n, aux)

    # The buffer's type (shape, and the axes it varies over) is that of one microbatch's
    # gradients: traced abstractly here, never computed.
    first = jax.tree.map(lambda x: x[0], micro)
    avals = jax.make_jaxpr(micro_grads)(params, first).out_avals
    grad_tree = jax.tree.structure(params)
    acc = jax.tree.unflatten(
        grad_tree,
        [
            to_varying(jnp.zeros(a.shape, a.dtype), _aval_axes(a))
            for a in avals[: grad_tree.num_leaves]
        ],
    )
    acc, (sums, counts, auxes) = lax.scan(microstep, acc, micro)
    if scatter_once:  # ZeRO-2, scatter="step": the whole local sum, reduce-scattered once
        acc = jax.tree.map(scatter, acc, param_specs, grad_specs, is_leaf=None)
    s, n = jnp.sum(sums), jnp.sum(counts)
    loss_axes = varying_axes(s)
    n = to_varying(n, loss_axes)
    total_s = lax.psum(s, tuple(sorted(loss_axes))) if loss_axes else s
    count_axes = varying_axes(n)
    total_n = lax.psum(n, tuple(sorted(count_axes))) if count_axes else n

    def finish(g, grad_spec):
        axes = tuple(sorted(varying_axes(g) - set(spec_axes(grad_spec))))
        g = lax.psum(g, axes) if axes else g
        return g / total_n

    grads = jax.tree.map(finish, acc, grad_specs, is_leaf=None)
    if has_aux:
        return total_s / total_n, grads, jax.tree.map(_combine_aux, auxes)
    return total_s / total_n, grads


def _combine_aux(values):
    """`[M, ...]` per-microbatch aux values -> one: floats averaged, integers summed, then
    averaged over any axis they still vary over (so that `P()` describes them)."""
    if jnp.issubdtype(values.dtype, jnp.integer):
        value = jnp.sum(values, axis=0)
    else:
        value = jnp.mean(values, axis=0)
    axes = tuple(sorted(varying_axes(value)))
    if not axes:
        return value
    if jnp.issubdtype(value.dtype, jnp.integer):
        return lax.pmax(value, axes)
    return lax.pmean(value, axes)
