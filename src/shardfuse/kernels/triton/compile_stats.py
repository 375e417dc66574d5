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
import functools
import re
import subprocess
import tempfile

# The opt-in shared memory per block of each compute capability (CUDA's
# cudaDevAttrMaxSharedMemoryPerBlockOptin): the data-center parts have more than
# the consumer ones of the same generation (8.6, 8.9 and 12.x have 99 KiB).
_SHARED_MEMORY_PER_BLOCK = {
    80: 166912,
    86: 101376,
    87: 166912,
    89: 101376,
    90: 232448,
    100: 232448,
    103: 232448,
    120: 101376,
    121: 101376,
}
_TRITON_TYPES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float64": "fp64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "bool": "i1",
}


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


def shared_memory_limit(compute_capability: int) -> int:
    """Bytes of shared memory one block may use on a GPU of `compute_capability` (e.g. 90).

    Unknown capabilities get the smallest limit of the known ones from 8.0 on
    (99 KiB), so that a config that fits there fits everywhere.

    Example:
      >>> shared_memory_limit(90), shared_memory_limit(86)
      (232448, 101376)
    """
    return _SHARED_MEMORY_PER_BLOCK.get(
        int(compute_capability), min(_SHARED_MEMORY_PER_BLOCK.values())
    )


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
    compiled = _compile(
        fn,
        constexprs,
        pointer_dtypes,
        arch=arch,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **options,
    )
    registers, spill_stores, spill_loads = ptxas_usage(compiled.asm["ptx"], arch)
    return dict(
        registers=registers,
        spill_stores=spill_stores,
        spill_loads=spill_loads,
        shared_memory=compiled.metadata.shared,
        shared_memory_limit=shared_memory_limit(arch),
    )


def _compile(fn, constexprs, pointer_dtypes, *, arch, num_warps, num_stages, **options):
    """`triton.compile` of `fn` for `sm_{arch}`, the way jax-triton compiles it."""
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
    with triton.knobs.cache.scope():
        if not triton.knobs.cache.dir:  # jax_triton empties TRITON_CACHE_DIR when imported
            triton.knobs.cache.dir = _private_cache_dir()
        return triton.compile(
            triton.compiler.ASTSource(fn, signature, constexprs, attrs),
            target=GPUTarget("cuda", arch, 32),
            options=dict(num_warps=num_warps, num_stages=num_stages, **options),
        )


@functools.cache
def _private_cache_dir() -> str:
    """A cache directory for `triton.compile` in this process, where triton's is switched off."""
    return tempfile.mkdtemp(prefix="shardfuse-triton-")


@functools.lru_cache(maxsize=512)
def _shared_memory(fn, constexprs, pointer_dtypes, arch, num_warps, num_stages):
    compiled = _compile(
        fn,
        dict(constexprs),
        dict(pointer_dtypes),
        arch=arch,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return compiled.metadata.shared


def fit_num_stages(fn, constexprs: dict, pointer_dtypes: dict, *, arch: int, config):
    """`config` with `num_stages` lowered until the compiled kernel's shared memory fits the GPU.

    Software pipelining keeps `num_stages` copies of the inner loop's tiles in
    shared memory; with large tiles (user block sizes, or a consumer GPU's
    99 KiB) the tuned depth can ask for more than a block may have, and the
    launch fails. Each depth is compiled (`triton.compile`, cached on disk and
    here) and its shared memory read from the compiled metadata.

    Args:
      fn: a `@triton.jit` function.
      constexprs: values of its `tl.constexpr` arguments.
      pointer_dtypes: element dtype name of each pointer argument.
      arch: the GPU's compute capability, e.g. 90.
      config: a frozen dataclass with `num_warps` and `num_stages`.

    Returns:
      `config`, or a copy with the deepest `num_stages` that fits.

    Raises:
      NotImplementedError: even one stage needs more shared memory than the
        limit (the tiles are too large for this GPU).

    Example (the dQ kernel with 128 x 128 tiles of head dim 128 in 3 stages asks
    for 256 KiB on sm_90; 2 stages fit):
      >>> config = AttentionKernelConfig(128, 128, num_warps=8, num_stages=3)  # doctest: +SKIP
      >>> fit_num_stages(dq_kernel, constexprs, dtypes, arch=90, config=config)  # doctest: +SKIP
      AttentionKernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
    """
    limit = shared_memory_limit(arch)
    key = tuple(sorted(constexprs.items())), tuple(sorted(pointer_dtypes.items()))
    needed = None
    for stages in range(config.num_stages, 0, -1):
        needed = _shared_memory(fn, *key, arch, config.num_warps, stages)
        if needed <= limit:
            return (
                config
                if stages == config.num_stages
                else dataclasses.replace(config, num_stages=stages)
            )
    raise NotImplementedError(
        f"the Triton kernel {fn.__name__} with {config} needs {needed} bytes of shared memory "
        f"in one stage; a block may use {limit} on compute capability {arch // 10}.{arch % 10}: "
        "use smaller block sizes"
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
