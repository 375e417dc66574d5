"""The `Example usage::` blocks of the pipeline modules and `Stack` run and print what they show."""

import doctest

import pytest

from shardfuse.layers import stack
from shardfuse.parallel.pipeline import api, balance, lockstep, plot, schedule

SLOW = pytest.mark.slow  # each compiles a pipelined (or stacked) transformer program


@pytest.mark.parametrize(
    "module",
    [
        schedule,
        lockstep,
        balance,
        pytest.param(plot),
        pytest.param(stack, marks=SLOW),
        pytest.param(api, marks=SLOW),
    ],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    if module is plot:
        pytest.importorskip("matplotlib")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0, f"{result.failed} failing examples in {module.__name__}"
