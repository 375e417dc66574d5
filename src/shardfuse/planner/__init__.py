"""The planner: a mesh and options for a model on a cluster, from an analytic cost model.

`plan(model, cluster, global_batch=..., seq_len=...)` searches mesh shapes
and options (`search`: each point a `Parallelism`, the run's options embedded
as one `sf.parallel.RunOptions`), predicts each one's step time and memory per
device (`cost`, every term named), and returns the fastest that fit as
`Plan`s, which build their mesh and convert themselves into the run's options
(`Plan.run_options()`, what `sf.parallel.parallelize` takes). `shardfuse plan`
is its command line (`cli`).

Example usage::

  >>> from shardfuse import hardware, models
  >>> from shardfuse.planner import plan
  >>> best = plan(models.get("llama3-70b"), hardware.cluster("h100", nodes=8),
  ...             global_batch=512, seq_len=8192)[0]
  >>> best.parallelism.num_devices
  64
"""

from shardfuse.planner.choices import mesh_shapes
from shardfuse.planner.constraints import parallelism_constraints
from shardfuse.planner.cost import Estimate, estimate
from shardfuse.planner.options import (
    CP_STRATEGIES,
    MESH_AXES,
    REMAT_POLICIES,
    SCHEDULES,
    ZERO_STAGES,
    Assumptions,
    Parallelism,
)
from shardfuse.planner.options import (
    Layout as Layout,  # deprecated: Parallelism.of
)
from shardfuse.planner.plans import Plan
from shardfuse.planner.search import PlanningError, plan
from shardfuse.planner.terms import Term


def __getattr__(name):
    if name == "layout_constraints":  # its name in earlier releases
        import warnings

        warnings.warn(
            "sf.planner.layout_constraints is deprecated and will be removed in the next "
            "release: use sf.planner.parallelism_constraints",
            DeprecationWarning,
            stacklevel=2,
        )
        return parallelism_constraints
    raise AttributeError(f"module 'shardfuse.planner' has no attribute {name!r}")


__all__ = [
    "CP_STRATEGIES",
    "MESH_AXES",
    "REMAT_POLICIES",
    "SCHEDULES",
    "ZERO_STAGES",
    "Assumptions",
    "Estimate",
    "Parallelism",
    "Plan",
    "PlanningError",
    "Term",
    "estimate",
    "parallelism_constraints",
    "mesh_shapes",
    "plan",
]
