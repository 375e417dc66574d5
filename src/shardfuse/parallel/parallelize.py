"""`parallelize`: a model spec and run options (or a planner `Plan`) -> model, optimizer, step.

The one place a training run is assembled from its parts, after torchtitan's
`parallelize_llama`: the model (`sf.models.Transformer`) knows nothing of the
run; `parallelize` applies each parallelism once, in this order:

1. **mesh**: the options' mesh sizes (a plan's) are checked against `mesh`;
2. **pipeline** over `pipeline`: the stacked layers are split into stages
   (uneven layer counts by `sf.parallel.balance_stages`);
3. **tensor and sequence parallelism** over `model`, **context (ring)
   parallelism** over `sequence`, **data parallelism** over `data` and `fsdp`:
   the layers' axes, from the mesh;
4. **activation checkpointing**: the `remat` policy of each stacked layer;
5. **ZeRO-3** parameter sharding over `fsdp` (`zero=3`), in the layers;
6. **the optimizer**, born sharded: ZeRO-1/2/3 state over `fsdp` (`sf.parallel.ZeroOptimizer`);
7. **the step**, jitted: the pipeline schedule over its microbatches, or
   token-weighted gradient accumulation over `num_microbatches`
   (`sf.parallel.accumulate`, the ZeRO-2 gradient reduce-scatter in the
   backward), then the optimizer update; token weights (a padding mask) are
   an optional argument of the step, as of `accumulate` and `Pipeline.loss`.

Steps 2-5 are the one `Transformer` constructor's: its `sf.layers.LayerOptions`
are derived from the run's (`RunOptions.layer_options`, `prefetch` among them);
steps 6-7 wrap it. `parallel` does not
read plans: a planner `Plan` converts itself (`Plan.run_options()`), and
`parallelize` takes anything with that method.
"""

import dataclasses

import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.ring_attention import to_ring_layout
from shardfuse.layers.loss import token_loss
from shardfuse.layers.moe import MoEStats, moe_aux_loss
from shardfuse.model_spec import ModelSpec
from shardfuse.models.transformer import Transformer
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.options import RunOptions
from shardfuse.parallel.pipeline.api import Pipeline
from shardfuse.parallel.pipeline.balance import balance_stages
from shardfuse.parallel.zero import ZeroOptimizer


@dataclasses.dataclass
class Run:
    """What `parallelize` builds: call `run.step(run.model, run.optimizer, rows)` under the mesh.

    Fields:
      model: the `sf.models.Transformer`, born sharded.
      optimizer: the `sf.parallel.ZeroOptimizer` over it.
      step: the jitted step `(model, optimizer, rows, weights=None) -> loss`:
        `rows` int `[B, T + 1]` (tokens `rows[:, :-1]`, targets `rows[:, 1:]`,
        natural order), `weights` `[B, T]` the targets' token weights (a
        padding mask: 0 for padding; None: every token 1), as `accumulate` and
        `Pipeline.loss` take them; it updates the model and optimizer in place
        and returns the token-weighted mean loss before the update. A mixture of
        experts: the loss trained and returned is that mean plus `aux_loss_coef x
        load_balancing_loss + z_loss_coef x router_z_loss` (`RunOptions`; each
        microbatch's aux losses weighted by its tokens, pipelined or not), and the
        step writes the model's `MoEStats` (`sf.layers.moe_stats(run.model)`: the aux
        losses averaged over the microbatches, tokens per expert summed), the step's
        metrics.
      mesh: the mesh.
      options: the `RunOptions` applied.
      stage_layers: the layers per pipeline stage when uneven, else None.
    """

    model: Transformer
    optimizer: ZeroOptimizer
    step: object
    mesh: object
    options: RunOptions
    stage_layers: tuple | None = None

    @property
    def batch_sharding(self) -> NamedSharding:
        """How `rows` are laid out: the batch over the data-parallel axes."""
        return NamedSharding(self.mesh, P(_batch_axes(self.mesh)))


def _size(mesh, axis) -> int:
    return mesh.shape[axis] if axis in mesh.axis_names else 1


def _batch_axes(mesh):
    return tuple(a for a in axes.BATCH_AXES if _size(mesh, a) > 1) or None


def _check_mesh(options: RunOptions, mesh):
    if options.mesh_shape is None:
        return
    want = {a: int(s) for a, s in options.mesh_shape.items() if int(s) != 1}
    have = {a: int(s) for a, s in mesh.shape.items() if int(s) != 1}
    if want != have:
        raise ValueError(
            f"mesh {dict(mesh.shape)} does not match the plan's mesh {dict(options.mesh_shape)} "
            "(build it with plan.mesh(), or plan for this mesh)"
        )


