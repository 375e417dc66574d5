"""Memory: the xla path's forward+backward temp bytes grow linearly in S, the reference's
quadratically (compiled, never run). Runs in a subprocess because XLA_FLAGS must be set
before JAX starts (YNNPACK fusion on XLA:CPU hides temporaries otherwise)."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parents[3] / "scripts" / "attention_memory.py"


def test_xla_memory_linear_reference_quadratic():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--seq-lens", "4096", "16384", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    temp = json.loads(result.stdout.strip().splitlines()[-1])
    xla, ref = temp["xla"], temp["reference"]
    xla_ratio = xla["16384"] / xla["4096"]
    assert xla_ratio <= 4.5, f"xla temp memory grew {xla_ratio:.2f}x for 4x longer S: {xla}"
    # O(T*S) scores: 16x; allow for O(S) terms.
    assert ref["16384"] / ref["4096"] >= 12, ref
    # And the xla path holds no [H, T, S] float32 score tensor at S = 16384.
    assert xla["16384"] < 8 * 16384 * 16384 * 4 / 16, xla
