"""The `Example usage::` blocks of the planner and data-module docstrings run (8 CPU devices)."""

import doctest

import pytest

from shardfuse import axes, hardware, model_spec, models
from shardfuse.planner import (
    calibrate,
    cli,
    comm,
    constraints,
    cost,
    efficiency,
    memory,
    options,
    pipeline_time,
    plans,
    published,
    search,
)

MODULES = [axes, hardware, models, model_spec, options, cost, memory, constraints, plans, search,
           cli, efficiency, comm, pipeline_time, published, calibrate]  # fmt: skip


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0, f"{result.failed} failing examples in {module.__name__}"
