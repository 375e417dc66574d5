"""The built wheel carries the benchmark suites, so that `shardfuse bench` runs from a wheel.

Builds the wheel of this checkout as `pip wheel` does (the project's build backend in an
isolated environment; the C++ kernels skipped with SHARDFUSE_NATIVE=0, in a build folder
of its own) and reads its file list: every suite, their `conftest.py` and `pytest.ini`,
and the benchmark tools. Installing it into a fresh virtual environment and running
`shardfuse bench --quick --suite matmul` from /tmp is the release check of
docs/benchmarks.md; it needs the network and minutes, so it is not a test.
About 5 s on the idle 2-core machine (a minute when eight jobs share it); skipped where
pip cannot install the build backend (no network, no cache).
"""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from shardfuse.bench import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_wheel_contains_the_suites(tmp_path):
    env = {**os.environ, "SHARDFUSE_NATIVE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path),
         f"--config-settings=build-dir={tmp_path / 'build'}", str(ROOT)],
        capture_output=True, text=True, env=env, timeout=840,
    )  # fmt: skip
    unreachable = ("satisfies the requirement", "No matching distribution", "NewConnectionError")
    if proc.returncode != 0 and any(text in proc.stderr for text in unreachable):
        pytest.skip("pip cannot install the build backend (scikit-build-core) here: no network")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("shardfuse-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    suites = {f"shardfuse/bench/suites/{p.name}" for p in cli.SUITES_DIR.glob("bench_*.py")}
    assert len(suites) >= 8, suites
    expected = suites | {
        "shardfuse/bench/suites/__init__.py",
        "shardfuse/bench/suites/conftest.py",
        "shardfuse/bench/suites/pytest.ini",
        "shardfuse/bench/tools/peers.py",
        "shardfuse/bench/tools/triton_compile_stats.py",
        "shardfuse/bench/tools/gpu_attention.py",
        "shardfuse/kernels/attention/gpu_dispatch.json",  # implementation=None on GPUs reads it
        "shardfuse/bench/cli.py",
    }
    assert expected <= names, sorted(expected - names)
