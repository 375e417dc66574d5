"""The planner's results do not change under a refactoring: a few problems, every plan in full.

`bench/planner_golden.py --quick` runs `sf.plan` on a few cheap problems (the published
runs' pinned parallelisms, a problem no plan respects, a mixture of experts, two generated
problems, one of them also with the branch and bound off) and records every returned
plan's `Parallelism` and `Estimate` (every term, value and formula) or the
`PlanningError`'s message. tests/planner/golden_plans.json holds what the search wrote
before its speed-ups (commit c9c66e3: 0366ee4 with the MoE cost terms of bcc9f35 and
c9c66e3, which change what the search returns); the search must still write exactly that. The
script's full run (every published run, more generated problems) is the wider check.
"""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = Path(__file__).with_name("golden_plans.json")


def _golden():
    spec = importlib.util.spec_from_file_location(
        "planner_golden", ROOT / "bench" / "planner_golden.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quick_problems_give_the_recorded_plans():
    golden = _golden()
    results = golden.run(golden.quick_problems(), golden.QUICK_EXHAUSTIVE)
    expected = json.loads(EXPECTED.read_text())
    assert sorted(results) == sorted(expected)
    for name, result in results.items():
        assert result == expected[name], f"{name}: the plans differ from golden_plans.json"
