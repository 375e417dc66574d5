"""Compiling Triton kernels for sm_80 / sm_90 without a GPU, and reading their resource use.

`triton.compile` lowers a kernel to PTX and a cubin for a `GPUTarget`
without a device; shared memory per block comes from the compiled kernel's
metadata, registers per thread and spill bytes from `ptxas -v`, run with the
ptxas that ships in the triton wheel (the one triton itself uses for that
architecture). Kernels are compiled the way jax-triton compiles them: every
pointer 16-byte aligned, shapes and options as `tl.constexpr`. Each op's
`triton_compile.py` says which kernels, shapes and configs to compile.
"""

import dataclasses
import re
import subprocess
import tempfile

SHARED_MEMORY_LIMIT = {"sm80": 166912, "sm90": 232448}  # bytes per block (opt-in maximum)
_TRITON_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32"}


def generation(compute_capability: int) -> str:
    """The GPU generation of a compute capability given as an int (80, 86, 90, ...).

    "sm80" (A100, 8.x) or "sm90" (H100/H200, 9.x; newer GPUs use sm90's tables).

    Raises:
      NotImplementedError: compute capability below 8.0.

    Example:
      >>> generation(86), generation(90)
      ('sm80', 'sm90')
    """
    if compute_capability < 80:
        raise NotImplementedError(
            f"the Triton kernels need an NVIDIA GPU of compute capability >= 8.0 "
            f"(Ampere); this one is {compute_capability // 10}.{compute_capability % 10}"
        )
    return "sm80" if compute_capability < 90 else "sm90"


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


def compile_usage(
    fn,
    constexprs: dict,
    pointer_dtypes: dict,
    *,
    arch: int,
    config,
    **options,
) -> dict:
    """Compiles `fn` for `sm_{arch}`; returns the `ResourceUsage` fields of the result.

    Args:
      fn: a `@triton.jit` function (not built for the interpreter).
      constexprs: values of its `tl.constexpr` arguments.
      pointer_dtypes: element dtype name ("float32", "bfloat16", "float16",
        "int32") of each pointer argument.
      arch: 80 (A100) or 90 (H100).
      config: the launch config (its `num_warps` and `num_stages` are read).
      options: further compile options.

    Raises:
      RuntimeError: the kernels were built for the Triton interpreter.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError(
            "the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 when triton "
            "was imported); compile them in a process without it"
        )
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = "*" + _TRITON_TYPES[pointer_dtypes[name]]
            attrs[(index,)] = [["tt.divisibility", 16]]  # jax-triton's alignment assumption
    compiled = triton.compile(
        triton.compiler.ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages, **options),
    )
    registers, spill_stores, spill_loads = ptxas_usage(compiled.asm["ptx"], arch)
    return dict(
        registers=registers,
        spill_stores=spill_stores,
        spill_loads=spill_loads,
        shared_memory=compiled.metadata.shared,
        shared_memory_limit=SHARED_MEMORY_LIMIT[generation(arch)],
    )


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