def _options_of(plan_or_options) -> RunOptions:
    convert = getattr(plan_or_options, "run_options", None)
    if not callable(convert):
        raise TypeError(
            f"plan_or_options={plan_or_options!r} must be an sf.parallel.RunOptions or an "
            "sf.planner.Plan (anything with a run_options() method)"
        )
    options = convert()
    if not isinstance(options, RunOptions):
        raise TypeError(f"run_options() returned {options!r}, not an sf.parallel.RunOptions")
    return options


def parallelize(spec: ModelSpec, plan_or_options, mesh, *, optimizer=None, rngs=None,
                init=None, **model_kwargs) -> Run:  # fmt: skip
    """Builds the model, the optimizer and the jitted step of `spec` on `mesh` (module docstring).

    Args:
      spec: the `sf.models.ModelSpec`.
      plan_or_options: an `sf.parallel.RunOptions`, or an `sf.planner.Plan` (or
        anything with a `run_options()` method returning `RunOptions`).
      mesh: the mesh, over some of `pipeline, data, fsdp, sequence, model`
        (e.g. `plan.mesh()`).
      optimizer: an optax `GradientTransformation` (default `optax.adamw(3e-3)`).
      rngs: `nnx.Rngs` of the parameters (default `nnx.Rngs(0)`).
      init: None (new parameters), or a callable building the model from its
        parameters elsewhere, called with the keywords `parallelize` gives
        `sf.models.Transformer` (`mesh=`, `options=` the run's
        `sf.layers.LayerOptions`, `pipelined=`, `stage_layers=`, `layout=`, ...;
        not `rngs`), e.g. `functools.partial(sf.models.hf.load_hf, path)`; it
        must return a `Transformer` of `spec` (checked).
      **model_kwargs: other keywords of `sf.models.Transformer` (e.g. `dtype`).

    Returns:
      A `Run`: `model`, `optimizer`, `step`, `mesh`, `options`, `stage_layers`.

    Raises:
      TypeError: `plan_or_options` is neither options nor a plan.
      ValueError: the plan's mesh is not `mesh`; `init` built a model of
        another spec; a schedule the pipeline axis cannot run (`Pipeline`);
        uneven pipeline stages with `virtual_stages > 1`; sizes the mesh does
        not divide (from the layers).

    Example usage::

      >>> import jax, optax
      >>> import numpy as np
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> spec = sf.models.ModelSpec.tiny(vocab_size=64, num_layers=1)
      >>> run = sf.parallel.parallelize(spec, sf.parallel.RunOptions(), mesh,
      ...                               optimizer=optax.adamw(1e-2))
      >>> rows = jax.device_put(np.arange(8 * 17).reshape(8, 17) % 64, run.batch_sharding)
      >>> with jax.set_mesh(mesh):
      ...     loss = run.step(run.model, run.optimizer, rows)
      >>> bool(loss > 0)
      True
    """
    options = _options_of(plan_or_options)
    # 1. the mesh
    _check_mesh(options, mesh)
    # 2. pipeline stages (uneven layer counts balanced)
    stages = _size(mesh, axes.PIPELINE)
    pipelined = stages > 1
    if pipelined and spec.num_layers < stages:
        raise ValueError(
            f"spec.num_layers={spec.num_layers} is fewer than the mesh's {stages} pipeline "
            "stages (each stage needs a layer): a smaller pipeline axis, or more layers"
        )
    stage_layers = None
    if pipelined and spec.num_layers % (stages * options.virtual_stages):
        if options.virtual_stages > 1:
            raise ValueError(
                f"spec.num_layers={spec.num_layers} over {stages} stages x virtual_stages="
                f"{options.virtual_stages}: uneven stages run with virtual_stages=1"
            )
        stage_layers = balance_stages([1.0] * spec.num_layers, stages)
    # 3-5. tensor / sequence / context / data parallelism, remat, ZeRO-3 (and its prefetch):
    # the layers' options, derived from the run's
    layer_options = options.layer_options(mesh)
    model_keywords = dict(
        mesh=mesh,
        options=layer_options,
        pipelined=pipelined,
        stage_layers=stage_layers,
        layout=options.layout,
        **model_kwargs,
    )
    if spec.is_moe:  # the MoE blocks' capacity (None: dropless) and dispatch chunks
        model_keywords.setdefault("capacity_factor", options.capacity_factor)
        if options.dispatch_chunks != 1:
            model_keywords.setdefault("dispatch_chunks", options.dispatch_chunks)
    if init is None:
        model = Transformer(spec, rngs=nnx.Rngs(0) if rngs is None else rngs, **model_keywords)
    else:
        model = init(**model_keywords)
        if getattr(model, "spec", None) != spec:
            raise ValueError(
                f"init built a model of spec {getattr(model, 'spec', None)!r}, not spec={spec!r}"
            )
    pipeline = _pipeline_of(mesh, options) if pipelined else None
    if pipeline is not None:
        pipeline(model.blocks)  # the schedule checked against the pipeline axis, now
    # 6. the optimizer, its state sharded by ZeRO stage (the stage and its axis resolved on
    # the mesh once, the layers' own, for the optimizer and the gradients alike)
    zero = layer_options.zero_options()
    tx = optax.adamw(3e-3) if optimizer is None else optimizer
    zero_optimizer = ZeroOptimizer(model, tx, mesh=mesh, zero=zero)
    # 7. the step
    step = nnx.jit(_step_fn(mesh, options, zero, pipeline, moe=spec.is_moe))
    return Run(model, zero_optimizer, step, mesh, options, stage_layers)


