"""The `Example usage::` blocks of the layer docstrings run and print what they show."""

import doctest

import pytest

from shardfuse.layers import (
    _sharding,
    attention,
    block,
    linear,
    mlp,
    moe,
    moe_capped,
    options,
    router,
    row_linear,
)


@pytest.mark.parametrize(
    "module",
    [linear, row_linear, mlp, moe, moe_capped, router, attention, block, options, _sharding],
    ids=lambda m: m.__name__,
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0, f"{result.failed} failing examples in {module.__name__}"
