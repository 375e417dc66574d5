"""`RunOptions`: the choices of a training run, each defined and checked once.

The vocabulary of a run, what `sf.parallel.parallelize` applies besides the
mesh, and what a planner `Plan`, the `Trainer`'s `TrainConfig` and the
planner's search points (`sf.planner.Parallelism`) hold as one value instead
of copies of its fields. Each choice is checked by the options that own it:

- `zero`, `remat`, `prefetch`, `sequence_parallel`: the layers' options,
  `sf.layers.LayerOptions` (`layer_options()` derives them from these options
  and so checks them);
- `num_microbatches`, `schedule`, `virtual_stages`: the pipeline schedule
  (`schedule.check_schedule`; `Pipeline` checks them again against the size of
  the pipeline axis, which the options do not know);
- `layout`: the ring (`ring_attention.layouts.check_layout`).

`num_microbatches` is the one name of the microbatch count, as in
`sf.parallel.Pipeline` and `sf.parallel.accumulate`; `microbatches=` is a
deprecated keyword of the constructor (and `.microbatches` a deprecated
attribute) for one release.
"""

import dataclasses
import warnings

from shardfuse._keywords import renamed_keywords
from shardfuse.collectives.ring_attention.layouts import check_layout
from shardfuse.layers.options import LayerOptions
from shardfuse.parallel.pipeline.schedule import check_schedule


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a training run is laid out: what `parallelize` applies, besides the mesh.

    Fields:
      zero: ZeRO stage 0..3 over the `fsdp` axis.
      remat: activation checkpointing policy of each layer (`shardfuse.flops.REMAT_POLICIES`).
      prefetch: ZeRO-3: each layer's weights gathered while the layer before it
        computes (`sf.layers.Stack`'s prefetch, `shardfuse.layers.prefetch`).
      sequence_parallel: Megatron sequence parallelism over `model`.
      num_microbatches: pipeline microbatches (pipeline axis > 1), else gradient
        accumulation steps.
      schedule: pipeline schedule (`sf.parallel.SCHEDULES`).
      virtual_stages: model chunks per pipeline stage (interleaved schedules).
      layout: ring layout of the sequence over `sequence` ("zigzag", ...).
      mesh_shape: the mesh sizes these options were made for (a plan's), or
        None; `parallelize` checks them against its mesh.

    Raises:
      ValueError, TypeError: a choice outside its valid values, named by the
        check of the options that own it (see the module docstring).

    Example usage::

      >>> from shardfuse.parallel import RunOptions
      >>> RunOptions(zero=3, num_microbatches=2).replace(remat="full").remat
      'full'
      >>> RunOptions(zero=3, prefetch=True).layer_options().prefetch
      True
      >>> RunOptions(zero=4)
      Traceback (most recent call last):
      ...
      ValueError: zero=4 must be one of (0, 1, 2, 3) (the ZeRO stage)
    """

    zero: int = 0
    remat: str = "none"
    prefetch: bool = False
    sequence_parallel: bool = True
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    layout: str = "zigzag"
    mesh_shape: dict | None = None

    def __post_init__(self):
        self.layer_options()  # zero, remat, prefetch, sequence_parallel: the layers' checks
        check_schedule(self.schedule, 1, self.num_microbatches, self.virtual_stages)
        check_layout(self.layout)

    def layer_options(self, mesh=None, **changes) -> LayerOptions:
        """The `sf.layers.LayerOptions` of this run's layers on `mesh`, with `changes`.

        ZeRO stage, remat policy, prefetch and sequence parallelism; the axes
        are the default names (`shardfuse.axes`), absent ones not sharded;
        `changes` set other fields (`dtype=jnp.bfloat16`, ...).

        Example usage::

          >>> import jax
          >>> from shardfuse.parallel import RunOptions
          >>> mesh = jax.make_mesh((2, 4), ("fsdp", "model"))
          >>> RunOptions(zero=3).layer_options(mesh).zero_options().param_axis
          'fsdp'
        """
        return LayerOptions(
            mesh=mesh,
            zero=self.zero,
            remat=self.remat,
            prefetch=self.prefetch,
            sequence_parallel=self.sequence_parallel,
        ).replace(**changes)

    def replace(self, **changes) -> "RunOptions":
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    def run_options(self) -> "RunOptions":
        """Itself (the conversion `parallelize` calls on a plan)."""
        return self

    @property
    def microbatches(self) -> int:
        """Deprecated: `num_microbatches`."""
        warnings.warn(
            "RunOptions.microbatches is deprecated and will be removed in the next release: use "
            "RunOptions.num_microbatches",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.num_microbatches


RunOptions.__init__ = renamed_keywords(microbatches="num_microbatches")(RunOptions.__init__)

__all__ = ["RunOptions"]
