"""The one registry of every op's implementations: lazy loading, platform preference, fallback.

Each op (`attention`, `matmul`, and the collectives' `all_gather_matmul`,
`matmul_reduce_scatter`, `matmul_all_reduce`) declares its backends once, in
its `api.py`, with `register`:

- a `Backend` names a module and a function, imported on first use only, so
  that optional dependencies (triton, jax_triton) are never imported by
  `import shardfuse`; it carries a one-line description and a `status`
  function, `platform -> (can_run_here, why)`, which `shardfuse info` shows;
- the op's `preference` lists, per platform, what `implementation=None` tries,
  best first.

Every op's `implementation=` then means the same thing (`Op.candidates`):

- `None`: the platform's preference;
- a name: that backend alone; its `NotImplementedError` reaches the caller;
- a sequence of names: tried in order, each `NotImplementedError` (valid
  input the backend cannot handle: dtype, shape, platform) handing over to
  the next; if none runs, the `NotImplementedError` lists every reason.

An unknown name is a `ValueError` listing the valid ones. Ring attention runs
the `attention` backends per ring step (`forward` / `backward` of each
backend module, see `kernels/attention/protocol.py`); its own op,
`ring_attention` (declared in `collectives/ring_attention/api.py`), lists
those names plus `pallas_tpu_fused`, the whole ring in one Pallas TPU kernel
per direction, and follows the `attention` op's preference for
`implementation=None`.
"""

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable, Sequence

import jax

Status = tuple[bool, str]


def runs_anywhere(platform: str) -> Status:
    """The status of a portable (pure JAX) backend: usable on every platform."""
    return True, "pure JAX: runs on every backend"


def pallas_tpu_status(platform: str) -> Status:
    """Pallas TPU kernels: Mosaic on a TPU, TPU interpret mode on CPU, nothing elsewhere."""
    if platform == "tpu":
        return True, "TPU: Mosaic kernels"
    if platform == "cpu":
        return True, "no TPU: runs in TPU interpret mode on cpu (slow)"
    return False, f"runs on TPU, or on CPU in TPU interpret mode; the backend is {platform!r}"


def triton_status(platform: str) -> Status:
    """Triton kernels: the launcher's own checks (NVIDIA GPU of compute capability >= 8.0,
    triton and jax-triton importable with this jaxlib)."""
    from shardfuse.kernels.triton.launch import gpu_compute_capability

    try:
        capability = gpu_compute_capability()
    except NotImplementedError as e:
        return False, str(e)
    return True, f"sm_{capability}: triton and jax-triton available"


def mosaic_gpu_status(platform: str) -> Status:
    """Pallas Mosaic GPU kernels: compiled on an sm_90+ GPU, Mosaic GPU interpret mode on CPU."""
    from shardfuse.kernels.attention.mosaic_gpu import status

    return status(platform)


def cudnn_status(platform: str) -> Status:
    """cuDNN's flash attention through jax.nn: NVIDIA GPUs only."""
    from shardfuse.kernels.attention.cudnn import status

    return status(platform)


def native_cpu_status(platform: str) -> Status:
    """The C++ CPU kernels: the extension built and loadable (else the build's reason), on CPU."""
    from shardfuse.kernels.attention.native_cpu import status

    return status(platform)


