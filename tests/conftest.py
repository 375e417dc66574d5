"""Test setup: 8 CPU devices, asked for before any JAX backend starts."""

import os

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

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
