"""Keyword plumbing, in one place: keywords passed on, option keywords, renamed keywords.

Three decorators shape the keywords of the public functions and layers; every
package uses these and none writes its own:

- `passes_keywords(source)`: keywords a function takes only to hand them on,
  listed once, in the signature of the function that reads them (below);
- `option_keywords(fields, resolve)`: every field of an options object (the
  layers' `LayerOptions`) accepted as a keyword that overrides that field of
  the `options=` argument, `UNSET` marking a keyword not given;
- `renamed_keywords(old=new)`: a deprecated keyword name still accepted, with a
  `DeprecationWarning`, for one release; `moved_keywords(into, make, old=new)`
  the same for keywords that became fields of an options argument.

Keywords passed on:

A public function or layer often takes keywords that it does not read itself but
passes on, unread, to the function that does: `sf.flash_attention` and both ring
attentions hand the static attention options to `validate`, a transformer block
hands the attention keywords to its `ParallelSelfAttention`, a linear layer hands
the shared ones to the base class. Written out by hand, such a keyword list is
repeated in every signature (with its defaults, which then drift) and forwarded
name by name. `passes_keywords` keeps one list, the signature of the function
that reads them: the wrapper takes them as `**kwargs` and shows them in its own
signature (`help()`, `inspect.signature`, the API reference), so that a caller
sees every keyword it may pass.
"""

import functools
import inspect
import warnings


