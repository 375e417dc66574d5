"""The pipelined programs behind `Pipeline`: stage layout, the shard_map, the custom_vjp.

`_run` lays the stacked parameters out by stage (`[L, ...]` ->
`[p, v, L/(p v), ...]`, pipeline-sharded; for v = 1 no parameter moves),
splits the batch into microbatches (microbatch i = rows i, i + m, ...), runs
`executor.run_schedule` inside one `jax.shard_map` over every mesh axis
(with every axis Auto: `run_on_mesh`), reduces what the stages hold
(loss and token count over every axis they vary over, head and input
gradients over the pipeline axis) and divides by the token count.
A MoE stack's `MoEStats` stay out of the carried state (`pure_without_stats`:
outputs, not inputs); each stage returns its layers' aux term per microbatch
(weighted by the microbatch's token count, `_microbatch_counts`) and, training, their
statistics, averaged over the microbatches.
`pipelined_loss` is the `jax.custom_vjp` of `Pipeline.loss`; its forward
rule sees which arguments are differentiated (`symbolic_zeros`) and asks the
executor for the input gradient, a buffer of the batch's size, only when the
input is (e.g. an embedding before the pipeline), so that a step that does
not differentiate the input holds nothing that grows with m.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.sharding import run_on_mesh, spec_axes
from shardfuse.kernels.vma import varying_axes
from shardfuse.layers.moe import MoEStats, stats_aux_loss
from shardfuse.parallel.pipeline import executor
from shardfuse.parallel.pipeline.lockstep import lockstep_table


def pure(module):
    graphdef, state = nnx.split(module)
    return graphdef, jax.tree.map(
        lambda v: v[...], state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )


def pure_without_stats(blocks):
    """`(graphdef, values, specs, stats_template)` of a stack's blocks, `MoEStats` apart.

    The pipeline carries `values` (pure) and `specs` (PartitionSpecs), the blocks'
    state without their `MoEStats` (outputs of a call, not inputs: nothing to
    differentiate, integer counts among them). `stats_template` is hashable: one
    `(path, per-layer shape, dtype)` per `MoEStats` leaf, from which a stage rebuilds
    zero statistics for `nnx.merge` (`with_stats`); empty without a `ParallelMoE`.
    """
    graphdef = nnx.graphdef(blocks)
    rest = nnx.state(blocks, nnx.Not(MoEStats))
    values = jax.tree.map(lambda v: v[...], rest, is_leaf=lambda v: isinstance(v, nnx.Variable))
    specs = spec_tree(nnx.get_partition_spec(rest))
    template = tuple(
        (tuple(path), tuple(v[...].shape[1:]), jnp.dtype(v[...].dtype))
        for path, v in nnx.to_flat_state(nnx.state(blocks, MoEStats))
    )
    return graphdef, values, specs, template


def with_stats(values, template):
    """`values` (layer rows `[n, ...]`) and zero `MoEStats` rows of `template`: the full state."""
    if not template:
        return values
    rows = jax.tree.leaves(values)[0].shape[0]
    stats = nnx.from_flat_state(
        [(path, jnp.zeros((rows, *shape), dtype)) for path, shape, dtype in template]
    )
    return nnx.merge_state(values, stats)


def spec_tree(specs):
    """A pytree of PartitionSpecs (P() where none is set) from `nnx.get_partition_spec`."""

    def spec(v):
        value = v.get_value() if isinstance(v, nnx.Variable) else v
        return value if isinstance(value, P) else P()

    return jax.tree.map(spec, specs, is_leaf=lambda v: isinstance(v, nnx.Variable | P) or v is None)


class Config:
    """Static settings of one pipelined program, hashable: the `jax.jit` cache key.

    Pytrees of PartitionSpecs count by value (so that repeated eager calls
    reuse the compiled program); other unhashable fields by identity.
    """

    def __init__(self, **fields):
        fields.setdefault("head_graphdef", None)
        fields.setdefault("head_specs", None)
        fields.setdefault("loss_fn", None)
        fields.setdefault("targets_spec", None)
        fields.setdefault("residuals", "recompute")
        fields.setdefault("input_gradient", True)
        fields.setdefault("stats_template", ())
        fields.setdefault("aux_coefs", None)
        self.__dict__.update(fields)
        self._fields = fields
        self._key = tuple((k, _frozen(v)) for k, v in sorted(fields.items()))

    def replace(self, **changes):
        return Config(**{**self._fields, **changes})

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Config) and self._key == other._key


def _hashable(value):
    try:
        hash(value)
        return True
    except TypeError:
        return False


def _frozen(value):
    """`value` if hashable; a pytree of specs as (treedef, leaves); else its id."""
    if _hashable(value):
        return value
    leaves, treedef = jax.tree.flatten(value, is_leaf=lambda x: isinstance(x, P))
    if all(isinstance(leaf, P) for leaf in leaves):
        return (treedef, tuple(leaves))
    return id(value)


def _to_stages(config, tree, specs):
    """Stacked `[L, ...]` leaves -> `[p, v, L/(p v), ...]`, pipeline-sharded on axis 0."""
    p, v = config.p, config.v

    def reorder(a, spec):
        local = a.reshape(v, p, a.shape[0] // (p * v), *a.shape[1:]).swapaxes(0, 1)
        return local, P(config.pipeline_axis, None, None, *tuple(spec)[1:])

    pairs = jax.tree.map(reorder, tree, specs)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)  # noqa: E731
    return (
        jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair),
        jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair),
    )


def _from_stages(config, tree):
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[3:]), tree)


def _microbatches(x, m):
    """`[B, ...]` -> `[B/m, m, ...]`, microbatch i = `[:, i]` = rows i, i + m, ...

    A reshape, not a transpose: no copy of the batch (a `[m, B/m, ...]` layout
    would materialize one, temp memory that grows with m at fixed microbatch size).
    """
    return x.reshape(x.shape[0] // m, m, *x.shape[1:])


def _microbatch_spec(spec):
    """The spec of `_microbatches`' result from that of the batch: the batch axes stay on dim 0."""
    entries = tuple(spec)
    return P(entries[0] if entries else None, None, *entries[1:])


