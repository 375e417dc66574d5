"""The planner's results do not change under a refactoring: a few problems, every plan in full.

`bench/planner_golden.py --quick` runs `sf.plan` on a few cheap problems (the published
runs' pinned parallelisms, a problem no plan respects, a mixture of experts, two generated
problems, one of them also with the branch and bound off) and records every returned
plan's `Parallelism` and `Estimate` (every term, value and formula) or the
`PlanningError`'s message. tests/planner/golden_plans.json holds what the search wrote
before its speed-ups (commit c9c66e3: 0366ee4 with the MoE cost terms of bcc9f35 and
c9c66e3, which change what the search returns); the search must still write exactly that
(each number to 1e-12 relative: the two Python versions CI runs sum floats differently). The
script's full run (every published run, more generated problems) is the wider check.
"""

import importlib.util
import json
import math
import re
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


# A float in a repr: the recorded text must match everywhere else, and each number to 1e-12
# relative (Python 3.12's `sum` of floats is compensated, 3.11's is not: the last digit of
# a sum may differ between the stacks CI runs).
_NUMBER = re.compile(r"-?\d+\.\d*(?:e[-+]?\d+)?|-?\d+e[-+]?\d+")


def _same(got, want) -> bool:
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_same(g, w) for g, w in zip(got, want, strict=True))
        )
    if not isinstance(want, str) or not isinstance(got, str):
        return got == want
    if _NUMBER.sub("#", got) != _NUMBER.sub("#", want):
        return False
    pairs = zip(_NUMBER.findall(got), _NUMBER.findall(want), strict=True)
    return all(math.isclose(float(g), float(w), rel_tol=1e-12, abs_tol=0.0) for g, w in pairs)


def test_the_quick_problems_give_the_recorded_plans():
    golden = _golden()
    results = golden.run(golden.quick_problems(), golden.QUICK_EXHAUSTIVE)
    expected = json.loads(EXPECTED.read_text())
    assert sorted(results) == sorted(expected)
    for name, result in results.items():
        assert _same(result, expected[name]), f"{name}: the plans differ from golden_plans.json"


def test_the_comparison_sees_a_changed_number_or_word():
    def plans(text):
        return {"plans": [[text]]}

    want = plans("Term(name='compute', value=2.39556358540925, formula='x 0.653')")
    assert _same(plans("Term(name='compute', value=2.395563585409251, formula='x 0.653')"), want)
    for changed in (
        "Term(name='compute', value=2.39556358541925, formula='x 0.653')",  # 11th digit
        "Term(name='compute', value=2.39556358540925, formula='x 0.654')",  # a number in text
        "Term(name='elementwise', value=2.39556358540925, formula='x 0.653')",  # a word
        "Term(name='compute', value=2.39556358540925, formula='x 0.653', total=None)",
    ):
        assert not _same(plans(changed), want), changed
