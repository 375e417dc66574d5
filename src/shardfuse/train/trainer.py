"""`Trainer`: a training run of an `sf.models.Transformer` on any mesh, from a config or a plan.

Built on `sf.parallel.parallelize` (the model, the ZeRO optimizer born
sharded and the jitted step, from the config's `RunOptions` or a planner
`Plan`), it adds what a run needs around the step: the mesh (across
processes: `jax.distributed` via `sf.parallel.distributed`), batches of
which each process loads only its own rows (`shardfuse.train.data`), one
line of metrics per step (loss, tokens/s, step time, MFU from `sf.flops`), a
JSON log, orbax checkpoints every K steps and at exit (a run started again
with the same directory resumes from the last complete checkpoint, on any
mesh), and the planner's view of the run (`plan_for`, `from_plan`,
`parallelism_of`, `estimate_for`).
"""

import dataclasses
import functools
import json
import math
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType

from shardfuse import axes, flops, hardware, planner
from shardfuse._keywords import moved_keywords
from shardfuse.layers.moe import moe_stats
from shardfuse.model_spec import ModelSpec
from shardfuse.parallel import distributed
from shardfuse.parallel.checkpoint import Checkpointer
from shardfuse.parallel.options import RunOptions
from shardfuse.parallel.parallelize import parallelize
from shardfuse.train.data import CORPUS, SyntheticTokens, TextTokens

