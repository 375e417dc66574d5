"""`shardfuse bench`: end to end on one tiny suite filter, and its reporting paths in-process."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardfuse.bench import cli, report

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "bench"
# One group of the quick matmul suite: 3 implementations, a few seconds.
ONE_GROUP = "llama3-8b-T256-qkv"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


def _shardfuse(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "shardfuse", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _parse(*argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Runs `shardfuse bench --quick` on one matmul group; returns (output, json path, plot)."""
    tmp = tmp_path_factory.mktemp("bench")
    run_json, plot = tmp / "run.json", tmp / "run.png"
    proc = _shardfuse(
        "bench", "--quick", "--suite", "matmul", "-k", ONE_GROUP, "--json", str(run_json),
        "--plot", str(plot),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, run_json, plot


def test_bench_runs_end_to_end(saved_run):
    output, run_json, plot = saved_run
    data = json.loads(run_json.read_text())
    benches = data["benchmarks"]
    assert sorted(b["extra_info"]["implementation"] for b in benches) == [
        "jnp.dot",
        "reference",
        "shardfuse.xla",
    ]
    assert len({b["group"] for b in benches}) == 1
    assert data["shardfuse"]["scale"] == "cpu-quick"
    for bench in benches:
        info = bench["extra_info"]
        assert bench["stats"]["median"] > 0
        assert info["tflops_per_s"] > 0 and info["pct_peak_flops"] == "n/a"
        assert info["memory"]["argument_bytes"] > 0
        assert info["speedup_vs_baseline"] > 0
    baseline = next(b for b in benches if b["extra_info"]["implementation"] == "jnp.dot")
    assert baseline["extra_info"]["speedup_vs_baseline"] == 1.0
    for text in ("matmul | fwd | llama3-8b | qkv + c | float32", "baseline", "TFLOP/s", "n/a"):
        assert text in output
    assert plot.stat().st_size > 0 and "plot with 1 panel(s)" in output


def test_compare_and_fail_on_regression(saved_run, tmp_path):
    _, run_json, _ = saved_run
    proc = _shardfuse("bench", "--load", str(run_json), "--compare", str(run_json),
                      "--fail-on-regression")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 regression(s)" in proc.stdout
    faster = json.loads(run_json.read_text())
    for bench in faster["benchmarks"]:  # a saved run where everything took half the time
        bench["stats"]["median"] /= 2
    faster_json = tmp_path / "faster.json"
    faster_json.write_text(json.dumps(faster))
    proc = _shardfuse("bench", "--load", str(run_json), "--compare", str(faster_json),
                      "--fail-on-regression")  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    # Ratios to the baseline did not change: only the baseline itself (judged on time) regresses.
    assert "1 regression(s)" in proc.stdout


def test_plot_without_matplotlib_gives_the_install_hint(saved_run, monkeypatch, capsys):
    _, run_json, _ = saved_run
    monkeypatch.setattr(report, "matplotlib_available", lambda: False)
    status = cli.main(_parse("--load", str(run_json), "--plot", "never.png"))
    assert status == 2
    assert "pip install 'shardfuse[plot]'" in capsys.readouterr().out
    assert not Path("never.png").exists()
    with pytest.raises(ModuleNotFoundError, match="shardfuse\\[plot\\]"):
        report.plot([], "never.png")


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--suite 'nope' is not one of .*attention"):
        cli.main(_parse("--suite", "nope", "--bench-dir", str(BENCH_DIR)))
    with pytest.raises(ValueError, match="--threshold=0.0 must be > 0"):
        cli.main(_parse("--threshold", "0", "--bench-dir", str(BENCH_DIR)))
    with pytest.raises(FileNotFoundError, match="--compare"):
        cli.main(_parse("--compare", str(tmp_path / "none.json"), "--bench-dir", str(BENCH_DIR)))
    with pytest.raises(FileNotFoundError, match="--bench-dir"):
        cli.find_bench_dir(tmp_path)
    assert set(cli.suites(BENCH_DIR)) >= {"attention", "matmul"}


def test_suites_run_once_under_benchmark_disable():
    """The smoke mode: every case compiles, runs once and checks its outputs, without timing."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(BENCH_DIR / "bench_attention.py"), "--bench-quick", "--benchmark-disable",
         "-k", "llama3-8b-T256-fwd-"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 passed" in proc.stdout
