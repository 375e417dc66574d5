"""Test setup: 8 CPU devices, asked for before any JAX backend starts."""

import atexit
import os
import shutil
import tempfile

# The suite compiles about two thousand small programs and runs each a few times, so
# LLVM's optimisation of the generated CPU code dominates its cost and buys nothing:
# without it the suite needs about a third less CPU (measured on tests/layers/
# test_attention_block.py, tests/models/test_transformer.py and the ring numerics:
# 198 -> 134 CPU seconds). XLA's HLO passes (sharding, fusion, scheduling, the
# collectives the tests count) are the same. SHARDFUSE_TEST_XLA_OPT=1 keeps LLVM's
# default. Subprocesses (the multi-host and CLI tests) inherit the flags.
if os.environ.get("SHARDFUSE_TEST_XLA_OPT") != "1":
    _FAST = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    os.environ["XLA_FLAGS"] = f"{_FAST} {os.environ.get('XLA_FLAGS', '')}".strip()

# Many tests compile the same program again (the unsharded reference of each mesh's case,
# the same layer under eager, jit and grad): JAX's persistent compilation cache in a
# directory of this run, shared by the xdist workers and subprocesses through the
# environment, compiles each once (27% less CPU on tests/models/test_transformer.py and
# tests/parallel/test_zero.py, cold cache). A cached executable keeps its HLO text and
# memory analysis, which the structure tests read. SHARDFUSE_TEST_JAX_CACHE=0 turns it off.
if (
    os.environ.get("SHARDFUSE_TEST_JAX_CACHE") != "0"
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
):
    _cache = tempfile.mkdtemp(prefix="shardfuse-test-jax-cache-")
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
