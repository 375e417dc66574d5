"""Mosaic or TPU interpret mode: the one switch of every Pallas TPU kernel in shardfuse.

Each `pl.pallas_call` of the pallas_tpu attention, matmul and collective
matmul kernels takes its `interpret=` value from `current_interpret_params()`:
`False` emits Mosaic (runs on a TPU, or lowers for one from any host); a
`pltpu.InterpretParams` runs the kernel in JAX's TPU interpret mode, which
simulates VMEM, DMAs, semaphores and remote copies on CPU. By default that is
Mosaic on a TPU backend and interpret mode (default params) on CPU;
`interpret_mode(params)` overrides the choice for the calls traced inside it
(for example strict out-of-bounds checks or the race detector in tests). The
choice is read when a kernel is traced, so a custom_vjp's backward uses the
one its forward saw under `jax.jit`.
"""

import contextlib
import contextvars

import jax
from jax.experimental.pallas import tpu as pltpu

__all__ = ["current_interpret_params", "interpret_mode"]

_SETTING = contextvars.ContextVar("shardfuse_pallas_interpret", default=None)  # None: auto


@contextlib.contextmanager
def interpret_mode(params):
    """Chooses how the Pallas TPU kernels traced inside the block run.

    Args:
      params: a `pltpu.InterpretParams` (TPU interpret mode with these params,
        on any backend), `False` (always emit Mosaic: run on TPU, or lower for
        TPU from another host, e.g. `jit(f).trace(...).lower(lowering_platforms=("tpu",))`),
        or `None` (the default: Mosaic on TPU, interpret mode on CPU).

    Raises:
      TypeError: `params` is none of these.

    Example:
      >>> from jax.experimental.pallas import tpu as pltpu
      >>> strict = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
      >>> with interpret_mode(strict):
      ...     current_interpret_params() is strict
      True
    """
    if not (params is None or params is False or isinstance(params, pltpu.InterpretParams)):
        raise TypeError(
            f"params={params!r} must be a pltpu.InterpretParams, False (emit Mosaic) or None (auto)"
        )
    token = _SETTING.set(params)
    try:
        yield
    finally:
        _SETTING.reset(token)


def current_interpret_params(interpret=None):
    """The `pl.pallas_call(interpret=...)` value: `False` (Mosaic) or a `pltpu.InterpretParams`.

    Args:
      interpret: an explicit choice (`False` or a `pltpu.InterpretParams`),
        returned as is; `None` (default) resolves `interpret_mode`'s setting,
        else the platform default.

    Raises:
      NotImplementedError: no explicit choice and the backend is neither TPU
        nor CPU (dispatch then tries another implementation).

    Example:
      >>> current_interpret_params(False)
      False
      >>> with interpret_mode(False):
      ...     current_interpret_params()
      False
    """
    if interpret is not None:
        return interpret
    setting = _SETTING.get()
    if setting is not None:
        return setting
    platform = jax.default_backend()
    if platform == "tpu":
        return False
    if platform == "cpu":
        return pltpu.InterpretParams()
    raise NotImplementedError(
        f"pallas_tpu runs on TPU, or on CPU in TPU interpret mode; the backend is {platform!r}"
    )
