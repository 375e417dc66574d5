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
- Pallas Mosaic GPU's `plgpu.load`: jax 0.10 takes the index as a required
  argument, 0.11 deprecates it (index the ref with `.at`), 0.12 takes a ref alone.
  `mosaic_gpu_load` calls whichever the installed JAX wants.
- Mosaic GPU interpret mode (`InterpretGPUParams`): jax 0.10's interpreter has no
  rule for `plgpu.layout_cast` and deadlocks on warp-specialized kernels (a
  producer warpgroup and two consumers waiting on each other's barriers, seen
  on 0.10.2); 0.11 runs them. `mosaic_gpu_interpret_params` returns the params
  from 0.11 on and says why not before. Not probe-able: a version check.
"""

import dataclasses
import functools

import jax

__all__ = [
    "JAX_VERSION",
    "mosaic_gpu_interpret_params",
    "mosaic_gpu_load",
    "race_detector_params",
    "races_found",
    "scan_operand_counts",
]

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


@functools.cache
def _mosaic_gpu_load_takes_index() -> bool:
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    parameter = inspect.signature(plgpu.load).parameters.get("idx")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def mosaic_gpu_load(ref, index, *, layout):
    """`ref[index]` read into registers in `layout` (`plgpu.load`), on every supported JAX.

    Only inside a Pallas Mosaic GPU kernel body; `index` a tuple of `pl.ds` / ints.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if _mosaic_gpu_load_takes_index():
        return plgpu.load(ref, index, layout=layout, optimized=False)
    return plgpu.load(ref.at[index], layout=layout, optimized=False)


MOSAIC_GPU_INTERPRET_MIN_JAX = (0, 11)


def mosaic_gpu_interpret_params(**kwargs):
    """`InterpretGPUParams(**kwargs)`: Mosaic GPU interpret mode, where it runs our kernels.

    Raises:
      NotImplementedError: JAX older than 0.11 (see the module docstring).
    """
    if JAX_VERSION[:2] < MOSAIC_GPU_INTERPRET_MIN_JAX:
        raise NotImplementedError(
            f"Mosaic GPU interpret mode needs jax >= 0.11 (jax {jax.__version__}'s interpreter "
            "deadlocks on warp-specialized kernels); on a GPU the kernels compile"
        )
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(**kwargs)
