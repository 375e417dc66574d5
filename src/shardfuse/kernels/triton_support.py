"""Launching Triton kernels from JAX, shared by every op with Triton kernels.

A launcher is called as `launcher(kernel_name, inputs, out_shapes, grid, config,
constexprs)` and returns the kernel's outputs as JAX arrays. Kernels take their
inputs' pointers, then their outputs' pointers, then `tl.constexpr` keywords;
`kernels_module` names the module that defines them.

- `JaxTritonLauncher`: `jax_triton.triton_call`, the real GPU path (jit-able).
- `InterpretLauncher`: the same kernels under the Triton interpreter on torch
  CPU tensors, in a worker process started with `TRITON_INTERPRET=1`, wrapped
  in `jax.pure_callback`, so that the whole JAX wrapper (tables, custom_vjp,
  jit) runs on CPU exactly as on a GPU. This is how the tests check the
  kernels without a GPU.
- `gpu_compute_capability`: the checks a GPU launch needs, with reasons.
- `ptxas_usage`: registers and spills of compiled PTX (bundled ptxas).

triton, jax_triton and torch are imported lazily, inside these functions:
`import shardfuse` never imports them.
"""

import atexit
import dataclasses
import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import traceback

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class JaxTritonLauncher:
    """Launches compiled kernels with `jax_triton.triton_call` (NVIDIA GPUs).

    Attributes:
      compute_capability: of the GPU, e.g. 90; picks the tuned config table.
      kernels_module: the module of `@triton.jit` kernels.
    """

    compute_capability: int
    kernels_module: str = ""

    def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
        import jax_triton

        return jax_triton.triton_call(
            *inputs,
            kernel=getattr(importlib.import_module(self.kernels_module), kernel_name),
            out_shape=list(out_shapes),
            grid=grid,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            name=kernel_name,
            **constexprs,
        )


def to_torch(x):
    import ml_dtypes
    import torch

    x = np.array(x, copy=True, order="C")
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def to_numpy(tensor, dtype):
    import ml_dtypes
    import torch

    if np.dtype(dtype) == ml_dtypes.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def interpret_kernel(kernels_module, kernel_name, arrays, out_shapes, grid, num_warps, constexprs):
    """Runs one kernel under the interpreter on torch CPU tensors; returns numpy outputs."""
    kernel = getattr(importlib.import_module(kernels_module), kernel_name)
    tensors = [to_torch(a) for a in arrays]
    # Every output of these kernels is floating point: NaN marks unwritten entries.
    outs = [to_torch(np.full(shape, np.nan, dtype=dtype)) for shape, dtype in out_shapes]
    kernel[grid](*tensors, *outs, **constexprs, num_warps=num_warps)
    return tuple(to_numpy(t, dtype) for t, (_, dtype) in zip(outs, out_shapes, strict=True))


def patch_interpreter_bfloat16():
    """Makes the interpreter's bfloat16 arithmetic match a GPU's.

    The Triton interpreter (checked on triton 3.9) stores bfloat16 as uint16
    and (1) multiplies those raw bits in `tl.dot`, and (2) truncates float32 to
    bfloat16 in `.to(tl.bfloat16)` where GPUs round to nearest even. Here
    `tl.dot` widens bfloat16 operands to float32 first (exact: a 16-bit
    shift), and the cast rounds to nearest even (ml_dtypes). Only the
    interpreter worker is patched.
    """
    import ml_dtypes
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_shardfuse_patched", False):
        return
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = src.data.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.create_dot = patched_dot
    builder.cast_impl = patched_cast
    builder._shardfuse_patched = True


def interpreter_worker_main():
    """Entry point of the interpreter worker: pickled requests on stdin, replies on stdout."""
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise RuntimeError("the interpreter worker must start with TRITON_INTERPRET=1")
    patch_interpreter_bfloat16()
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a kernel prints goes to stderr, not into the replies
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", interpret_kernel(*request))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, replies)
        replies.flush()


class InterpreterWorker:
    """A child process running the Triton interpreter (TRITON_INTERPRET=1 from its start).

    The interpreter is chosen when triton is imported (even `tl.max` is a
    `@triton.jit` function), and this process may hold compiled kernels (the
    compile checks), so interpreted kernels run in their own process.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._process = None

    def _start(self):
        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        command = f"from {__name__} import interpreter_worker_main; interpreter_worker_main()"
        self._process = subprocess.Popen(
            [sys.executable, "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        atexit.register(self._process.kill)

    def run(self, *request):
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            pickle.dump(request, self._process.stdin)
            self._process.stdin.flush()
            try:
                status, value = pickle.load(self._process.stdout)
            except EOFError:
                raise RuntimeError(
                    f"the Triton interpreter worker exited with code {self._process.wait()}"
                ) from None
        if status != "ok":
            raise RuntimeError(f"{request[1]} failed in the Triton interpreter:\n{value}")
        return value


WORKER = InterpreterWorker()


@dataclasses.dataclass(frozen=True)
class InterpretLauncher:
    """Runs kernels under the Triton interpreter on CPU (slow: keep shapes tiny).

    The call is a `jax.pure_callback`, so the JAX wrapper around it (tables,
    custom_vjp, jit) is the one that runs on GPUs. Outputs start as NaN, so an
    element that a kernel forgets to write shows up in the comparison.

    Attributes:
      compute_capability: which tuned config table to use (tests override the
        block sizes anyway).
      kernels_module: the module of `@triton.jit` kernels.
    """

    compute_capability: int = 90
    kernels_module: str = ""

    def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
        out_shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes]
        specs = [(s.shape, np.dtype(s.dtype)) for s in out_shapes]

        def host(*arrays):
            arrays = [np.asarray(a) for a in arrays]
            return WORKER.run(
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
      >>> from shardfuse.kernels.triton_support import gpu_compute_capability
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResourceUsage:
    """Per-program resources of one compiled kernel (a CUDA block).

    Attributes:
      registers: registers per thread (ptxas).
      spill_stores, spill_loads: spill bytes (ptxas).
      shared_memory: bytes of shared memory per block (compile metadata).
      shared_memory_limit: the device's per-block limit.
    """

    registers: int
    spill_stores: int
    spill_loads: int
    shared_memory: int
    shared_memory_limit: int

    @property
    def ok(self) -> bool:
        """No spills and shared memory within the device's per-block limit."""
        spills = self.spill_stores + self.spill_loads
        return spills == 0 and self.shared_memory <= self.shared_memory_limit


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """`(registers, spill store bytes, spill load bytes)` from `ptxas -v`."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE).group(1).split(",")[0]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        result = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name={target}", source.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        )
    log = result.stdout + result.stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return registers, int(spills.group(1)), int(spills.group(2))
