"""`shardfuse profile` and `sf.profile`: a step's time by category from a `jax.profiler` trace.

    report = sf.profile(step, *args, steps=5)   # warm-up, then 5 traced steps
    print(report.table())                        # compute (matmul, attention, other),
                                                 # each collective kind (exposed / overlapped),
                                                 # idle, the top ops, the planner, advice

Modules: `api` (run and summarize), `trace` (read the trace JSON jax writes),
`hlo` (what each compiled instruction is), `timeline` (label every instant
of a step so that the categories sum to it), `report` (`Profile`, the table,
the advice rules), `cli` (`shardfuse profile` on the training example).

`sf.profile` is this package, and calling it calls `profile`: one name for
the function and its namespace (`sf.profile(step, x)`, `sf.profile.Profile`,
`import shardfuse.profile.cli` all work).
"""

import sys
import types

from shardfuse.profile.api import profile, summarize
from shardfuse.profile.report import Profile

__all__ = ["Profile", "profile", "summarize"]


class _CallableModule(types.ModuleType):
    """The package, callable as `profile` (so that `sf.profile(step, *args)` runs it)."""

    def __call__(self, step, *args, **kwargs) -> Profile:
        return profile(step, *args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
