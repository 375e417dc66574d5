"""The command line: `shardfuse info` and `shardfuse demo` run in a fresh process."""

import subprocess
import sys

import pytest


def _run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "shardfuse", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_info():
    result = _run("info")
    assert result.returncode == 0, result.stderr
    for expected in ("jax", "flax", "backend: cpu", "devices (8)", "xla", "triton"):
        assert expected in result.stdout
    # Every registered op, the collective matmuls included, each with its own texts.
    for op in ("attention", "matmul", "all_gather_matmul", "matmul_reduce_scatter"):
        assert op in result.stdout
    assert "matmul_all_reduce" in result.stdout and "TPU interpret mode" in result.stdout


def test_bad_arguments_exit_with_usage():
    result = _run("--cpu-devices", "0", "info")
    assert result.returncode == 2 and "--cpu-devices=0 must be >= 1" in result.stderr
    assert _run("frobnicate").returncode == 2


@pytest.mark.slow
def test_demo_runs_end_to_end():
    result = _run("demo", "--seq-len", "128", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Llama-style LM training" in result.stdout
    assert "flash_attention" in result.stdout
