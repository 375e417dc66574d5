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
- `layout`: the ring (`ring_attention.layouts.check_layout`);
- `capacity_factor`, `aux_loss_coef`, `z_loss_coef`: the mixture-of-experts
  blocks' (issue 44), checked here (`check_moe_options`): `sf.layers.LayerOptions`
  has no such fields, so the MoE layers (`sf.layers.ParallelMoE`) and the losses
  that add their auxiliary terms (`token_loss`, `parallelize`, the Trainer) read
  them from these options.

`num_microbatches` is the one name of the microbatch count, as in
`sf.parallel.Pipeline` and `sf.parallel.accumulate`; `microbatches=` is a
deprecated keyword of the constructor (and `.microbatches` a deprecated
attribute) for one release.
"""

import dataclasses
import functools
import math
import warnings

from shardfuse._keywords import renamed_keywords
from shardfuse.collectives.ring_attention.layouts import check_layout
from shardfuse.layers.moe import check_dispatch_chunks
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
      capacity_factor: mixture of experts: None (default) dropless, every routed
        token computed; a number > 0: each expert takes at most
        `ceil(capacity_factor x tokens x top_k / experts)` tokens per batch shard,
        the rest dropped (counted and reported by the MoE layer, never silent).
      dispatch_chunks: mixture of experts with expert parallelism: the routed rows in
        this many chunks, each dispatched, computed and combined on its own so that
        asynchronous collectives (GPU, TPU) overlap the expert compute
        (`sf.layers.ParallelMoE`'s `dispatch_chunks`); default 1.
      aux_loss_coef: coefficient of the Switch load-balancing loss (Fedus et al.
        2021: `experts x sum_e f_e P_e`, f the fraction of routed tokens, P the mean
        router probability of expert e) added to the training loss; default 0.01
        (Switch Transformer; Mixtral's transformers config uses 0.001 for
        fine-tuning), 0 turns it off.
      z_loss_coef: coefficient of the router z-loss (Zoph et al. 2022, ST-MoE:
        the mean of `logsumexp(router logits)^2`); default 0.0 (ST-MoE uses 1e-3).

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
    capacity_factor: float | None = None
    dispatch_chunks: int = 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0

    def __post_init__(self):
        choices = tuple(getattr(self, name) for name in _CHECKED)
        if all(type(value) in _SCALARS for value in choices):
            _check_scalar_choices(*choices)  # each distinct value checked once
        else:
            _check_choices(*choices)

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


# The fields `RunOptions.__post_init__` checks, in `_check_choices`' order; `mesh_shape` is
# `parallelize`'s to check against its mesh.
_CHECKED = (
    "zero", "remat", "prefetch", "sequence_parallel", "num_microbatches", "schedule",
    "virtual_stages", "layout", "capacity_factor", "aux_loss_coef", "z_loss_coef",
    "dispatch_chunks",
)  # fmt: skip
_SCALARS = (type(None), bool, int, float, str)


def _check_choices(zero, remat, prefetch, sequence_parallel, num_microbatches, schedule,
                   virtual_stages, layout, capacity_factor, aux_loss_coef, z_loss_coef,
                   dispatch_chunks) -> None:  # fmt: skip
    """ValueError or TypeError, from the options that own it, unless every choice is valid."""
    LayerOptions(zero=zero, remat=remat, prefetch=prefetch, sequence_parallel=sequence_parallel)
    check_schedule(schedule, 1, num_microbatches, virtual_stages)
    check_layout(layout)
    check_moe_options(capacity_factor, aux_loss_coef, z_loss_coef, dispatch_chunks)


# A pure function of scalars, keyed by their types too (`typed`: True is not 1): the planner
# builds the same few options tens of thousands of times a search. Errors are not cached.
_check_scalar_choices = functools.lru_cache(maxsize=8192, typed=True)(_check_choices)


def check_moe_options(capacity_factor, aux_loss_coef, z_loss_coef, dispatch_chunks=1) -> None:
    """ValueError naming the option unless the mixture-of-experts options are valid.

    `capacity_factor`: None (dropless) or a finite number > 0; `aux_loss_coef`
    and `z_loss_coef`: finite numbers >= 0; `dispatch_chunks`: an int >= 1.

    Example usage::

      >>> from shardfuse.parallel.options import check_moe_options
      >>> check_moe_options(1.25, 0.01, 1e-3)
      >>> check_moe_options(0, 0.01, 0.0)
      Traceback (most recent call last):
      ...
      ValueError: capacity_factor=0 must be None (dropless) or a number > 0
    """

    def number(value):
        return (
            not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
        )

    if capacity_factor is not None and not (number(capacity_factor) and capacity_factor > 0):
        raise ValueError(
            f"capacity_factor={capacity_factor!r} must be None (dropless) or a number > 0"
        )
    check_dispatch_chunks(dispatch_chunks)
    for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
        if not (number(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a number >= 0 (0 turns the loss off)")


RunOptions.__init__ = renamed_keywords(microbatches="num_microbatches")(RunOptions.__init__)

__all__ = ["RunOptions"]
