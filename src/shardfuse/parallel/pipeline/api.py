"""`Pipeline`: a `Stack` run as a pipeline over a mesh axis, its loss a `custom_vjp`.

`Pipeline.loss` returns the token-weighted loss of `head` on the stack's
output. It composes with `jax.grad` / `nnx.value_and_grad` like any loss: it
is a `jax.custom_vjp` whose forward runs the WHOLE schedule (forward and
backward ticks, `executor.run_schedule`) and keeps the gradients of the
stack, the head and the input as residuals; its backward scales them by the
incoming cotangent. Undifferentiated (evaluation), it runs the forward ticks
only. The embedding runs before the pipeline and gets its gradient through
the input's cotangent; a head that shares the embedding's `nnx.Param` (tied
embeddings) gets the sum of both ends from autodiff.

Microbatch `i` is rows `i, i + m, i + 2m, ...` of the batch (a strided split:
a batch sharded over the data axes stays where it is), so the loss, a sum
over tokens divided by the total weight, does not depend on the split.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.sharding import run_on_mesh
from shardfuse.kernels.vma import varying_axes
from shardfuse.layers import _sharding
from shardfuse.layers.stack import Stack
from shardfuse.parallel.pipeline import executor
from shardfuse.parallel.pipeline.schedule import check_schedule, schedule_table


def cross_entropy(logits, targets, weights):
    """Token-weighted softmax cross entropy: `(sum(w * ce), sum(w))` in float32.

    `logits` `[..., V]`, integer `targets` `[...]`, `weights` `[...]`.
    """
    logits = logits.astype(jnp.float32)
    label = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    ce = jax.nn.logsumexp(logits, axis=-1) - label
    weights = weights.astype(jnp.float32)
    return jnp.sum(ce * weights), jnp.sum(weights)


def _spec_axes(spec) -> tuple:
    names = []
    for entry in spec:
        names += [entry] if isinstance(entry, str) else list(entry or ())
    return tuple(names)


def _pure(module):
    graphdef, state = nnx.split(module)
    return graphdef, jax.tree.map(
        lambda v: v[...], state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )


class Pipeline(nnx.Module):
    """`stack` split into stages over `pipeline_axis`, run by one of the schedules.

    Stage `s` of `p` holds layers `[s L/p, (s+1) L/p)` (v = 1); with
    `virtual_stages=v` (schedule "interleaved") it holds chunks
    `s, s + p, ..., s + (v-1) p` of `v p` chunks of `L / (v p)` layers each.
    Everything runs in one `jax.shard_map` over all mesh axes: the blocks'
    tensor/sequence/data parallelism runs inside each stage.

    Args:
      stack: a `shardfuse.layers.stack.Stack`; best created with
        `layer_axis=pipeline_axis` (then, for v = 1, no parameter moves).
      mesh: the mesh; must have `pipeline_axis`.
      schedule: "gpipe", "1f1b", "interleaved" or "zb-h1".
      num_microbatches: m (>= p except for gpipe; a multiple of p for interleaved).
      virtual_stages: v, model chunks per stage (interleaved only).
      pipeline_axis: the mesh axis of the stages.
      io_spec: PartitionSpec of the `[B, T, F]` activations between blocks
        (default: the block's `io_spec()`, else replicated).

    Raises:
      ValueError: a mesh without `pipeline_axis`, an invalid schedule or
        (p, m, v), or `num_layers` not divisible by `p * v`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> from shardfuse.layers.stack import Stack
      >>> from shardfuse.parallel.pipeline.api import Pipeline
      >>> mesh = jax.make_mesh((2, 2), ("pipeline", "model"))
      >>> block = lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 32, mesh=mesh, rngs=rngs)
      >>> stack = Stack(block, 4, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
      >>> pipe = Pipeline(stack, mesh=mesh, schedule="1f1b", num_microbatches=2)
      >>> head = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, sequence_parallel=True,
      ...                                       gather_output=True, rngs=nnx.Rngs(1))
      >>> x = jnp.ones((4, 8, 16))
      >>> targets = jnp.zeros((4, 8), jnp.int32)
      >>> loss = pipe.loss(x, targets, head=head, targets_spec=jax.P())
      >>> loss.shape, bool(jnp.isfinite(loss))
      ((), True)
    """

    def __init__(
        self,
        stack,
        *,
        mesh,
        schedule: str = "1f1b",
        num_microbatches: int,
        virtual_stages: int = 1,
        pipeline_axis: str = "pipeline",
        io_spec=None,
    ):
        if not isinstance(stack, Stack):
            raise TypeError(f"stack must be a shardfuse.layers.stack.Stack, got {type(stack)}")
        if pipeline_axis not in mesh.axis_names:
            raise ValueError(
                f"pipeline_axis={pipeline_axis!r} is not an axis of the mesh; its axes are "
                f"{tuple(mesh.axis_names)}"
            )
        p = int(mesh.shape[pipeline_axis])
        check_schedule(schedule, p, num_microbatches, virtual_stages)
        if stack.num_layers % (p * virtual_stages):
            raise ValueError(
                f"num_layers={stack.num_layers} must be divisible by p * virtual_stages = "
                f"{p} * {virtual_stages} = {p * virtual_stages} (pipeline axis "
                f"{pipeline_axis!r} of size {p})"
            )
        self.stack, self.mesh, self.schedule = stack, mesh, schedule
        self.num_microbatches, self.virtual_stages = int(num_microbatches), int(virtual_stages)
        self.pipeline_axis, self.num_stages = pipeline_axis, p
        if io_spec is None:
            io_spec = stack.blocks.io_spec() if hasattr(stack.blocks, "io_spec") else P()
        self.io_spec = io_spec
        # Tests: NaN in every ring buffer and every transfer no action sends.
        self.poison_buffers = False
        if pipeline_axis in _spec_axes(io_spec):
            raise ValueError(f"io_spec={io_spec} must not use the pipeline axis {pipeline_axis!r}")

    def table(self, *, forward_only: bool = False):
        """The `ScheduleTable` this pipeline runs."""
        return schedule_table(
            self.schedule,
            self.num_stages,
            self.num_microbatches,
            self.virtual_stages,
            forward_only=forward_only,
        )

    def _check_batch(self, x, targets=None, weights=None):
        _sharding.check_activations(x)
        m = self.num_microbatches
        if x.ndim < 1 or x.shape[0] % m:
            raise ValueError(
                f"x has batch size {x.shape[0] if x.ndim else None} (shape {x.shape}); it must be "
                f"divisible by num_microbatches={m}"
            )
        batch_axes = self.io_spec[0] if len(self.io_spec) else None
        _sharding.check_divisible(
            f"the microbatch size x.shape[0] / num_microbatches = {x.shape[0] // m}",
            x.shape[0] // m,
            self.mesh,
            batch_axes,
        )
        for name, value in (("targets", targets), ("weights", weights)):
            if value is not None and tuple(value.shape) != tuple(x.shape[: value.ndim]):
                raise ValueError(
                    f"{name} has shape {value.shape}; expected the leading dimensions of x "
                    f"{tuple(x.shape[:2])}"
                )

    def forward(self, x):
        """The stack's output `[B, T, F]` for input `x`, by the schedule's forward ticks."""
        self._check_batch(x)
        graphdef, values = _pure(self.stack.blocks)
        x = _sharding.place(x, self.mesh, P(*self.io_spec))
        return _forward_program(self._config(graphdef), values, x)

    def loss(self, x, targets, *, head, weights=None, loss_fn=cross_entropy, targets_spec=None):
        """Token-weighted loss of `loss_fn(head(stack(x)), targets, weights)`, pipelined.

        Args:
          x: `[B, T, F]` embedded input (floating point), laid out as `io_spec`.
          targets: `[B, T]` integer targets.
          head: an `nnx.Module` mapping the stack's output (per shard, in
            `io_spec`) to logits; it runs on the last stage.
          weights: `[B, T]` token weights (default 1).
          loss_fn: `loss_fn(logits, targets, weights) -> (loss_sum, weight_sum)`
            over local tokens (default `cross_entropy`); the result is
            `sum(loss_sum) / sum(weight_sum)` over all tokens.
          targets_spec: PartitionSpec of targets/weights as the head's logits
            lay out tokens (default: the first two entries of `io_spec`).
            Mesh axes absent from it replicate the loss: only their first
            device's loss counts.

        Returns:
          The scalar float32 loss; differentiable with respect to the stack,
          the head and `x`.
        """
        self._check_batch(x, targets, weights)
        if weights is None:
            weights = jnp.ones(targets.shape, jnp.float32)
        if targets_spec is None:
            targets_spec = P(*tuple(self.io_spec)[:2])
        stack_graphdef, stack_values = _pure(self.stack.blocks)
        head_graphdef, head_values = _pure(head)
        head_specs = _spec_tree(nnx.get_partition_spec(nnx.state(head)))
        config = self._config(
            stack_graphdef,
            head_graphdef=head_graphdef,
            head_specs=head_specs,
            loss_fn=loss_fn,
            targets_spec=targets_spec,
        )
        # On the activation layout first: the reshard's transpose brings x's gradient back
        # to x's own sharding (e.g. that of an embedding lookup).
        x = _sharding.place(x, self.mesh, P(*self.io_spec))
        return _pipelined_loss(config, stack_values, head_values, x, targets, weights)

    def _config(self, graphdef, **head):
        return _Config(
            schedule=self.schedule,
            p=self.num_stages,
            m=self.num_microbatches,
            v=self.virtual_stages,
            mesh=self.mesh,
            pipeline_axis=self.pipeline_axis,
            io_spec=self.io_spec,
            stack_graphdef=graphdef,
            layer_specs=_spec_tree(self.stack.layer_specs()),
            apply_layers=self.stack.apply_layers,
            poison=self.poison_buffers,
            **head,
        )


def _spec_tree(specs):
    """A pytree of PartitionSpecs (P() where none is set) from `nnx.get_partition_spec`."""

    def spec(v):
        value = v.get_value() if isinstance(v, nnx.Variable) else v
        return value if isinstance(value, P) else P()

    return jax.tree.map(spec, specs, is_leaf=lambda v: isinstance(v, nnx.Variable | P) or v is None)


class _Config:
    """Static settings of one pipelined program (hashable by identity of its fields)."""

    def __init__(self, **fields):
        fields.setdefault("head_graphdef", None)
        fields.setdefault("head_specs", None)
        fields.setdefault("loss_fn", None)
        fields.setdefault("targets_spec", None)
        self.__dict__.update(fields)
        self._key = tuple((k, v if _hashable(v) else id(v)) for k, v in sorted(fields.items()))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, _Config) and self._key == other._key


def _hashable(value):
    try:
        hash(value)
        return True
    except TypeError:
        return False


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
    """`[B, ...]` -> `[m, B/m, ...]`, microbatch i = rows i, i + m, ..."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _unmicrobatch(x):
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


