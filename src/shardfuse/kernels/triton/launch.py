"""Launching Triton kernels from JAX, for every op with Triton kernels.

A launcher is called as `launcher(kernel_name, inputs, out_shapes, grid, config,
constexprs)` and returns the kernel's outputs as JAX arrays. Kernels take their
inputs' pointers, then their outputs' pointers, then `tl.constexpr` keywords;
`kernels_module` names the module that defines them, and an op binds it with
`resolve(launcher, kernels_module)`.

- `JaxTritonLauncher`: `jax_triton.triton_call`, the real GPU path (jit-able).
- `InterpretLauncher`: the same kernels under the Triton interpreter on torch
  CPU tensors, in a worker process (`interpreter.py`), wrapped in
  `jax.pure_callback`, so that the whole JAX wrapper (tables, custom_vjp, jit)
  runs on CPU exactly as on a GPU. This is how the tests check the kernels
  without a GPU.
- `gpu_compute_capability`: the checks a GPU launch needs, with reasons.

triton and jax_triton are imported lazily, inside these functions:
`import shardfuse` never imports them.
"""

import dataclasses
import importlib
import warnings

import jax
import numpy as np

from shardfuse.kernels.triton import compile_stats, interpreter


@dataclasses.dataclass(frozen=True)
class JaxTritonLauncher:
    """Launches compiled kernels with `jax_triton.triton_call` (NVIDIA GPUs).

    Attributes:
      compute_capability: of the GPU, e.g. 90; picks the tuned config table.
      kernels_module: the module of `@triton.jit` kernels (bound by the op: `resolve`).
    """

    compute_capability: int
    kernels_module: str = ""

    def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
        import jax_triton

        kernel = getattr(importlib.import_module(self.kernels_module), kernel_name)
        config = _fit_shared_memory(kernel, inputs, out_shapes, config, constexprs, self)
        return jax_triton.triton_call(
            *inputs,
            kernel=kernel,
            out_shape=list(out_shapes),
            grid=grid,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            name=kernel_name,
            **constexprs,
        )


def _fit_shared_memory(kernel, inputs, out_shapes, config, constexprs, launcher):
    """`config` with as many pipeline stages as fit this GPU's shared memory (compiled to see)."""
    pointers = [name for name in kernel.arg_names if name not in constexprs]
    dtypes = [np.dtype(x.dtype).name for x in (*inputs, *out_shapes)]
    if len(pointers) != len(dtypes):
        raise ValueError(
            f"{kernel.__name__} takes {len(pointers)} pointers; got {len(inputs)} inputs and "
            f"{len(out_shapes)} outputs"
        )
    try:
        return compile_stats.fit_num_stages(
            kernel,
            constexprs,
            dict(zip(pointers, dtypes, strict=True)),
            arch=launcher.compute_capability,
            config=config,
        )
    except NotImplementedError:  # a RuntimeError too: the tiles do not fit
        raise
    except (RuntimeError, OSError) as e:  # the check itself cannot compile here: launch as tuned
        warnings.warn(
            f"shardfuse could not compile {kernel.__name__} to check its shared memory "
            f"({type(e).__name__}: {e}); launching it with {config}",
            stacklevel=2,
        )
        return config


@dataclasses.dataclass(frozen=True)
class InterpretLauncher:
    """Runs kernels under the Triton interpreter on CPU (slow: keep shapes tiny).

    The call is a `jax.pure_callback`, so the JAX wrapper around it (tables,
    custom_vjp, jit) is the one that runs on GPUs. Outputs start as NaN, so an
    element that a kernel forgets to write shows up in the comparison.

    Attributes:
      compute_capability: which tuned config table to use (tests override the
        block sizes anyway).
      kernels_module: the module of `@triton.jit` kernels (bound by the op: `resolve`).
    """

    compute_capability: int = 90
    kernels_module: str = ""

    def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
        out_shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes]
        specs = [(s.shape, np.dtype(s.dtype)) for s in out_shapes]

        def host(*arrays):
            arrays = [np.asarray(a) for a in arrays]
            return interpreter.WORKER.run(
                self.kernels_module,
                kernel_name,
                arrays,
                specs,
                tuple(grid),
                config.num_warps,
                constexprs,
            )

        return list(jax.pure_callback(host, tuple(out_shapes), *inputs))


def gpu_compute_capability() -> int:
    """The compute capability (e.g. 90) of this machine's GPU, if Triton kernels can launch.

    Raises:
      NotImplementedError: no NVIDIA GPU of compute capability >= 8.0, or
        triton / jax_triton missing or unusable, with the reason.

    Example:
      >>> from shardfuse.kernels.triton.launch import gpu_compute_capability
      >>> gpu_compute_capability()  # on an H100  # doctest: +SKIP
      90
    """
    backend = jax.default_backend()
    if backend not in ("gpu", "cuda"):
        raise NotImplementedError(
            f"implementation 'triton' needs an NVIDIA GPU; the JAX backend is {backend!r}"
        )
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        raise NotImplementedError(
            f"implementation 'triton' needs an NVIDIA (CUDA) GPU; device {device.device_kind!r} "
            "reports no compute capability"
        )
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    if major < 8:
        raise NotImplementedError(
            f"implementation 'triton' needs compute capability >= 8.0 (Ampere); "
            f"{device.device_kind} has {major}.{minor}"
        )
    for module in ("triton", "jax_triton"):
        try:
            importlib.import_module(module)
        except Exception as e:  # jax_triton raises more than ImportError on some jaxlibs
            raise NotImplementedError(
                f"implementation 'triton' needs {module} (pip install 'shardfuse[gpu]'): "
                f"{type(e).__name__}: {e}"
            ) from e
    return 10 * major + minor


def kernel_module(kernels_module: str):
    """The module of `@triton.jit` kernels named `kernels_module` (imports triton)."""
    return importlib.import_module(kernels_module)


def resolve(launcher, kernels_module: str):
    """`launcher`, or this GPU's jax-triton launcher when None, bound to `kernels_module`.

    Raises:
      NotImplementedError: `launcher` is None and no GPU launch is possible
        (see `gpu_compute_capability`).

    Example:
      >>> resolve(InterpretLauncher(), "shardfuse.kernels.matmul.triton_kernels").kernels_module
      'shardfuse.kernels.matmul.triton_kernels'
    """
    if launcher is None:
        launcher = JaxTritonLauncher(compute_capability=gpu_compute_capability())
    return dataclasses.replace(launcher, kernels_module=kernels_module)
