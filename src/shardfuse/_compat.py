"""What differs between the supported JAX versions, in one place.

shardfuse supports jax/jaxlib 0.10.2 (Python 3.11) up to the newest 0.12 release
(Python 3.12), and flax 0.12.8 up to 0.12.x. Where those versions behave
differently, the difference is detected here (by feature, not by version number
where the feature itself can be probed) and the rest of the package and its tests
call these helpers instead of checking versions themselves.

The differences:

- Pallas TPU interpret mode's race detector: newer JAX adds
  `InterpretParams.on_race`, default "raise", so the first race detected raises
  out of the interpreted kernel (an `io_callback` error) instead of being
  recorded in the interpreter's `races.races_found` while the kernel runs on, as
  older JAX always does. `race_detector_params` asks for the recording behaviour
  ("warn") where the field exists, so one test can run a kernel, then ask
  `races_found()`, on every version.
- The `scan` primitive's parameters: older JAX records how many of its operands are
  constants and carries (`num_consts`, `num_carry`); newer JAX records their tree
  (`ft_in`, unpacked into consts, carry and xs). `scan_operand_counts` reads either.
- Pallas remote DMAs and semaphore signals: newer JAX deprecates `device_id_type`;
  mesh coordinates are the default everywhere, so the kernels pass none (no helper).
"""

import dataclasses
import functools

import jax

__all__ = ["JAX_VERSION", "race_detector_params", "races_found", "scan_operand_counts"]

JAX_VERSION: tuple[int, ...] = tuple(jax.__version_info__)


@functools.cache
def _interpret_params_fields() -> frozenset:
    from jax.experimental.pallas import tpu as pltpu

    return frozenset(field.name for field in dataclasses.fields(pltpu.InterpretParams))


def race_detector_params(**kwargs):
    """`pltpu.InterpretParams(detect_races=True, **kwargs)` that records races, never raises.

    A detected race sets the interpreter's `races_found` (read it with `races_found()`)
    and the kernel runs to the end, on every supported JAX (newer JAX would raise at the
    first race unless `on_race="warn"`).

    Args:
      **kwargs: further `InterpretParams` fields, e.g. `dma_execution_mode="eager"`.

    Example:
      >>> params = race_detector_params(dma_execution_mode="eager")
      >>> params.detect_races, params.dma_execution_mode
      (True, 'eager')
    """
    from jax.experimental.pallas import tpu as pltpu

    if "on_race" in _interpret_params_fields():
        kwargs.setdefault("on_race", "warn")
    return pltpu.InterpretParams(detect_races=True, **kwargs)


def races_found() -> bool:
    """Whether the race detector flagged a race since `pltpu.reset_tpu_interpret_mode_state()`.

    Raises:
      RuntimeError: no kernel has run under the race detector since the reset.
    """
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter

    races = interpreter.races
    if races is None:
        raise RuntimeError("no Pallas kernel ran under the race detector (detect_races=True)")
    return bool(races.races_found)


def scan_operand_counts(params) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a `scan` equation: its operands (and its body's inputs)
    are the constants, then the carry, then the scanned-over `xs`.

    Args:
      params: the `params` of a jaxpr equation whose primitive is `scan`.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
