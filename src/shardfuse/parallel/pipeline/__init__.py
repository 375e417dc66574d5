"""Pipeline parallelism: schedules as data (`schedule`), one SPMD executor, `Pipeline`.

`schedule_table(schedule, p, m, v)` builds the action table of "gpipe",
"1f1b", "interleaved" or "zb-h1"; `Pipeline` runs a `shardfuse.layers.Stack`
by that table in one jitted program; `shardfuse pipeline` prints and draws it.
`balance_stages` splits layers over stages unevenly, minimising the slowest
(`Stack(..., stage_layers=...)`).
"""

from shardfuse.parallel.pipeline.api import Pipeline
from shardfuse.parallel.pipeline.balance import balance_stages, stage_costs
from shardfuse.parallel.pipeline.schedule import (
    SCHEDULES,
    ScheduleTable,
    closed_form_bubble,
    schedule_table,
)

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "balance_stages",
    "ScheduleTable",
    "closed_form_bubble",
    "schedule_table",
    "stage_costs",
]