class _Unset:
    """The type of `UNSET`: a keyword that was not given."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "UNSET"

    def __reduce__(self):
        return (_Unset, ())


UNSET = _Unset()  # "not given": the default of every option keyword of a layer


UNSET = _Unset()  # "not given": the default of every option keyword of a layer


def passes_keywords(source, names=None, *, after: str | None = None):
    """Decorator of `fn(..., **kwargs)` whose `kwargs` are keywords of `source`, passed on unread.

    The decorated function takes `names` (None: every keyword-only parameter
    of `source`) besides its own parameters; its signature lists them, with
    `source`'s defaults and annotations, after the parameter `after` (None:
    first among the keyword-only ones). Any other keyword raises a TypeError
    naming the function (the class, for an `__init__`) and the keywords it
    takes, before `fn` runs.

    Args:
      source: the function that reads the keywords (its signature is their one home).
      names: the keywords of `source` that `fn` takes, or None for all its keyword-only ones.
      after: the parameter of `fn` they follow in the signature shown.

    Raises:
      TypeError: at decoration, `fn` has no `**kwargs`, or `names` holds a keyword
        that `source` lacks.

    Example:
      >>> import inspect
      >>> def draw(*, color="red", width=1):
      ...     return f"{color}/{width}"
      >>> @passes_keywords(draw)
      ... def shape(sides, *, filled=False, **style):
      ...     return sides, filled, draw(**style)
      >>> inspect.signature(shape)
      <Signature (sides, *, color='red', width=1, filled=False)>
      >>> shape(3, width=2)
      (3, False, 'red/2')
      >>> shape(3, colour="blue")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      TypeError: shape() got an unexpected keyword argument 'colour'; its keywords are sides, ...
    """
    available = inspect.signature(source).parameters
    if names is None:
        names = [p.name for p in available.values() if p.kind is p.KEYWORD_ONLY]
    missing = [name for name in names if name not in available]
    if missing:
        raise TypeError(f"{source.__qualname__} takes no keyword {missing}")
    passed = [available[name].replace(kind=inspect.Parameter.KEYWORD_ONLY) for name in names]

    def decorate(fn):
        signature = inspect.signature(fn)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        if len(own) == len(signature.parameters):
            raise TypeError(f"{fn.__qualname__} must take **kwargs to pass keywords on")
        if after is None:
            at = next((i for i, p in enumerate(own) if p.kind is p.KEYWORD_ONLY), len(own))
        else:
            at = [p.name for p in own].index(after) + 1
        parameters = [*own[:at], *passed, *own[at:]]
        accepted = [p.name for p in parameters if p.kind is not p.POSITIONAL_ONLY]
        accepted = [name for name in accepted if name != "self"]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for name in kwargs:
                if name not in accepted:
                    caller = type(args[0]).__name__ if fn.__name__ == "__init__" else fn.__name__
                    raise TypeError(
                        f"{caller}() got an unexpected keyword argument {name!r}; "
                        f"its keywords are {', '.join(accepted)}"
                    )
            return fn(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=parameters)
        return wrapper

    return decorate


def option_keywords(fields, resolve):
    """Decorator factory: an `__init__` taking `options=` accepts every field of it as a keyword.

    The decorated `__init__(self, ..., options, ...)` receives `options` already
    resolved, `resolve(options, **given)` (the caller's `options=`, or the
    defaults, with the field keywords the caller gave applied) and never sees
    the field keywords themselves. The signature shown by `help` and
    `inspect.signature` lists them after `options`, defaulting to `UNSET` (not
    given: unlike None, which is a value). `sf.layers.options.option_keywords`
    is this for `LayerOptions`.

    Args:
      fields: the names of the options' fields.
      resolve: `resolve(options, **given) -> options`.

    Raises:
      TypeError: at decoration, the `__init__` takes no `options` keyword, or takes
        one of the fields itself.

    Example:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Style:
      ...     color: str = "red"
      >>> def resolve(options, **given):
      ...     return dataclasses.replace(options or Style(), **given)
      >>> class Shape:
      ...     @option_keywords(("color",), resolve)
      ...     def __init__(self, sides, *, options):
      ...         self.options = options
      >>> Shape(3, color="blue").options
      Style(color='blue')
    """
    fields = tuple(fields)

    def decorate(init):
        signature = inspect.signature(init)
        params = list(signature.parameters.values())
        if "options" not in signature.parameters:
            raise TypeError(f"{init.__qualname__} must take an `options` keyword")
        clash = set(signature.parameters) & (set(fields) - {"options"})
        if clash:
            raise TypeError(f"{init.__qualname__} takes option fields {sorted(clash)} itself")

        @functools.wraps(init)
        def wrapper(self, *args, options=None, **kwargs):
            given = {name: kwargs.pop(name) for name in fields if name in kwargs}
            given = {name: value for name, value in given.items() if value is not UNSET}
            return init(self, *args, options=resolve(options, **given), **kwargs)

        # help() / inspect.signature: the option keywords after `options`, before `rngs`
        index = next(i for i, p in enumerate(params) if p.name == "options")
        extra = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=UNSET)
            for name in fields
        ]
        options_param = params[index].replace(default=None)
        wrapper.__signature__ = signature.replace(
            parameters=[*params[:index], options_param, *extra, *params[index + 1 :]]
        )
        return wrapper

    return decorate


def renamed_keywords(**old_to_new):
    """Decorator: deprecated keyword `old` still works as `new` for one release.

    Passing `old` warns with a DeprecationWarning naming `new`; passing both
    raises TypeError. On an `__init__` the messages name the class. Used by the
    global wrappers and the layers alike.

    Example:
      >>> @renamed_keywords(seq_axis="sequence_axis")
      ... def attend(*, sequence_axis="sequence"):
      ...     return sequence_axis
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     attend(seq_axis="ring")
      'ring'
      >>> print(caught[0].message)
      attend(seq_axis=...) is deprecated and will be removed in the next release: use sequence_axis=
    """

    def decorate(fn):
        is_init = fn.__name__ == "__init__"

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = type(args[0]).__name__ if is_init else fn.__name__
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(
                        f"{name}() got both {old}= (deprecated) and {new}=: pass {new}= only"
                    )
                warnings.warn(
                    f"{name}({old}=...) is deprecated and will be removed in the next "
                    f"release: use {new}=",
                    DeprecationWarning,
                    # An __init__ is reached through the class's (NNX metaclass) __call__.
                    stacklevel=3 if is_init else 2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def moved_keywords(into: str, make, **old_to_new):
    """Decorator: deprecated keyword `old` still works as field `new` of the argument `into`.

    For keywords that were copies of an options object's fields (`TrainConfig(zero=1)`
    before `TrainConfig(options=RunOptions(zero=1))`): passing `old` warns with a
    DeprecationWarning naming the new spelling and sets `new` on the `into=` argument
    (`make()` when it is not given) with its `replace`. On an `__init__` the
    messages name the class.

    Example:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Style:
      ...     color: str = "red"
      ...     def replace(self, **changes):
      ...         return dataclasses.replace(self, **changes)
      >>> @moved_keywords("style", Style, colour="color")
      ... def draw(*, style=Style()):
      ...     return style.color
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     draw(colour="blue")
      'blue'
      >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
      draw(colour=...) is deprecated and will be removed in the next release:
      use style=Style(color=...)
    """

    def decorate(fn):
        is_init = fn.__name__ == "__init__"

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            moved = {old: kwargs.pop(old) for old in old_to_new if old in kwargs}
            if moved:
                name = type(args[0]).__name__ if is_init else fn.__name__
                given = ", ".join(f"{old}=..." for old in moved)
                fields = ", ".join(f"{old_to_new[old]}=..." for old in moved)
                warnings.warn(
                    f"{name}({given}) is deprecated and will be removed in the next release: "
                    f"use {into}={make.__name__}({fields})",
                    DeprecationWarning,
                    stacklevel=2,
                )
                target = kwargs.get(into)
                target = make() if target is None else target
                kwargs[into] = target.replace(**{old_to_new[k]: v for k, v in moved.items()})
            return fn(*args, **kwargs)

        return wrapper

    return decorate
