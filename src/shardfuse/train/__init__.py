"""Training runs in the library: `Trainer` over `sf.parallel.parallelize`, from a config or plan.

- `TrainConfig`, `Trainer`, `run` (`trainer.py`): the mesh (multi-host through
  `sf.parallel.distributed`), the model, optimizer and step from
  `sf.parallel.parallelize`, batches loaded per process, per-step metrics
  (loss, tokens/s, step time, MFU via `sf.flops`), a JSON log, orbax
  checkpoints with resumption on any mesh;
- `plan_for`, `planned`, `from_plan`, `parallelism_of`, `estimate_for`: the
  planner's view of a run (plan it; take a plan's mesh and options; the
  `sf.planner.Parallelism` and the predicted cost of a config);
- `data`: deterministic token streams (`SyntheticTokens`, `TextTokens`).

This package sits on top of the planner (it reads plans): planner -> parallel
keeps the direction (a `Plan` converts itself into `sf.parallel.RunOptions`);
`train` is the one place both meet. `examples/train_lm.py` is its command line.

Example usage::

  >>> from shardfuse.train import TrainConfig, Trainer
  >>> from shardfuse.models import ModelSpec
  >>> config = TrainConfig(mesh={"data": 8}, steps=1, model=ModelSpec.tiny(num_layers=1))
  >>> trainer = Trainer(config, log=print)
  >>> len(trainer.run()) == 1 and trainer.history[0]["loss"] > 0  # doctest: +ELLIPSIS
  step 1/1 ...
  True
"""

from shardfuse.train import data
from shardfuse.train.data import SyntheticTokens, TextTokens
from shardfuse.train.trainer import (
    AXES,
    COMPUTE_DTYPE,
    TrainConfig,
    Trainer,
    estimate_for,
    from_plan,
    parallelism_of,
    parse_mesh,
    plan_for,
    planned,
    run,
    step_memory,
)
from shardfuse.train.trainer import (
    layout_of as layout_of,  # deprecated: parallelism_of
)

__all__ = [
    "AXES",
    "COMPUTE_DTYPE",
    "SyntheticTokens",
    "TextTokens",
    "TrainConfig",
    "Trainer",
    "data",
    "estimate_for",
    "from_plan",
    "parallelism_of",
    "parse_mesh",
    "plan_for",
    "planned",
    "run",
    "step_memory",
]
