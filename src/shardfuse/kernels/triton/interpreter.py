"""The Triton interpreter worker: Triton kernels on CPU, for the tests and demos.

The interpreter is chosen when triton is first imported (`TRITON_INTERPRET=1`;
even `tl.max` is a `@triton.jit` function), and the parent process may hold
compiled kernels (the compile statistics), so interpreted kernels run in a
child process of their own (`InterpreterWorker`): pickled requests on its
stdin, numpy replies on its stdout, torch CPU tensors inside. bfloat16
arithmetic is patched to match a GPU's (`patch_interpreter_bfloat16`).

triton, torch and ml_dtypes are imported inside the functions, in the worker.
"""

import atexit
import importlib
import os
import pickle
import subprocess
import sys
import threading
import traceback

import numpy as np


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