def _unmicrobatch(x):
    return x.reshape(-1, *x.shape[2:])


def _constrain(tree, mesh, specs):
    return jax.tree.map(
        lambda a, s: lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, s)),
        tree,
        specs,
    )


def _stage_fn(config, collect_stats=False):
    """`stage(chunk_values, x)`: `y`, or `(y, aux)` with `config.aux_coefs` (the chunk's
    MoE aux losses on this microbatch, `stats_aux_loss` of its layers' statistics);
    with `collect_stats`, `(that, stats)`: the layers' `MoEStats` rows, a tuple in
    `config.stats_template`'s order (`executor.run_schedule(stats=True)`)."""

    def stage(chunk_values, x):
        y, stats = config.apply_layers(with_stats(chunk_values, config.stats_template), x)
        out = y if config.aux_coefs is None else (y, stats_aux_loss(stats, *config.aux_coefs))
        if not collect_stats:
            return out
        flat = dict(nnx.to_flat_state(stats))
        rows = tuple(
            jnp.asarray(flat[path][...] if isinstance(flat[path], nnx.Variable) else flat[path])
            for path, _, _ in config.stats_template
        )
        return out, rows

    return stage


def _stats_of_microbatches(sums, m, pipeline_axis):
    """Per shard: the chunks' `MoEStats` sums over the m microbatches -> floats averaged,
    counts summed (as `accumulate`'s aux), the same on every device of a stage."""

    def combine(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            a = a / m
        others = tuple(sorted(varying_axes(a) - {pipeline_axis}))
        if others:  # (the same value on every device of the stage)
            a = (
                lax.pmean(a, others)
                if jnp.issubdtype(a.dtype, jnp.floating)
                else lax.pmax(a, others)
            )
        return a[None]

    return tuple(combine(a) for a in sums)


def _microbatch_counts(weights):
    """float32 `[m]`: each microbatch's token weight over the whole batch (per shard:
    `weights` `[b, m, ...]`, summed over the axes the shards split it over)."""
    w = weights.astype(jnp.float32)
    counts = jnp.sum(w, axis=tuple(d for d in range(w.ndim) if d != 1))
    split = tuple(sorted(varying_axes(counts)))
    return lax.psum(counts, split) if split else counts


def _run(config, forward_only, stack_values, head_values, x, targets, weights):
    """The pipelined program (traced under jit): outputs for forward-only or training."""
    table = lockstep_table(config.schedule, config.p, config.m, config.v, forward_only=forward_only)
    x_spec = _microbatch_spec(config.io_spec)
    dx_spec = x_spec if config.input_gradient else None
    # training: the layers' MoEStats come out too (`[L, ...]` rows, averaged over microbatches)
    collect_stats = bool(config.stats_template) and not forward_only
    stats_specs = tuple(P(config.pipeline_axis) for _ in config.stats_template if collect_stats)

    def program(mesh, stack_values, head_values, x, targets, weights):
        stages, stage_specs = _to_stages(config, stack_values, config.layer_specs)
        stages = _constrain(stages, mesh, stage_specs)
        x = _constrain(_microbatches(x, config.m), mesh, x_spec)
        t_spec = _microbatch_spec(config.targets_spec) if config.targets_spec is not None else P()
        in_specs = [stage_specs, x_spec]
        args = [stages, x]
        if not forward_only:
            targets = _constrain(_microbatches(targets, config.m), mesh, t_spec)
            weights = _constrain(_microbatches(weights, config.m), mesh, t_spec)
            in_specs += [config.head_specs, t_spec, t_spec]
            args += [head_values, targets, weights]

        def body(stages, x, head_values=None, targets=None, weights=None):
            stages = jax.tree.map(lambda a: a[0], stages)
            head_fn = None if forward_only else _head_fn(config)
            with_aux = config.aux_coefs is not None
            aux_counts = _microbatch_counts(weights) if with_aux and not forward_only else None
            if with_aux and forward_only:  # the forward: the outputs alone
                config_y = config.replace(aux_coefs=None)
            else:
                config_y = config
            result = executor.run_schedule(
                table,
                stage_fn=_stage_fn(config_y, collect_stats),
                head_fn=head_fn,
                pipeline_axis=config.pipeline_axis,
                stage_params=stages,
                head_params=head_values,
                x=x,
                targets=targets,
                weights=weights,
                poison=config.poison,
                residuals=config.residuals,
                input_gradient=config.input_gradient,
                aux_counts=aux_counts,
                stats=collect_stats,
            )
            if forward_only:
                return lax.psum(result, config.pipeline_axis)
            loss_sum, weight_sum, stage_grads, head_grads, dx, stats_sums = result
            loss_sum = lax.psum(loss_sum, tuple(sorted(varying_axes(loss_sum))))
            weight_sum = lax.psum(weight_sum, tuple(sorted(varying_axes(weight_sum))))
            head_grads = jax.tree.map(lambda g: lax.psum(g, config.pipeline_axis), head_grads)
            if dx is not None:
                dx = lax.psum(dx, config.pipeline_axis)
            stage_grads = jax.tree.map(lambda g: g[None], stage_grads)
            stats = ()
            if collect_stats:
                stats = _stats_of_microbatches(stats_sums, config.m, config.pipeline_axis)
            return loss_sum, weight_sum, stage_grads, head_grads, dx, stats

        body_specs = (
            x_spec
            if forward_only
            else (P(), P(), stage_specs, config.head_specs, dx_spec, stats_specs)
        )
        outputs = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=body_specs)(
            *args
        )
        if forward_only:
            return _unmicrobatch(outputs)
        loss_sum, weight_sum, stage_grads, head_grads, dx, stats = outputs
        scale = 1.0 / weight_sum
        stage_grads = jax.tree.map(
            lambda g: (g * scale).astype(g.dtype), _from_stages(config, stage_grads)
        )
        head_grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), head_grads)
        if dx is not None:
            dx = (_unmicrobatch(dx) * scale).astype(dx.dtype)
        return loss_sum * scale, stage_grads, head_grads, dx, _from_stages(config, stats)

    final_specs = (
        P(*config.io_spec)
        if forward_only
        else (
            P(),
            config.layer_specs,
            config.head_specs,
            P(*config.io_spec) if config.input_gradient else None,
            tuple(P(config.pipeline_axis) for _ in stats_specs),
        )
    )
    return run_on_mesh(program, config.mesh, final_specs)(
        stack_values, head_values, x, targets, weights
    )


