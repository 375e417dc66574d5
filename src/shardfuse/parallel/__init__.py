"""Whole-model parallelism over NNX models built from `shardfuse.layers`.

- `Pipeline` (`pipeline/`): a `shardfuse.layers.Stack` split into stages over
  the `pipeline` axis, run by "gpipe", "1f1b", "interleaved" or "zb-h1" in one
  jitted program; `schedule_table` is the schedule as data;
  `balance_stages` the split of the layers that minimises the slowest stage.
- `ZeroOptimizer`, `init` (`zero.py`): ZeRO-1/2/3 optimizer state sharded over
  `fsdp`, models and optimizers born sharded (`init_program`,
  `optimizer_state_program`: those programs, to measure their memory); `zero=` on the layers shards
  parameters (ZeRO-3).
- `accumulate` (`accumulate.py`): token-weighted gradient accumulation over
  microbatches, reduced once per step.
- `RunOptions` (`options.py`): the choices of a run (ZeRO stage, remat,
  prefetch, microbatches, pipeline schedule, ring layout), each checked once;
  the layers' `LayerOptions` derive from them.
- `parallelize` (`parallelize.py`): a `ModelSpec` and `RunOptions` (or a
  planner `Plan`, which converts itself) -> the model, the optimizer and the
  jitted step, each parallelism applied once in one documented order.
- `Checkpointer` (`checkpoint.py`): orbax checkpoints, restored onto any mesh.
- `distributed`: `jax.distributed.initialize` from flags or environment, and
  per-process batch loading.

Data flows one way: planner -> parallel -> layers; this package composes
layers into models and training steps; of the kernels it uses only the
bottom-level varying-axes helpers (`shardfuse.kernels.vma`), as every level does.
"""

from shardfuse.parallel import distributed
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.checkpoint import Checkpointer
from shardfuse.parallel.options import RunOptions
from shardfuse.parallel.parallelize import Run, parallelize
from shardfuse.parallel.pipeline import (
    SCHEDULES,
    Pipeline,
    ScheduleTable,
    balance_stages,
    schedule_table,
)
from shardfuse.parallel.zero import ZeroOptimizer, init, init_program, optimizer_state_program

__all__ = [
    "SCHEDULES",
    "Checkpointer",
    "Pipeline",
    "ScheduleTable",
    "Run",
    "RunOptions",
    "ZeroOptimizer",
    "accumulate",
    "balance_stages",
    "distributed",
    "init",
    "init_program",
    "optimizer_state_program",
    "parallelize",
    "schedule_table",
]