def _constrain(tree, mesh, specs):
    return jax.tree.map(
        lambda a, s: lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, s)),
        tree,
        specs,
    )


def _stage_fn(config):
    def stage(chunk_state, x):
        return config.apply_layers(chunk_state, x)

    return stage


def _run(config, forward_only, stack_values, head_values, x, targets, weights):
    """The pipelined program (traced under jit): outputs for forward-only or training."""
    table = schedule_table(config.schedule, config.p, config.m, config.v, forward_only=forward_only)
    x_spec = P(None, *config.io_spec)
    out_specs = (
        x_spec if forward_only else (P(), P(), _stage_out_specs(config), config.head_specs, x_spec)
    )

    def program(mesh, stack_values, head_values, x, targets, weights):
        stages, stage_specs = _to_stages(config, stack_values, config.layer_specs)
        stages = _constrain(stages, mesh, stage_specs)
        x = _constrain(_microbatches(x, config.m), mesh, x_spec)
        t_spec = P(None, *config.targets_spec) if config.targets_spec is not None else P()
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
            result = executor.run_schedule(
                table,
                stage_fn=_stage_fn(config),
                head_fn=head_fn,
                pipeline_axis=config.pipeline_axis,
                stage_params=stages,
                head_params=head_values,
                x=x,
                targets=targets,
                weights=weights,
                poison=config.poison,
            )
            if forward_only:
                return lax.psum(result, config.pipeline_axis)
            loss_sum, weight_sum, stage_grads, head_grads, dx = result
            loss_sum = lax.psum(loss_sum, tuple(sorted(varying_axes(loss_sum))))
            weight_sum = lax.psum(weight_sum, tuple(sorted(varying_axes(weight_sum))))
            head_grads = jax.tree.map(lambda g: lax.psum(g, config.pipeline_axis), head_grads)
            dx = lax.psum(dx, config.pipeline_axis)
            stage_grads = jax.tree.map(lambda g: g[None], stage_grads)
            return loss_sum, weight_sum, stage_grads, head_grads, dx

        body_specs = out_specs
        if not forward_only:
            body_specs = (P(), P(), stage_specs, config.head_specs, x_spec)
        outputs = jax.shard_map(body, mesh=mesh, in_specs=tuple(in_specs), out_specs=body_specs)(
            *args
        )
        if forward_only:
            return _unmicrobatch(outputs)
        loss_sum, weight_sum, stage_grads, head_grads, dx = outputs
        scale = 1.0 / weight_sum
        stage_grads = jax.tree.map(
            lambda g: (g * scale).astype(g.dtype), _from_stages(config, stage_grads)
        )
        head_grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), head_grads)
        dx = (_unmicrobatch(dx) * scale).astype(dx.dtype)
        return loss_sum * scale, stage_grads, head_grads, dx

    final_specs = (
        P(*config.io_spec)
        if forward_only
        else (P(), config.layer_specs, config.head_specs, P(*config.io_spec))
    )
    return run_on_mesh(program, config.mesh, final_specs)(
        stack_values, head_values, x, targets, weights
    )