def kernel_preference(**platforms: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """The usual `preference` of an op with Pallas TPU and Triton kernels, best first.

    Pallas on TPU, Triton on NVIDIA GPUs, XLA everywhere else; a keyword
    replaces one platform's list.

    Example:
      >>> from shardfuse.kernels import registry
      >>> registry.kernel_preference(gpu=("xla",))["gpu"]
      ('xla',)
      >>> registry.kernel_preference()["tpu"]
      ('pallas_tpu', 'xla')
    """
    preference = {
        "tpu": ("pallas_tpu", "xla"),
        "gpu": ("triton", "xla"),
        "cuda": ("triton", "xla"),
        "rocm": ("xla",),
        "cpu": ("xla",),
    }
    preference.update(platforms)
    return preference


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of an op: where its function lives and whether it can run here.

    Attributes:
      name: what `implementation=` calls it ("reference", "xla", "pallas_tpu", "triton").
      module: the module holding the function, imported on first use.
      function: the function's name in `module`.
      description: one line for `shardfuse info`: what this backend is.
      status: `platform -> (can_run_here, why)`; default `runs_anywhere`.
      call_keywords: facts of the call the function takes as keywords beyond the op's
        common signature (the attention op's cudnn takes `need_lse`).
    """

    name: str
    module: str
    function: str
    description: str
    status: Callable[[str], Status] = runs_anywhere
    call_keywords: tuple[str, ...] = ()

    def load(self, function: str | None = None) -> Callable:
        """The backend's function (or another `function` of its module).

        Raises:
          NotImplementedError: the module is not part of this version, an
            optional dependency it imports is missing, or it has no such function.
        """
        try:
            module = importlib.import_module(self.module)
        except ModuleNotFoundError as e:
            if e.name == self.module:
                raise NotImplementedError(
                    f"implementation {self.name!r} is not part of this version of shardfuse"
                ) from e
            raise NotImplementedError(f"implementation {self.name!r} needs {e.name!r}: {e}") from e
        try:
            return getattr(module, function or self.function)
        except AttributeError as e:  # e.g. a ring step's `forward` of a backend without one
            raise NotImplementedError(
                f"implementation {self.name!r} has no {function or self.function}()"
            ) from e

    def available(self, platform: str | None = None) -> Status:
        """`(can_run_here, why)` on `platform` (default: JAX's default backend)."""
        try:
            present = importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            present = False
        if not present:
            return False, "not part of this version of shardfuse"
        return self.status(platform or jax.default_backend())


@dataclasses.dataclass(frozen=True)
class Op:
    """One op's backends and the order `implementation=None` tries them in, per platform.

    `preference` is a plain dict on purpose: tests change it with
    `monkeypatch.setitem`.
    """

    name: str
    description: str
    backends: dict[str, Backend]
    preference: dict[str, tuple[str, ...]]
    default: tuple[str, ...] = ("xla",)
    rule: Callable[[str], str | None] | None = None

    def rule_text(self, platform: str | None = None) -> str | None:
        """Where `implementation=None` depends on the case here: the rule, in words."""
        if self.rule is None:
            return None
        return self.rule(platform or jax.default_backend())

    @property
    def names(self) -> tuple[str, ...]:
        """Every backend name, in declaration order."""
        return tuple(self.backends)

    def _unknown(self, implementation, name) -> ValueError:
        valid = [None, *self.backends]
        where = "" if name is implementation else f" has {name!r}, which"
        return ValueError(
            f"implementation={implementation!r}{where} is not one of {valid} "
            f"(the {self.name} implementations) nor a sequence of them"
        )

    def candidates(self, implementation) -> tuple[str, ...]:
        """The backends `implementation=` asks for, in the order to try them.

        None gives the platform's preference; a name, itself; a sequence, its
        names in order (a repeated name is tried once).

        Raises:
          ValueError: an unknown name, or an empty sequence.
          TypeError: neither None, a str nor a sequence of str.

        Example:
          >>> import shardfuse
          >>> from shardfuse.kernels import registry
          >>> registry.get("attention").candidates(["pallas_tpu", "xla"])
          ('pallas_tpu', 'xla')
          >>> registry.get("attention").candidates("cuda")  # doctest: +ELLIPSIS
          Traceback (most recent call last):
          ...
          ValueError: implementation='cuda' is not one of [None, 'reference', ...
        """
        if implementation is None:
            return tuple(self.preference.get(jax.default_backend(), self.default))
        if isinstance(implementation, str):
            if implementation not in self.backends:
                raise self._unknown(implementation, implementation)
            return (implementation,)
        if not isinstance(implementation, Sequence):
            raise TypeError(
                f"implementation={implementation!r} must be None, one of {list(self.backends)} "
                "or a sequence of them"
            )
        if not implementation:
            raise ValueError(
                f"implementation={implementation!r} is empty; name at least one of "
                f"{list(self.backends)}, or pass None"
            )
        for name in implementation:
            if not isinstance(name, str) or name not in self.backends:
                raise self._unknown(implementation, name)
        return tuple(dict.fromkeys(implementation))

    def load(self, name: str, function: str | None = None) -> Callable:
        """The function of backend `name` (or its `function`): NotImplementedError if absent."""
        if name not in self.backends:
            raise self._unknown(name, name)
        return self.backends[name].load(function)

    def run(self, implementation, call: Callable[[str], object], *, order=None):
        """`call(name)` for each candidate of `implementation` until one runs.

        Args:
          implementation: None, a name or a sequence of names (see `candidates`).
          call: `name -> result`; loads and runs one backend, raising
            NotImplementedError when it cannot handle this input.
          order: for `implementation=None`, the names to try instead of the
            platform's static preference (an op whose best backend depends on the case).

        Raises:
          NotImplementedError: a single named backend's own error; otherwise
            "no <op> implementation can run here" with each backend's reason.

        Example:
          >>> import shardfuse
          >>> from shardfuse.kernels import registry
          >>> def call(name):
          ...     if name == "pallas_tpu":
          ...         raise NotImplementedError("no TPU here")
          ...     return name
          >>> registry.get("matmul").run(("pallas_tpu", "xla"), call)
          'xla'
        """
        names = self.candidates(implementation)
        if implementation is None and order is not None:
            names = tuple(order)
        if isinstance(implementation, str):
            return call(names[0])
        reasons = []
        for name in names:
            try:
                return call(name)
            except NotImplementedError as e:
                reasons.append(f"{name}: {e}")
        if implementation is None:
            asked = f"the preference for {jax.default_backend()!r}"
        else:
            asked = "as implementation= asked"
        raise NotImplementedError(
            f"no {self.name} implementation can run here (tried {list(names)}, {asked}): "
            + "; ".join(reasons)
        )

    def status(self, platform: str | None = None) -> dict[str, Status]:
        """`{name: (can_run_here, why)}` for every backend, on `platform` (default: here)."""
        return {name: backend.available(platform) for name, backend in self.backends.items()}


_OPS: dict[str, Op] = {}


def register(
    name: str,
    *,
    description: str,
    backends: Sequence[Backend],
    preference: dict[str, tuple[str, ...]],
    default: tuple[str, ...] = ("xla",),
    rule: Callable[[str], str | None] | None = None,
) -> Op:
    """Declares op `name` and its backends; returns the `Op` (registering again replaces it).

    Args:
      name: the op's name, as `shardfuse info` and error messages show it.
      description: one line: what the op computes.
      backends: its `Backend`s, in the order `shardfuse info` lists them.
      preference: `{platform: names}` that `implementation=None` tries, best first.
      default: what `implementation=None` tries on a platform not in `preference`.
      rule: `platform -> text or None`: where the op picks its backend per case
        (`Op.run(order=...)`), the rule in words, for `shardfuse info`.

    Raises:
      ValueError: a preference or default naming an undeclared backend.

    Example:
      >>> from shardfuse.kernels import registry
      >>> op = registry.register(
      ...     "example_op", description="a @ b",
      ...     backends=[registry.Backend("xla", "jax.numpy", "matmul", "jnp.matmul")],
      ...     preference={})
      >>> op.candidates(None)
      ('xla',)
      >>> registry.unregister("example_op")
    """
    table = {backend.name: backend for backend in backends}
    for platform, names in [*preference.items(), ("default", default)]:
        unknown = [n for n in names if n not in table]
        if unknown:
            raise ValueError(
                f"{name}: preference for {platform!r} names {unknown}, not in {list(table)}"
            )
    op = Op(name, description, table, dict(preference), tuple(default), rule)
    _OPS[name] = op
    return op


def unregister(name: str) -> None:
    """Removes op `name` (tests that register a throwaway op)."""
    _OPS.pop(name, None)


def get(name: str) -> Op:
    """The registered op `name`; ValueError listing the registered ops.

    Example:
      >>> import shardfuse  # registers every op
      >>> from shardfuse.kernels import registry
      >>> registry.get("matmul").names
      ('reference', 'xla', 'pallas_tpu', 'triton')
    """
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"op={name!r} is not one of the registered ops {list(_OPS)}") from None


def ops() -> dict[str, Op]:
    """Every registered op: single-device kernels first, then collectives, each by name.

    Example:
      >>> import shardfuse
      >>> from shardfuse.kernels import registry
      >>> "all_gather_matmul" in registry.ops()
      True
    """

    def is_collective(op: Op) -> bool:
        return any(b.module.startswith("shardfuse.collectives.") for b in op.backends.values())

    return {
        op.name: op for op in sorted(_OPS.values(), key=lambda op: (is_collective(op), op.name))
    }


def candidates(op: str, implementation) -> tuple[str, ...]:
    """`get(op).candidates(implementation)`: validates `implementation=` for `op`."""
    return get(op).candidates(implementation)


def normalize(op: str, implementation):
    """`implementation` validated for `op`, a sequence made a tuple (hashable, for static args)."""
    get(op).candidates(implementation)
    if implementation is None or isinstance(implementation, str):
        return implementation
    return tuple(implementation)


def load(op: str, name: str, function: str | None = None) -> Callable:
    """`get(op).load(name, function)`."""
    return get(op).load(name, function)


def run(op: str, implementation, call: Callable[[str], object]):
    """`get(op).run(implementation, call)`."""
    return get(op).run(implementation, call)