def _head_fn(config):
    """`head_fn(head_values, y, targets, weights) -> (loss_sum, weight_sum)` per shard.

    Only the first device along the mesh axes the targets are not split over
    counts (the others hold copies of the same tokens' loss).
    """
    token_axes = set(spec_axes(config.targets_spec))
    replica_axes = [
        a for a in config.mesh.axis_names if a != config.pipeline_axis and a not in token_axes
    ]

    def head_fn(head_values, y, targets, weights):
        head = nnx.merge(config.head_graphdef, head_values)
        loss_sum, weight_sum = config.loss_fn(head(y), targets, weights)
        first = jnp.asarray(True)
        for axis in replica_axes:
            first = first & (lax.axis_index(axis) == 0)
        zero = jnp.zeros((), jnp.float32)
        return (
            jnp.where(first, loss_sum.astype(jnp.float32), zero),
            jnp.where(first, weight_sum.astype(jnp.float32), zero),
        )

    return head_fn


@functools.partial(jax.jit, static_argnums=(0,))
def forward_program(config, stack_values, x):
    return _run(config, True, stack_values, None, x, None, None)


@functools.partial(jax.jit, static_argnums=(0,))
def _train_program(config, stack_values, head_values, x, targets, weights):
    return _run(config, False, stack_values, head_values, x, targets, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def pipelined_loss(config, stack_values, head_values, x, targets, weights):
    """`(loss, stats)`: `stats` the layers' `MoEStats` rows (a tuple in
    `config.stats_template`'s order, empty without MoE blocks), not differentiated."""
    # Undifferentiated: nothing asks for the input gradient.
    config = config.replace(input_gradient=False)
    out = _train_program(config, stack_values, head_values, x, targets, weights)
    return out[0], out[4]


def _fwd(config, stack_values, head_values, x, targets, weights):
    # symbolic_zeros: every leaf is a CustomVJPPrimal(value, perturbed). `x` is perturbed
    # when the caller differentiates through it (an embedding before the pipeline); only
    # then does the executor keep the input gradient, `[B, T, F]`.
    config = config.replace(input_gradient=x.perturbed)
    stack_values, head_values, x, targets, weights = custom_vjp_primal_tree_values(
        (stack_values, head_values, x, targets, weights)
    )
    loss, stage_grads, head_grads, dx, stats = _train_program(
        config, stack_values, head_values, x, targets, weights
    )
    return (loss, stats), (stage_grads, head_grads, dx)


def _bwd(config, residuals, cotangents):
    stage_grads, head_grads, dx = residuals
    cotangent = cotangents[0]  # (the statistics' are not used: not differentiable)
    if isinstance(cotangent, SymbolicZero):
        return None, None, None, None, None
    scale = lambda g: (g * cotangent).astype(g.dtype)  # noqa: E731
    return (
        jax.tree.map(scale, stage_grads),
        jax.tree.map(scale, head_grads),
        None if dx is None else scale(dx),
        None,
        None,
    )


pipelined_loss.defvjp(_fwd, _bwd, symbolic_zeros=True)