def _pipeline_of(mesh, options: RunOptions):
    """`blocks -> Pipeline` of the run's schedule over the mesh's pipeline axis."""

    def pipeline(blocks):
        return Pipeline(
            blocks,
            mesh=mesh,
            schedule=options.schedule,
            num_microbatches=options.num_microbatches,
            virtual_stages=options.virtual_stages,
        )

    return pipeline


def _step_fn(mesh, options: RunOptions, zero, pipeline, moe=False):
    ring = _size(mesh, axes.SEQUENCE)
    batch = tuple(a for a in axes.BATCH_AXES if a in mesh.axis_names) or None
    sequence = axes.SEQUENCE if axes.SEQUENCE in mesh.axis_names else None
    batch_spec = P(batch, sequence)

    def step(model, optimizer, rows, weights=None):
        tokens, targets = rows[:, :-1], rows[:, 1:]
        if ring > 1:  # ring order along T; the loss does not care about order
            tokens = to_ring_layout(tokens, ring, options.layout)
            targets = to_ring_layout(targets, ring, options.layout)
            if weights is not None:
                weights = to_ring_layout(weights, ring, options.layout)
        if pipeline is not None:

            def pipelined_loss(model):  # the pipeline of the model being differentiated
                return pipeline(model.blocks).loss(
                    model.embed_tokens(tokens),
                    targets,
                    head=model.head,
                    weights=weights,
                    targets_spec=batch_spec,
                    # MoE blocks: each microbatch's aux losses weighted by its tokens
                    aux_loss_coef=options.aux_loss_coef if moe else 0.0,
                    z_loss_coef=options.z_loss_coef if moe else 0.0,
                    return_stats=True,
                )

            (loss, stats), grads = nnx.value_and_grad(pipelined_loss, has_aux=True)(model)
            if moe:  # the step's MoEStats (microbatches: losses averaged, counts summed)
                model.blocks.write_stats(stats)
        else:

            def per_shard_loss(model, batch):
                total, count = token_loss(
                    model(batch["tokens"]), batch["targets"], batch.get("weights")
                )
                if not moe:
                    return total, count
                # (sum + count x aux) / count: the mean token loss plus the aux losses
                aux = moe_aux_loss(model, options.aux_loss_coef, options.z_loss_coef)
                stats = nnx.to_pure_dict(nnx.state(model, MoEStats))
                return (total + count * aux, count), stats

            batch = {"tokens": tokens, "targets": targets}
            if weights is not None:
                batch["weights"] = weights
            out = accumulate(
                per_shard_loss,
                options.num_microbatches,
                mesh=mesh,
                zero=zero,
                batch_spec=batch_spec,
                has_aux=moe,
            )(model, batch)
            loss, grads = out[:2]
            if moe:  # the step's MoEStats (microbatches: losses averaged, counts summed)
                stats = nnx.state(model, MoEStats)
                nnx.replace_by_pure_dict(stats, out[2])
                nnx.update(model, stats)
        optimizer.update(model, grads)
        return loss

    return step


__all__ = ["Run", "parallelize"]
