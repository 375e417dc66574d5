"""The dispatch every op shares: lazy backend loading, platform preference, fallback.

An op names its implementations (`{name: (module, function)}`, modules
imported on first use so that optional dependencies such as triton are never
imported by `import shardfuse`) and a preference per platform. With
`implementation=None` the candidates are tried best first: a backend that
raises `NotImplementedError` (valid input it cannot handle) hands over to the
next, and if none can run, the error lists why each could not. A named
implementation runs alone, and its `NotImplementedError` reaches the caller.
"""

import importlib

import jax


def load(op: str, implementations: dict, name: str):
    """The backend function `name` of `op`, or NotImplementedError saying why not."""
    module_name, function_name = implementations[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            raise NotImplementedError(
                f"{op} implementation {name!r} is not part of this version of shardfuse"
            ) from e
        raise NotImplementedError(f"{op} implementation {name!r} needs {e.name!r}: {e}") from e
    return getattr(module, function_name)


def candidates(implementations: dict, preference: dict, implementation) -> tuple[str, ...]:
    """The implementations to try, best first; ValueError for an unknown name."""
    if implementation is None:
        return tuple(preference.get(jax.default_backend(), ("xla",)))
    if implementation not in implementations:
        raise ValueError(
            f"implementation={implementation!r} is not one of {[None, *implementations]}"
        )
    return (implementation,)


def run(op: str, names, explicit: bool, call):
    """`call(name)` for each candidate until one does not raise NotImplementedError.

    Args:
      op: the op's name, for the error message.
      names: candidates, best first (from `candidates`).
      explicit: the caller named the implementation: its NotImplementedError propagates.
      call: `name -> result`; loads and runs one backend.
    """
    reasons = []
    for name in names:
        try:
            return call(name)
        except NotImplementedError as e:
            if explicit:
                raise
            reasons.append(f"{name}: {e}")
    raise NotImplementedError(f"no {op} implementation can run here: " + "; ".join(reasons))
