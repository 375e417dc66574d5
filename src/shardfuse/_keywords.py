"""Keywords a function takes only to hand them on: listed once, where they are read.

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
