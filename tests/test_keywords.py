"""Keyword plumbing in one module: `passes_keywords` (keywords listed once, in the signature of
the function that reads them), `option_keywords`, `renamed_keywords`."""

import doctest
import inspect

import pytest

from shardfuse import _keywords
from shardfuse._keywords import passes_keywords


def _read(*, alpha=1, beta: str = "b", gamma=None):
    return alpha, beta, gamma


def test_docstring_examples():
    assert doctest.testmod(_keywords, optionflags=doctest.ELLIPSIS).failed == 0


def test_signature_values_and_errors():
    @passes_keywords(_read, ("alpha", "beta"), after="mode")
    def pass_on(x, *, mode="m", last=0, **kw):
        return x, mode, last, _read(**kw)

    parameters = inspect.signature(pass_on).parameters
    assert list(parameters) == ["x", "mode", "alpha", "beta", "last"]
    assert parameters["beta"] == inspect.signature(_read).parameters["beta"]  # default, annotation
    assert pass_on(1, beta="B", last=2) == (1, "m", 2, (1, "B", None))
    with pytest.raises(TypeError, match=r"pass_on\(\) got an unexpected keyword argument 'gamma'; "
                       r"its keywords are x, mode, alpha, beta, last"):  # fmt: skip
        pass_on(1, gamma=3)  # a keyword of the source that is not passed on

    class Layer:
        @passes_keywords(_read)
        def __init__(self, **kw):
            self.values = _read(**kw)

    assert Layer(gamma=3).values == (1, "b", 3)
    with pytest.raises(TypeError, match=r"^Layer\(\) got an unexpected keyword argument 'delta'"):
        Layer(delta=4)


def test_bad_declarations_fail_at_decoration():
    with pytest.raises(TypeError, match=r"_read takes no keyword \['delta'\]"):
        passes_keywords(_read, ("alpha", "delta"))
    with pytest.raises(TypeError, match=r"must take \*\*kwargs"):
        passes_keywords(_read)(lambda x: x)


def test_keyword_forwarding_lives_in_one_module():
    """`passes_keywords`, `option_keywords`, `renamed_keywords`, `moved_keywords`: defined once, in
    `shardfuse._keywords`; the layers' `option_keywords` is that decorator for `LayerOptions`."""
    from pathlib import Path

    from shardfuse.layers import options as options_lib

    root = Path(_keywords.__file__).parent
    names = ("passes_keywords", "option_keywords", "renamed_keywords", "moved_keywords")
    homes = {
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        for line in path.read_text().splitlines()
        if any(line.startswith(f"def {name}(") for name in names)
    }
    assert homes == {"_keywords.py"}, homes
    assert options_lib.UNSET is _keywords.UNSET
    assert options_lib.option_keywords.__qualname__.startswith("option_keywords.")
