"""The tiny LM example trains on a 2x2x2 mesh, its loss goes down, and it compiles once."""

import pathlib

import jax

from shardfuse.demos.tiny_lm import train

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_lm_loss_goes_down_and_compiles_once():
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    times, registered = [], []

    def log(line):
        if len(times) == 1:  # first step done: count compilations from now on
            jax.monitoring.register_event_duration_secs_listener(listener)
            registered.append(listener)

    try:
        losses = train(steps=8, layers=1, log=log, times=times)
    finally:  # (only if registered: an error in the first step must show as itself)
        for callback in registered:
            jax.monitoring.unregister_event_duration_listener(callback)
    assert all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < 0.9 * losses[0], losses
    assert len(times) == 8
    # Steps 2..8 reuse the first step's program (a recompile would show here).
    assert compiles == [], f"{len(compiles)} compilations after the first step"


def test_examples_use_no_private_helpers():
    for path in (ROOT / "examples" / "tiny_lm.py", ROOT / "src/shardfuse/demos/tiny_lm.py"):
        source = path.read_text()
        assert "_sharding" not in source, path
        assert "import shardfuse.layers._" not in source, path