def _stage_out_specs(config):
    return jax.tree.map(
        lambda s: P(config.pipeline_axis, None, None, *tuple(s)[1:]), config.layer_specs
    )


def _head_fn(config):
    """`head_fn(head_values, y, targets, weights) -> (loss_sum, weight_sum)` per shard.

    Only the first device along the mesh axes the targets are not split over
    counts (the others hold copies of the same tokens' loss).
    """
    token_axes = set(_spec_axes(config.targets_spec))
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
def _forward_program(config, stack_values, x):
    return _run(config, True, stack_values, None, x, None, None)


@functools.partial(jax.jit, static_argnums=(0,))
def _train_program(config, stack_values, head_values, x, targets, weights):
    return _run(config, False, stack_values, head_values, x, targets, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pipelined_loss(config, stack_values, head_values, x, targets, weights):
    return _train_program(config, stack_values, head_values, x, targets, weights)[0]


def _fwd(config, stack_values, head_values, x, targets, weights):
    loss, stage_grads, head_grads, dx = _train_program(
        config, stack_values, head_values, x, targets, weights
    )
    return loss, (stage_grads, head_grads, dx)


def _bwd(config, residuals, cotangent):
    stage_grads, head_grads, dx = residuals
    scale = lambda g: (g * cotangent).astype(g.dtype)  # noqa: E731
    return (
        jax.tree.map(scale, stage_grads),
        jax.tree.map(scale, head_grads),
        scale(dx),
        None,
        None,
    )


_pipelined_loss.defvjp(_fwd, _bwd)
