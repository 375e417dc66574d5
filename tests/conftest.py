"""Test setup: 8 CPU devices, asked for before any JAX backend starts."""

import atexit
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# The suite compiles about two thousand small programs and runs each a few times, so
# compiling dominates its cost (about two thirds of a worker's time in XLA's backend
# compile, measured with jax.monitoring on tests/models and tests/layers) while the
# generated code's speed buys nothing. Two XLA:CPU settings cut it; the sharding, fusion
# and collectives the tests count stay the same (one buffer of the planner's memory grid
# does not: tests/planner/test_memory.py):
# - LLVM without its optimisations: about a third less CPU (tests/layers/
#   test_attention_block.py, tests/models/test_transformer.py and the ring numerics:
#   198 -> 134 CPU seconds);
# - where this XLA still has them (jax 0.10; gone in 0.12), the IR emitters instead of the
#   MLIR fusion emitters: half the backend compile time again (tests/models/
#   test_transformer.py and tests/layers/test_api.py: 75 -> 38 s of compile, 64 -> 42 s
#   wall on 2 workers; the quick suite 734 -> 507 s);
# - where it has not, XLA:CPU's FAST_COMPILE preset (jax 0.12: 68 -> 57 s of compile,
#   58 -> 51 s wall on the same tests; on jax 0.10 it changes nothing measurable);
# - the generated code in one LLVM module instead of XLA's default split for parallel
#   codegen, whose parts repeat the per-module work: 25-35% less compile CPU on jax 0.10
#   (four training steps of tests/planner/test_memory.py's grid: 9.6-10.2 -> 6.4-8.2 CPU
#   s) and about 11% on jax 0.12 (18.7-19.5 -> 16.7-17.1 s), the memory analysis the
#   same; the suite's two workers already keep both cores busy.
# XLA aborts on a flag it does not know, so a subprocess asks first.
# SHARDFUSE_TEST_XLA_OPT=1 keeps XLA's defaults. Subprocesses (the multi-host and CLI
# tests) and the xdist workers inherit the flags through the environment.
if os.environ.get("SHARDFUSE_TEST_XLA_OPT") != "1" and "SHARDFUSE_TEST_XLA_FLAGS" not in os.environ:
    _fast = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]

    def _xla_knows(flag):
        probe = [sys.executable, "-c", "import jax; jax.devices('cpu')"]
        env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
        return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0

    for _flag in (
        "--xla_cpu_use_fusion_emitters=false",
        "--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE",
    ):
        if _xla_knows(_flag):
            _fast.append(_flag)
            break
    if _xla_knows("--xla_cpu_parallel_codegen_split_count=1"):
        _fast.append("--xla_cpu_parallel_codegen_split_count=1")
    os.environ["SHARDFUSE_TEST_XLA_FLAGS"] = " ".join(_fast)
    os.environ["XLA_FLAGS"] = f"{' '.join(_fast)} {os.environ.get('XLA_FLAGS', '')}".strip()

# Many tests compile the same program again (the unsharded reference of each mesh's case,
# the same layer under eager, jit and grad): JAX's persistent compilation cache in a
# directory of this run, shared by the xdist workers and subprocesses through the
# environment, compiles each once (27% less CPU on tests/models/test_transformer.py and
# tests/parallel/test_zero.py, cold cache). A cached executable keeps its HLO text and
# memory analysis, which the structure tests read. SHARDFUSE_TEST_JAX_CACHE=0 turns it off;
# SHARDFUSE_TEST_JAX_CACHE_DIR names a directory to keep and share between runs of one
# stack (.ci/run: the quick and the slow suite; XLA's flags and versions are in the key).
if (
    os.environ.get("SHARDFUSE_TEST_JAX_CACHE") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
):
    _cache = os.environ.get("SHARDFUSE_TEST_JAX_CACHE_DIR")
    if not _cache:
        _cache = tempfile.mkdtemp(prefix="shardfuse-test-jax-cache-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


# The quick suite's heaviest cases (measured; the list says how) run under `-m slow`.
_HEAVY = frozenset(
    line.strip()
    for line in (pathlib.Path(__file__).parent / "heavy.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if item.nodeid in _HEAVY:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
