"""The README runs as written: every fenced python block, in order, one namespace per section.

A new user copies the README's blocks into a fresh Python on a CPU laptop. This
test does the same: for each `## ` section, a fresh interpreter (no conftest, no
8-device setup of the test suite) runs the README's own device-setup block (the
one that calls `jax_num_cpu_devices`) and then each python block of the section
in order, in one namespace. Any exception fails the test with the block's line
number in README.md.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SETUP_MARKER = "jax_num_cpu_devices"


def python_blocks(text: str):
    """`[(section title, first line number, code)]` for every ```python block."""
    blocks, section = [], None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        if line.strip() == "```python":
            start = i + 2  # 1-based number of the block's first code line
            body = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((section, start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def sections(text: str):
    """`{section: [(line, code)]}` in README order, and the device-setup block."""
    by_section: dict[str, list] = {}
    setup = None
    for section, line, code in python_blocks(text):
        if setup is None and SETUP_MARKER in code:
            setup = (line, code)
        by_section.setdefault(section, []).append((line, code))
    return by_section, setup


RUNNER = textwrap.dedent(
    """
    import json, sys
    blocks = json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
        print(f"README block at line {line}: ok", flush=True)
    """
)


def test_readme_has_python_blocks_and_a_device_setup():
    by_section, setup = sections(README.read_text())
    assert setup is not None, f"README.md shows no block calling {SETUP_MARKER}"
    assert sum(len(b) for b in by_section.values()) >= 5, by_section.keys()


_BY_SECTION, _SETUP = sections(README.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("section", list(_BY_SECTION))
def test_readme_section_runs_as_written(section, tmp_path):
    blocks = list(_BY_SECTION[section])
    if _SETUP is not None and _SETUP not in blocks:
        blocks.insert(0, _SETUP)  # the README's own setup: a fresh Python has 1 CPU device
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=540,
    )
    ran = re.findall(r"README block at line (\d+): ok", result.stdout)
    assert result.returncode == 0, (
        f"section {section!r} failed after blocks {ran}:\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-6000:]}"
    )
    assert [int(n) for n in ran] == [line for line, _ in blocks], (ran, result.stdout)
