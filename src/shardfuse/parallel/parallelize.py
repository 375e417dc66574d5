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
   token-weighted gradient accumulation over `microbatches` (`sf.parallel.accumulate`,
   the ZeRO-2 gradient reduce-scatter in the backward), then the optimizer update.

Steps 2-5 are keywords of the one `Transformer` constructor (the layers take
them from one `sf.layers.LayerOptions`); steps 6-7 wrap it. `parallel` does not
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
from shardfuse.flops import check_remat
from shardfuse.layers.fsdp import check_zero
from shardfuse.layers.loss import token_loss
from shardfuse.model_spec import ModelSpec
from shardfuse.models.transformer import Transformer
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.pipeline.api import Pipeline
from shardfuse.parallel.pipeline.balance import balance_stages
from shardfuse.parallel.pipeline.schedule import SCHEDULES, check_schedule
from shardfuse.parallel.zero import ZeroOptimizer


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a training run is laid out: what `parallelize` applies, besides the mesh.

    Fields:
      zero: ZeRO stage 0..3 over the `fsdp` axis.
      remat: activation checkpointing policy of each layer (`shardfuse.flops.REMAT_POLICIES`).
      microbatches: pipeline microbatches (pipeline axis > 1), else gradient
        accumulation steps.
      schedule: pipeline schedule (`sf.parallel.SCHEDULES`).
      virtual_stages: model chunks per pipeline stage (interleaved schedules).
      sequence_parallel: Megatron sequence parallelism over `model`.
      layout: ring layout of the sequence over `sequence` ("zigzag", ...).
      mesh_shape: the mesh sizes these options were made for (a plan's), or
        None; `parallelize` checks them against its mesh.

    Example usage::

      >>> from shardfuse.parallel import RunOptions
      >>> RunOptions(zero=3, microbatches=2).replace(remat="full").remat
      'full'
      >>> RunOptions(zero=4)
      Traceback (most recent call last):
      ...
      ValueError: zero=4 must be one of (0, 1, 2, 3) (the ZeRO stage)
    """

    zero: int = 0
    remat: str = "none"
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = True
    layout: str = "zigzag"
    mesh_shape: dict | None = None

    def __post_init__(self):
        check_zero(self.zero)
        check_remat(self.remat)
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches!r} must be an int >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {tuple(SCHEDULES)}")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise ValueError(f"virtual_stages={self.virtual_stages!r} must be an int >= 1")

    def replace(self, **changes) -> "RunOptions":
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    def run_options(self) -> "RunOptions":
        """Itself (the conversion `parallelize` calls on a plan)."""
        return self


@dataclasses.dataclass
class Run:
    """What `parallelize` builds: call `run.step(run.model, run.optimizer, rows)` under the mesh.

    Fields:
      model: the `sf.models.Transformer`, born sharded.
      optimizer: the `sf.parallel.ZeroOptimizer` over it.
      step: the jitted step `(model, optimizer, rows) -> loss`: `rows` int
        `[B, T + 1]` (tokens `rows[:, :-1]`, targets `rows[:, 1:]`, natural
        order); it updates the model and optimizer in place and returns the
        mean token loss before the update.
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
        `sf.models.Transformer` (`mesh=`, `zero=`, `remat=`, `pipelined=`,
        `stage_layers=`, ...; not `rngs`), e.g.
        `functools.partial(sf.models.hf.load_hf, path)`; it must return a
        `Transformer` of `spec` (checked).
      **model_kwargs: other keywords of `sf.models.Transformer` (e.g. `dtype`).

    Returns:
      A `Run`: `model`, `optimizer`, `step`, `mesh`, `options`, `stage_layers`.

    Raises:
      TypeError: `plan_or_options` is neither options nor a plan.
      ValueError: the plan's mesh is not `mesh`; `init` built a model of
        another spec; uneven pipeline stages with
        `virtual_stages > 1`; sizes the mesh does not divide (from the layers).

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
    if pipelined:
        if spec.num_layers < stages:
            raise ValueError(
                f"spec.num_layers={spec.num_layers} is fewer than the mesh's {stages} pipeline "
                "stages (each stage needs a layer): a smaller pipeline axis, or more layers"
            )
        try:
            check_schedule(options.schedule, stages, options.microbatches, options.virtual_stages)
        except ValueError as e:  # named as the options spell them
            raise ValueError(
                f"RunOptions(schedule={options.schedule!r}, microbatches={options.microbatches}, "
                f"virtual_stages={options.virtual_stages}) on a pipeline axis of {stages}: "
                f"{str(e).replace('num_microbatches', 'microbatches')}"
            ) from None
    stage_layers = None
    if pipelined and spec.num_layers % (stages * options.virtual_stages):
        if options.virtual_stages > 1:
            raise ValueError(
                f"spec.num_layers={spec.num_layers} over {stages} stages x virtual_stages="
                f"{options.virtual_stages}: uneven stages run with virtual_stages=1"
            )
        stage_layers = balance_stages([1.0] * spec.num_layers, stages)
    # 3-5. tensor / sequence / context / data parallelism, remat, ZeRO-3: the layers' options
    layout_kwargs = dict(
        mesh=mesh,
        zero=options.zero,
        remat=options.remat,
        pipelined=pipelined,
        stage_layers=stage_layers,
        layout=options.layout,
        sequence_parallel=options.sequence_parallel,
        **model_kwargs,
    )
    if init is None:
        model = Transformer(spec, rngs=nnx.Rngs(0) if rngs is None else rngs, **layout_kwargs)
    else:
        model = init(**layout_kwargs)
        if getattr(model, "spec", None) != spec:
            raise ValueError(
                f"init built a model of spec {getattr(model, 'spec', None)!r}, not spec={spec!r}"
            )
    # 6. the optimizer, its state sharded by ZeRO stage
    tx = optax.adamw(3e-3) if optimizer is None else optimizer
    zero_optimizer = ZeroOptimizer(model, tx, mesh=mesh, zero=options.zero)
    # 7. the step
    step = nnx.jit(_step_fn(mesh, options, pipelined))
    return Run(model, zero_optimizer, step, mesh, options, stage_layers)


def _step_fn(mesh, options: RunOptions, pipelined: bool):
    ring = _size(mesh, axes.SEQUENCE)
    batch = tuple(a for a in axes.BATCH_AXES if a in mesh.axis_names) or None
    sequence = axes.SEQUENCE if axes.SEQUENCE in mesh.axis_names else None
    batch_spec = P(batch, sequence)

    def step(model, optimizer, rows):
        tokens, targets = rows[:, :-1], rows[:, 1:]
        if ring > 1:  # ring order along T; the loss does not care about order
            tokens = to_ring_layout(tokens, ring, options.layout)
            targets = to_ring_layout(targets, ring, options.layout)
        if pipelined:

            def pipelined_loss(model):
                pipe = Pipeline(  # built from the model being differentiated
                    model.blocks,
                    mesh=mesh,
                    schedule=options.schedule,
                    num_microbatches=options.microbatches,
                    virtual_stages=options.virtual_stages,
                )
                return pipe.loss(
                    model.embed_tokens(tokens), targets, head=model.head, targets_spec=batch_spec
                )

            loss, grads = nnx.value_and_grad(pipelined_loss)(model)
        else:

            def per_shard_loss(model, batch):
                return token_loss(model(batch["tokens"]), batch["targets"])

            loss, grads = accumulate(
                per_shard_loss,
                options.microbatches,
                mesh=mesh,
                zero=options.zero,
                batch_spec=batch_spec,
            )(model, {"tokens": tokens, "targets": targets})
        optimizer.update(model, grads)
        return loss

    return step


__all__ = ["Run", "RunOptions", "parallelize"]
