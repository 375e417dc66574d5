"""`shardfuse bench`: end to end on one tiny suite filter, and its reporting paths in-process."""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardfuse.bench import cli, report

REPO = Path(__file__).resolve().parents[2]
# The suites installed with the package (here: the checkout's src/, on PYTHONPATH).
BENCH_DIR = cli.SUITES_DIR
# One group of the quick matmul suite: 3 implementations, a few seconds.
ONE_GROUP = "llama3-8b-T256-qkv"


def _env():
    # A fresh `shardfuse bench` run: not an xdist worker of this test session (pytest-benchmark
    # turns itself off when it sees PYTEST_XDIST_WORKER), not inside this test's pytest.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


def _shardfuse(*args, timeout=300, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "shardfuse", *args],
        cwd=cwd,
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
    """Runs `shardfuse bench --quick` on one matmul group from an empty folder, without
    --json (so the suites are the installed ones and the JSON goes to the default place);
    returns (output, the JSON path it printed, plot)."""
    tmp = tmp_path_factory.mktemp("bench")
    plot = tmp / "run.png"
    proc = _shardfuse(
        "bench", "--quick", "--suite", "matmul", "-k", ONE_GROUP, "--plot", str(plot), cwd=tmp
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    written = re.search(r"results written to (\S+\.json)", proc.stdout)
    assert written, proc.stdout
    return proc.stdout, Path(written.group(1)), plot


def test_bench_runs_end_to_end(saved_run):
    output, run_json, plot = saved_run
    # The printed path is where the JSON is, kept after the command: ./.benchmarks/ by default.
    assert run_json.is_file() and run_json.parent.name == cli.DEFAULT_JSON_DIR
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
    # Backends that cannot run here are not silently missing: listed under the table, with why.
    skipped = data["shardfuse"]["skipped"]
    reasons = " ".join(entry["reason"] for entry in skipped)
    assert "shardfuse.triton cannot run this case" in reasons and "NVIDIA GPU" in reasons
    assert "shardfuse.pallas_tpu runs on 'cpu' only in TPU interpret mode" in reasons
    assert "skipped (not in the table): 2 case(s)" in output
    assert "1x shardfuse.triton cannot run this case" in output.replace("\n", " ")
    # Not a terminal (captured): one line per suite says where its time went.
    line = re.search(
        r"suite matmul: 5 cases \(3 timed, 2 skipped, 0 failed\) in ([\d.]+) s, "
        r"compiling ([\d.]+), timing ([\d.]+)",
        output,
    )
    assert line, output
    seconds, compiling, timing = (float(x) for x in line.groups())
    assert 0 < compiling + timing <= seconds


@pytest.mark.parametrize("explicit", [True, False])
def test_json_is_kept_where_the_cli_says(saved_run, tmp_path, monkeypatch, capsys, explicit):
    """With --json PATH and without (./.benchmarks/), the printed path exists afterwards."""
    _, run_json, _ = saved_run

    def fake_run_suites(args, bench_dir, json_path, console):  # what pytest-benchmark does
        json_path.write_text(run_json.read_text())
        return 0

    monkeypatch.setattr(cli, "run_suites", fake_run_suites)
    monkeypatch.chdir(tmp_path)
    argv = ["--bench-dir", str(BENCH_DIR)]
    if explicit:
        argv += ["--json", str(tmp_path / "sub" / "kept.json")]
    assert cli.main(_parse(*argv)) == 0
    printed = re.search(r"results written to (\S+\.json)", capsys.readouterr().out)
    assert printed
    kept = Path(printed.group(1))
    assert kept.is_file() and json.loads(kept.read_text())["benchmarks"]
    expected = tmp_path / "sub" / "kept.json" if explicit else tmp_path / cli.DEFAULT_JSON_DIR
    assert kept == expected or kept.parent == expected


MISSING_PYTEST = """
import sys
sys.modules["pytest"] = None  # as on a base install, without the test extra
sys.modules["pytest_benchmark"] = None
from shardfuse.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_bench_without_pytest_says_what_to_install(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", MISSING_PYTEST, "bench", "--quick", "--bench-dir", str(BENCH_DIR)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()  # one line
    assert 'pip install -e ".[test]"' in line and "pytest and pytest_benchmark" in line
    assert not (tmp_path / cli.DEFAULT_JSON_DIR).exists()


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


def test_suites_are_part_of_the_package():
    """No checkout needed: the default folder is the package's own, whatever the working
    directory (a wheel installs it; tests/test_packaging.py checks the wheel's files)."""
    assert cli.find_bench_dir() == BENCH_DIR.resolve()
    assert BENCH_DIR.parent == Path(cli.__file__).resolve().parent
    assert set(cli.suites(BENCH_DIR)) >= {
        "attention", "collective_matmul", "context_parallel", "layers", "matmul", "memory",
        "pipeline", "ring_attention",
    }  # fmt: skip


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
