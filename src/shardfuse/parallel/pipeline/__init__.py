"""Pipeline parallelism: schedules as data (`schedule`), one SPMD executor, `Pipeline`.

`schedule_table(schedule, p, m, v)` builds the action table of "gpipe",
"1f1b", "interleaved" or "zb-h1"; `Pipeline` runs a `shardfuse.layers.Stack`
by that table in one jitted program; `shardfuse pipeline` prints and draws it.
"""

from shardfuse.parallel.pipeline.api import Pipeline, cross_entropy
from shardfuse.parallel.pipeline.schedule import (
    SCHEDULES,
    ScheduleTable,
    closed_form_bubble,
    schedule_table,
)

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "ScheduleTable",
    "closed_form_bubble",
    "cross_entropy",
    "schedule_table",
]
