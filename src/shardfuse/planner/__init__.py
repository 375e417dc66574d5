"""The planner: a parallel layout for a model on a cluster, from an analytic cost model.

`plan(model, cluster, global_batch=..., seq_len=...)` searches mesh shapes
and options (`search`), predicts each one's step time and memory per device
(`cost`, every term named), and returns the fastest that fit as `Plan`s,
which build their mesh and the keyword arguments of the layers, pipeline
and ZeRO. `shardfuse plan` is its command line (`cli`).

Example usage::

  >>> from shardfuse import hardware, models
  >>> from shardfuse.planner import plan
  >>> best = plan(models.get("llama3-70b"), hardware.cluster("h100", nodes=8),
  ...             global_batch=512, seq_len=8192)[0]
  >>> best.layout.num_devices
  64
"""

from shardfuse.planner.constraints import layout_constraints
from shardfuse.planner.cost import Estimate, estimate
from shardfuse.planner.options import (
    CP_STRATEGIES,
    MESH_AXES,
    REMAT_POLICIES,
    SCHEDULES,
    ZERO_STAGES,
    Assumptions,
    Layout,
)
from shardfuse.planner.plans import Plan
from shardfuse.planner.search import PlanningError, mesh_shapes, plan
from shardfuse.planner.terms import Term

__all__ = [
    "CP_STRATEGIES",
    "MESH_AXES",
    "REMAT_POLICIES",
    "SCHEDULES",
    "ZERO_STAGES",
    "Assumptions",
    "Estimate",
    "Layout",
    "Plan",
    "PlanningError",
    "Term",
    "estimate",
    "layout_constraints",
    "mesh_shapes",
    "plan",
]
