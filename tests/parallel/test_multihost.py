"""Multi-process training on loopback and resume after SIGKILL, through examples/ scripts.

Every subprocess runs under a timeout and is killed on failure
(`examples/launch_local.py`), and each test carries a pytest timeout: nothing hangs.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from shardfuse.models import ModelSpec
from shardfuse.train import TrainConfig, Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "train_lm.py")
LAUNCH = str(ROOT / "examples" / "launch_local.py")
SIZES = dict(vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, num_layers=1)
FLAGS = [
    "--vocab=64",
    "--features=32",
    "--heads=4",
    "--kv-heads=2",
    "--hidden=64",
    "--layers=1",
    "--batch=8",
    "--seq-len=16",
    "--lr=1e-2",
]


def _in_process(mesh, steps):
    config = TrainConfig(
        mesh=mesh,
        model=ModelSpec.tiny("train_lm", **SIZES),
        steps=steps,
        global_batch=8,
        seq_len=16,
        learning_rate=1e-2,
    )
    return Trainer(config, log=lambda line: None).run()


def _env(devices):
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _losses(log_path):
    return [record["loss"] for record in json.loads(pathlib.Path(log_path).read_text())["steps"]]


@pytest.mark.timeout(240)
def test_two_processes_match_one_process(tmp_path):
    log = tmp_path / "log.json"
    command = [sys.executable, LAUNCH, "--num-processes=2", "--devices-per-process=4"]
    command += ["--timeout=180", "--", sys.executable, TRAIN, *FLAGS, "--steps=3"]
    command += ["--mesh=data=2,sequence=2,model=2", "--spread-processes", f"--log-json={log}"]
    start = time.monotonic()
    done = subprocess.run(command, env=_env(4), capture_output=True, text=True, timeout=220)
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "[p0] step 3/3" in done.stdout and "[p1] step" not in done.stdout  # p0 logs alone
    assert seconds < 120, f"2-process run took {seconds:.0f} s"
    want = _in_process({"data": 2, "sequence": 2, "model": 2}, steps=3)
    np.testing.assert_allclose(_losses(log), want, rtol=0, atol=1e-6)


def _complete_steps(directory):
    """Checkpoint steps orbax has finalized (temporary directories excluded)."""
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.timeout(300)
def test_killed_run_resumes_where_it_stopped(tmp_path):
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    command = [sys.executable, TRAIN, *FLAGS, "--mesh=data=2,model=4"]
    command += [f"--checkpoint-dir={ckpt}", "--checkpoint-every=2", f"--log-json={log}"]
    victim = subprocess.Popen(
        [*command, "--steps=100000"],
        env=_env(8),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 150
        while not [s for s in _complete_steps(ckpt) if s >= 4]:
            assert victim.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no checkpoint of step 4 within 150 s"
            time.sleep(0.2)
        victim.send_signal(signal.SIGKILL)
    finally:
        victim.kill()
        victim.wait()
    resumed_from = max(_complete_steps(ckpt))
    target = resumed_from + 2
    done = subprocess.run(
        [*command, f"--steps={target}"],
        env=_env(8),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"resumed from step {resumed_from}" in done.stdout, done.stdout[-2000:]
    resumed = _losses(log)
    assert len(resumed) == 2  # the resumed run logs its own steps
    want = _in_process({"data": 2, "model": 4}, steps=target)
    # The runs compile apart: here with the suite's fast-compile XLA flags, there without
    # (_env drops XLA_FLAGS); after six steps the losses agree to a few float32 ulps
    # (1.2e-6 at 3.57 seen once in the full suite with the native CPU attention).
    np.testing.assert_allclose(resumed, want[-2:], rtol=1e-6, atol=1e-6)
