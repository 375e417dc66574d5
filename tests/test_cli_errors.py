"""Bad arguments to any command line: one line `...: error: ...` on stderr, exit status 2.

Issue 24: `examples/train_lm.py` printed a whole traceback for its own clear ValueErrors
(a bad `--mesh`, more devices than JAX has). Every CLI, the `shardfuse` console script
(and its subcommands) and each `examples/*.py`, is checked here with a few bad arguments:
those argparse refuses and those the library refuses.
"""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from shardfuse.__main__ import main as shardfuse_main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example(name):
    """The module of `examples/<name>.py` (its `main(argv)` runs in this process)."""
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_one_line_error(err: str, expected: str):
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert ": error: " in lines[0] and expected in lines[0], err


def _status(main, argv):
    """`main(argv)`'s exit status, whether it returns it or raises SystemExit."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


SHARDFUSE_CASES = [
    (["--cpu-devices", "0", "info"], "--cpu-devices=0 must be >= 1"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["demo", "--seq-len", "0"], "--seq-len=0 must be >= 1"),
    (["pipeline", "-m", "many"], "invalid int value: 'many'"),
    (["pipeline", "--schedule", "interleaved", "-p", "4", "-m", "6"], "multiple"),
    (["plan", "--model", "llama9", "--seq", "64", "--batch", "8"], "'llama9'"),
    (["plan", "--model", "llama3-8b", "--batch", "8"], "--seq"),
    (["bench", "--load", "run.json", "--threshold", "0"], "--threshold=0.0 must be > 0"),
]


@pytest.mark.parametrize(
    "argv, expected", SHARDFUSE_CASES, ids=[" ".join(a) for a, _ in SHARDFUSE_CASES]
)
def test_shardfuse_bad_arguments(capsys, argv, expected):
    assert _status(shardfuse_main, argv) == 2
    _assert_one_line_error(capsys.readouterr().err, expected)


TRAIN_LM_CASES = [
    (["--mesh", "data=2,bogus=4"], "--mesh entry 'bogus=4' must be AXIS=SIZE"),
    (["--mesh", "data=16"], "has 16 devices; JAX has 8"),  # more devices than JAX has
    (["--steps", "-1"], "-1 must be >= 0"),
    (["--batch", "two"], "'two' is not an integer"),
    (["--zero", "7"], "invalid choice: 7"),
    (["--num-processes", "2"], "coordinator, num_processes and process_id go together"),
    (["--heads", "3"], "hidden=64 must be a multiple of heads=3"),
    (["--mesh", "expert=4,data=2"], "expert axis 'expert' has size 4 but spec.experts=0"),
    (["--mesh", "expert=4,data=2", "--experts", "6"], "spec.experts=6 must be divisible by"),
    (["--experts", "8", "--top-k", "9"], "top_k=9 must be an int in"),
    (["--experts", "8", "--capacity-factor", "0"], "capacity_factor=0.0 must be None"),
    (["--capacity-factor", "1.5"], "need --experts > 0"),
]


@pytest.mark.parametrize(
    "argv, expected", TRAIN_LM_CASES, ids=[" ".join(a) for a, _ in TRAIN_LM_CASES]
)
def test_train_lm_bad_arguments(capsys, argv, expected):
    assert _status(_example("train_lm").main, argv) == 2
    _assert_one_line_error(capsys.readouterr().err, expected)


@pytest.mark.parametrize(
    "name, argv, expected",
    [
        ("tiny_lm", ["--steps", "0"], "0 must be >= 1"),
        ("tiny_lm", ["--layers", "x"], "'x' is not an integer"),
        ("plan_and_train", ["--steps", "0"], "0 must be >= 1"),
        ("launch_local", ["--num-processes", "0", "--", "true"], "0 must be >= 1"),
        ("launch_local", ["--timeout", "-1", "--", "true"], "--timeout=-1.0 must be > 0"),
        ("launch_local", [], "give the command to run after --"),
    ],
)
def test_example_bad_arguments(capsys, name, argv, expected):
    assert _status(_example(name).main, argv) == 2
    _assert_one_line_error(capsys.readouterr().err, expected)


@pytest.mark.parametrize(
    "command, expected",
    [
        ([str(ROOT / "examples" / "train_lm.py"), "--mesh", "data=3"], "has 3 devices; JAX has 8"),
        (["-m", "shardfuse", "pipeline", "-p", "0"], "shardfuse pipeline: error:"),
    ],
    ids=["train_lm", "shardfuse"],
)
def test_bad_arguments_in_a_fresh_process(command, expected):
    """As a user runs them: the process exits with 2 and one line on stderr, no traceback."""
    env = {"JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    _assert_one_line_error(done.stderr, expected)
