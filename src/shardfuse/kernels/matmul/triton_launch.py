"""How `triton_gpu.py` launches the matmul kernel: jax-triton on a GPU, the interpreter on CPU.

The same two launchers as the attention kernels (`kernels/attention/triton_launch.py`,
whose interpreter plumbing this reuses): `JaxTritonLauncher` calls
`jax_triton.triton_call` (the GPU path, jit-able); `InterpretLauncher` runs the
kernel under the Triton interpreter on torch CPU tensors in a worker process
started with `TRITON_INTERPRET=1`, wrapped in `jax.pure_callback`, so the
whole JAX wrapper (custom_vjp, jit) runs on CPU as on a GPU.

triton, jax_triton and torch are imported lazily: `import shardfuse` never imports them.
"""

import dataclasses
import importlib
import os
import sys

import jax
import numpy as np

from shardfuse.kernels.attention import triton_launch as attention_launch

KERNELS_MODULE = "shardfuse.kernels.matmul.triton_kernels"


def kernel_module():
    """The module of `@triton.jit` matmul kernels (imports triton)."""
    return importlib.import_module(KERNELS_MODULE)


@dataclasses.dataclass(frozen=True)
class JaxTritonLauncher:
    """Launches the kernel with `jax_triton.triton_call` (NVIDIA GPUs)."""

    compute_capability: int

    def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
        import jax_triton

        return jax_triton.triton_call(
            *inputs,
            kernel=getattr(kernel_module(), kernel_name),
            out_shape=list(out_shapes),
            grid=grid,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            name=kernel_name,
            **constexprs,
        )


def _interpret_kernel(kernel_name, arrays, out_shapes, grid, num_warps, constexprs):
    kernel = getattr(kernel_module(), kernel_name)
    tensors = [attention_launch.to_torch(a) for a in arrays]
    # NaN marks output entries the kernel forgot to write.
    outs = [attention_launch.to_torch(np.full(s, np.nan, dtype=d)) for s, d in out_shapes]
    kernel[grid](*tensors, *outs, **constexprs, num_warps=num_warps)
    return tuple(
        attention_launch.to_numpy(t, d) for t, (_, d) in zip(outs, out_shapes, strict=True)
    )


def interpreter_worker_main():
    """Entry point of the matmul interpreter worker: requests on stdin, replies on stdout."""
    import pickle
    import traceback

    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise RuntimeError("the interpreter worker must start with TRITON_INTERPRET=1")
    attention_launch.patch_interpreter_bfloat16()  # GPU-like bfloat16 dots and casts
    requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a kernel prints goes to stderr, not into the replies
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            reply = ("ok", _interpret_kernel(*request))
        except Exception:
            reply = ("error", traceback.format_exc())
        pickle.dump(reply, replies)
        replies.flush()


class InterpreterWorker(attention_launch.InterpreterWorker):
    def _start(self):
        import atexit
        import subprocess

        env = dict(os.environ, TRITON_INTERPRET="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        command = f"from {__name__} import interpreter_worker_main; interpreter_worker_main()"
        self._process = subprocess.Popen(
            [sys.executable, "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        atexit.register(self._process.kill)


_WORKER = InterpreterWorker()


@dataclasses.dataclass(frozen=True)
class InterpretLauncher:
    """Runs the kernel under the Triton interpreter on CPU (slow: keep shapes small).

    Attributes:
      compute_capability: which config table to use (tests pass block sizes anyway).
    """

    compute_capability: int = 90

    def __call__(self, kernel_name, inputs, out_shapes, grid, config, constexprs):
        out_shapes = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shapes]
        specs = [(s.shape, np.dtype(s.dtype)) for s in out_shapes]

        def host(*arrays):
            arrays = [np.asarray(a) for a in arrays]
            return _WORKER.run(
                kernel_name, arrays, specs, tuple(grid), config.num_warps, constexprs
            )

        return list(jax.pure_callback(host, tuple(out_shapes), *inputs))


def gpu_launcher() -> JaxTritonLauncher:
    """The jax-triton launcher for this machine's GPU (NotImplementedError without one)."""
    return JaxTritonLauncher(attention_launch.gpu_launcher().compute_capability)