AXES = axes.MESH_AXES  # outermost to innermost
COMPUTE_DTYPE = "float32"  # the model's weights and activations: the peak its MFU divides by


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; every field is a flag of `examples/train_lm.py`.

    The run's choices (ZeRO stage, remat, prefetch, microbatches, pipeline
    schedule and virtual stages, ...) are one `sf.parallel.RunOptions`,
    `options`, what `sf.parallel.parallelize` applies. The keywords `zero=`,
    `remat=`, `microbatches=`, `schedule=`, `virtual_stages=` of earlier
    releases still set its fields, with a DeprecationWarning.

    Example:
      >>> from shardfuse.parallel import RunOptions
      >>> from shardfuse.train import TrainConfig
      >>> TrainConfig(mesh={"data": 8}, options=RunOptions(zero=1)).options.zero
      1
    """

    mesh: dict = dataclasses.field(default_factory=lambda: {"data": 2, "sequence": 2, "model": 2})
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec.tiny)
    steps: int = 20
    global_batch: int = 8
    seq_len: int = 64
    learning_rate: float = 3e-3
    weight_decay: float = 0.0
    data: str = "synthetic"  # or "text"
    text_file: str | None = None
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    log_json: str | None = None
    device: str | None = None  # sf.hardware name for the MFU estimate (default: detected)
    spread_processes: bool = False  # every mesh axis crosses processes (distributed.spread_devices)
    options: RunOptions = dataclasses.field(default_factory=RunOptions)  # the run's choices
    init_from: str | None = None  # a Hugging Face checkpoint directory: its spec and weights
    export_hf: str | None = None  # after training, the model as a Hugging Face checkpoint here

    def __post_init__(self):
        if not isinstance(self.options, RunOptions):
            raise TypeError(f"options={self.options!r} must be an sf.parallel.RunOptions")

    def run_options(self) -> RunOptions:
        """`options`: what `sf.parallel.parallelize` applies (the conversion it calls)."""
        return self.options

    def mesh_shape(self, device_count: int) -> tuple:
        """Sizes of `AXES`, checked against the device count."""
        unknown = sorted(set(self.mesh) - set(AXES))
        if unknown:
            raise ValueError(f"mesh axes {unknown} are not among {AXES}")
        sizes = tuple(int(self.mesh.get(axis, 1)) for axis in AXES)
        if any(size < 1 for size in sizes):
            raise ValueError(f"mesh sizes {dict(zip(AXES, sizes, strict=True))} must be >= 1")
        if math.prod(sizes) != device_count:
            raise ValueError(
                f"mesh {dict(zip(AXES, sizes, strict=True))} has {math.prod(sizes)} devices; "
                f"JAX has {device_count} (on CPU set JAX_NUM_CPU_DEVICES)"
            )
        return sizes


TrainConfig.__init__ = moved_keywords(
    "options", RunOptions, zero="zero", remat="remat", microbatches="num_microbatches",
    schedule="schedule", virtual_stages="virtual_stages",
)(TrainConfig.__init__)  # fmt: skip

parse_mesh = axes.parse_mesh  # the command line's `--mesh data=2,model=4`


def plan_for(config: TrainConfig, device_count: int, *, chip: str = "h100", **restrict) -> list:
    """`sf.plan` for `config`'s model and batch on one node of `device_count` `chip`s.

    The model is planned as it runs here: float32 weights, AdamW, the input
    embedding replicated unless ZeRO-3 shards it, the step's outputs not
    donated (`Assumptions.float32(embedding_sharded=False, donate=False)`),
    ring attention over the sequence axis (what the blocks run). CPUs have no
    entry in `sf.hardware`: on CPU the chip only changes the ranking, not
    what runs. `restrict`: `sf.plan`'s keyword arguments (`mesh=`, `zero=`,
    `remat=`, `schedule=`, `microbatch_size=`, `top_k=`).
    """
    spec, cluster, assumptions = _planner_inputs(config, device_count, chip)
    options = dict(cp_strategy="ring") | restrict
    return planner.plan(
        spec,
        cluster,
        global_batch=config.global_batch,
        seq_len=config.seq_len,
        assumptions=assumptions,
        **options,
    )


def _planner_inputs(config: TrainConfig, device_count: int, chip: str) -> tuple:
    """`(model spec, cluster, assumptions)` of `config` as it runs here (see `plan_for`)."""
    cluster = hardware.cluster(config.device or chip, devices_per_node=device_count)
    assumptions = planner.Assumptions.float32(embedding_sharded=False, donate=False)
    return config.model, cluster, assumptions


def parallelism_of(config: TrainConfig, device_count: int):
    """The `sf.planner.Parallelism` that `config` runs (the inverse of `from_plan`)."""
    sizes = dict(zip(AXES, config.mesh_shape(device_count), strict=True))
    replicas = sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)  # expert: a batch axis too
    options = config.options.replace(mesh_shape=None)  # the mesh: `sizes`
    return planner.Parallelism(
        **sizes,
        options=options,
        microbatch_size=max(1, config.global_batch // (replicas * options.num_microbatches)),
        cp_strategy="ring",
    )


def layout_of(config: TrainConfig, device_count: int):
    """Deprecated: `parallelism_of` (the planner's layout is now `sf.planner.Parallelism`)."""
    warnings.warn(
        "sf.train.layout_of is deprecated and will be removed in the next release: use "
        "sf.train.parallelism_of",
        DeprecationWarning,
        stacklevel=2,
    )
    return parallelism_of(config, device_count)


def estimate_for(config: TrainConfig, device_count: int, *, chip: str = "h100"):
    """The planner's `Estimate` of `config`'s step as it runs (`parallelism_of`) on `chip`s.

    The cost function `sf.plan` ranks with, for this one parallelism: its terms are
    what `sf.profile` prints beside the measured categories.
    """
    spec, cluster, assumptions = _planner_inputs(config, device_count, chip)
    return planner.estimate(
        spec,
        cluster,
        parallelism_of(config, device_count),
        global_batch=config.global_batch,
        seq_len=config.seq_len,
        assumptions=assumptions,
    )


def from_plan(config: TrainConfig, plan) -> TrainConfig:
    """`config` with the mesh and options of `plan` (an `sf.planner.Plan`).

    The plan's axes of size 1 that the trainer's mesh lacks (the planner's expert axis,
    until `axes.MESH_AXES` holds it) are left out; any other size reaches
    `TrainConfig.mesh_shape`, which names it.
    """
    mesh = {axis: size for axis, size in plan.mesh_shape.items() if axis in AXES or size != 1}
    return dataclasses.replace(
        config,
        mesh=mesh,
        global_batch=plan.global_batch,
        seq_len=plan.seq_len,
        options=plan.run_options(),
    )


def planned(config: TrainConfig, device_count: int, *, chip: str = "h100") -> tuple:
    """`(config, plan)`: `config` with the options of `sf.plan`'s best plan (`plan_for`)."""
    best = plan_for(config, device_count, chip=chip)[0]
    return from_plan(config, best), best


def _stream(config: TrainConfig):
    if config.data == "synthetic":
        return SyntheticTokens(config.model.vocab_size, config.seq_len, config.seed)
    if config.data == "text":
        stream = TextTokens(config.text_file or CORPUS, config.seq_len, config.seed)
        if config.model.vocab_size < stream.vocab:
            raise ValueError(f"--data text needs vocab_size >= 256; got {config.model.vocab_size}")
        return stream
    raise ValueError(f"data={config.data!r} must be 'synthetic' or 'text'")


def _peak_flops(config: TrainConfig) -> float | None:
    """Peak FLOP/s of one device for `COMPUTE_DTYPE` (None where unknown: CPUs)."""
    chip = hardware.resolve(config.device) if config.device else hardware.current_device()
    if chip is None:
        return None
    return flops.peak_flops_per_s(chip, COMPUTE_DTYPE)


def moe_metrics(model) -> dict:
    """A MoE model's metrics of its last step (`sf.layers.moe_stats`), as plain numbers.

    `aux_loss` (the load-balancing loss summed over the MoE layers), `z_loss`,
    `dropped_tokens`, `tokens_per_expert` (a list per layer) and `expert_load`: the
    busiest expert's tokens over the mean, the worst layer's (1.0: balanced).
    """
    stats = moe_stats(model)
    counts = [np.asarray(c) for c in stats["tokens_per_expert"]]
    load = max((float(c.max() / max(c.mean(), 1e-9)) for c in counts), default=1.0)
    return dict(
        aux_loss=float(stats["load_balancing_loss"]),
        z_loss=float(stats["router_z_loss"]),
        dropped_tokens=int(stats["dropped_tokens"]),
        tokens_per_expert=[c.tolist() for c in counts],
        expert_load=load,
    )


def _moe_line(moe: dict) -> str:
    line = f"  aux_loss {moe['aux_loss']:.4f}  z_loss {moe['z_loss']:.3f}"
    line += f"  expert_load {moe['expert_load']:.2f} (max/mean)"
    if moe["dropped_tokens"]:
        line += f"  dropped {moe['dropped_tokens']}"
    return line


def _mesh(config: TrainConfig):
    shape = config.mesh_shape(jax.device_count())
    if config.spread_processes:
        return jax.sharding.Mesh(
            distributed.spread_devices(shape), AXES, axis_types=(AxisType.Explicit,) * len(AXES)
        )
    return jax.make_mesh(shape, AXES)


def _with_checkpoint_spec(config: TrainConfig) -> TrainConfig:
    """`config` with `init_from`'s architecture as its model (unchanged without one)."""
    if not config.init_from:
        return config
    from shardfuse.models import hf

    return dataclasses.replace(
        config, model=hf.read_hf_spec(config.init_from, argument="init_from")
    )


def _parallelize(config: TrainConfig, mesh, init=None):
    return parallelize(
        config.model,
        config.run_options(),
        mesh,
        optimizer=optax.adamw(config.learning_rate, weight_decay=config.weight_decay),
        rngs=nnx.Rngs(config.seed),
        init=init,
    )


def step_memory(config: TrainConfig):
    """The compiled training step's `memory_analysis()` per device, allocating nothing.

    The step `Trainer(config)` would run, compiled from the abstract model and
    optimizer state (`nnx.eval_shape`: shapes, dtypes and shardings, no arrays):
    what a run of `config` needs per device (arguments + outputs + temp) before
    any parameter exists, e.g. to check a plan on the devices at hand. An
    `init_from` checkpoint gives the spec; its weights are not read.

    Example:
      >>> from shardfuse.models import ModelSpec
      >>> from shardfuse.train import TrainConfig, step_memory
      >>> config = TrainConfig(mesh={"data": 8}, model=ModelSpec.tiny(num_layers=1))
      >>> step_memory(config).argument_size_in_bytes > 0
      True
    """
    config = _with_checkpoint_spec(config)
    mesh = _mesh(config)
    built = {}

    def build():
        built["run"] = run = _parallelize(config, mesh)
        return run.model, run.optimizer

    model, optimizer = nnx.eval_shape(build)
    run = built["run"]
    rows = jax.ShapeDtypeStruct(
        (config.global_batch, config.seq_len + 1), jnp.int32, sharding=run.batch_sharding
    )
    with jax.set_mesh(mesh):
        return run.step.lower(model, optimizer, rows).compile().memory_analysis()


class Trainer:
    """One training run: mesh, model, optimizer, data, checkpoints (see the module docstring).

    Example usage::

      >>> from shardfuse.train import TrainConfig, Trainer
      >>> from shardfuse.models import ModelSpec
      >>> config = TrainConfig(mesh={"data": 8}, steps=2, model=ModelSpec.tiny(num_layers=1))
      >>> trainer = Trainer(config, log=lambda s: None)
      >>> len(trainer.run())
      2
    """

    def __init__(self, config: TrainConfig, *, log=print):
        self.config, self._log = config, log
        self.mesh = _mesh(config)
        self.config = config = _with_checkpoint_spec(config)
        init = None
        if config.init_from:
            from shardfuse.models import hf

            init = functools.partial(hf.load_hf, config.init_from)
        self.parallelized = _parallelize(config, self.mesh, init=init)
        self.model, self.optimizer = self.parallelized.model, self.parallelized.optimizer
        self.stream = _stream(config)
        self.step = 0
        self.checkpointer = None
        if config.checkpoint_dir:
            self.checkpointer = Checkpointer(config.checkpoint_dir, every=config.checkpoint_every)
            if self.checkpointer.latest_step() is not None:
                meta = self.checkpointer.restore(self.model, self.optimizer)
                self.step = int(meta["data_position"].get("next_batch", meta["step"]))
                self.log(f"resumed from step {meta['step']} in {config.checkpoint_dir}")
        self._train_step = self.parallelized.step
        self.history = []

    def log(self, line: str):
        if distributed.is_primary():
            self._log(line)

    def batch(self, step: int):
        """Global `(tokens, targets)` of batch `step`, rows loaded per process."""
        c = self.config
        return distributed.global_batch(
            lambda start, stop: self.stream.rows(step, start, stop),
            (c.global_batch, c.seq_len + 1),
            self.parallelized.batch_sharding,
        )

    def step_call(self) -> tuple:
        """`(step, args)`: the jitted training step and the arguments of its next call.

        `step(*args)` trains one step on batch `self.step` (it updates the model
        and optimizer in place); call it under `jax.set_mesh(self.mesh)`. For
        `sf.profile(step, *args)`.
        """
        return self._train_step, (self.model, self.optimizer, self.batch(self.step))

    def memory_analysis(self):
        """The compiled training step's `memory_analysis()` (per device; compiles, runs nothing)."""
        with jax.set_mesh(self.mesh):
            lowered = self._train_step.lower(self.model, self.optimizer, self.batch(self.step))
            return lowered.compile().memory_analysis()

    def run(self) -> list[float]:
        """Trains until `config.steps`; returns this run's losses (one per step taken)."""
        c = self.config
        tokens_per_step = c.global_batch * c.seq_len
        flops_per_step = flops.model_flops_per_token(c.model, c.seq_len) * tokens_per_step
        peak = _peak_flops(c)
        losses = []
        try:
            while self.step < c.steps:
                start = time.perf_counter()
                loss = float(self._train_step(self.model, self.optimizer, self.batch(self.step)))
                seconds = time.perf_counter() - start
                self.step += 1
                losses.append(loss)
                record = dict(
                    step=self.step,
                    loss=loss,
                    tokens_per_s=tokens_per_step / seconds,
                    step_time_s=seconds,
                    mfu=None
                    if peak is None
                    else flops.mfu(
                        flops_per_step,
                        step_time_s=seconds,
                        devices=jax.device_count(),
                        peak_flops_per_s=peak,
                    ),
                )
                moe = moe_metrics(self.model) if c.model.is_moe else None
                if moe is not None:
                    record.update(moe)
                self.history.append(record)
                mfu = "n/a" if peak is None else f"{record['mfu']:.2%}"
                self.log(
                    f"step {self.step}/{c.steps}  loss {loss:.4f}  "
                    f"tokens/s {record['tokens_per_s']:.0f}  step_time {seconds:.3f}s  mfu {mfu}"
                    + ("" if moe is None else _moe_line(moe))
                )
                if self.checkpointer is not None:
                    self.save()
                self.write_log()
        finally:
            if self.checkpointer is not None:
                self.save(force=True)
                self.checkpointer.close()
            self.write_log()
        if c.export_hf:
            self.export_hf(c.export_hf)
        return losses

    def export_hf(self, path):
        """Writes the model as a Hugging Face checkpoint directory (`sf.models.hf.save_hf`)."""
        from shardfuse.models import hf

        hf.save_hf(self.model, path)
        self.log(f"exported the model to {path} (Hugging Face format)")

    def save(self, force: bool = False):
        self.checkpointer.save(
            self.step,
            self.model,
            self.optimizer,
            data_position={"next_batch": self.step},
            force=force,
        )

    def write_log(self):
        path = self.config.log_json
        if not path or not distributed.is_primary():
            return
        config = dataclasses.asdict(self.config)
        payload = dict(config=config, devices=jax.device_count(), steps=self.history)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        os.replace(tmp, path)


def run(config: TrainConfig, log=print) -> list[float]:
    """Builds a `Trainer` for `config` and runs it; returns the losses."""
    return Trainer(config, log=log).run()
