"""Running the ```python blocks of a markdown file as a reader would: the one home of that.

`tests/test_readme.py` (README.md, one namespace per `## ` section) and
`tests/test_docs.py` (docs/*.md, one namespace per page) use it. A fresh
interpreter (no conftest, no 8-device setup of the test suite, no XLA_/JAX_
environment) runs the file's own device-setup block (the one that calls
`jax_num_cpu_devices`) and then the blocks in order, in one namespace. Any
exception fails with the block's file and line number. Two settings of the suite
do travel, since they change how fast XLA compiles and not what a program
computes: its XLA:CPU compile flags (`SHARDFUSE_TEST_XLA_FLAGS`, tests/conftest.py)
and its compilation cache (docs and README together on 2 workers: 107 -> 63 s on jax 0.10.2).
"""

import json
import os
import re
import subprocess
import sys
import textwrap

SETUP_MARKER = "jax_num_cpu_devices"


def python_blocks(text: str, section_prefix: str = "## "):
    """`[(section title, first line number, code)]` for every ```python block."""
    blocks, section = [], None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(section_prefix):
            section = line[len(section_prefix) :].strip()
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


def sections(text: str, section_prefix: str = "## "):
    """`{section: [(line, code)]}` in file order, and the device-setup block (or None)."""
    by_section: dict[str, list] = {}
    setup = None
    for section, line, code in python_blocks(text, section_prefix):
        if setup is None and SETUP_MARKER in code:
            setup = (line, code)
        by_section.setdefault(section, []).append((line, code))
    return by_section, setup


RUNNER = textwrap.dedent(
    """
    import json, sys
    name, blocks = json.loads(sys.stdin.read())
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile(code, f"{name}:{line}", "exec"), namespace)
        print(f"block at line {line}: ok", flush=True)
    """
)


def run_blocks(name: str, blocks, setup, cwd, timeout=540):
    """Runs `blocks` (`[(line, code)]`) of the file `name` in a fresh Python, `setup` first
    unless it is among them; fails with the output when a block raises or is skipped."""
    blocks = list(blocks)
    if setup is not None and setup not in blocks:
        blocks.insert(0, setup)  # the file's own setup: a fresh Python has 1 CPU device
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    if os.environ.get("SHARDFUSE_TEST_XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["SHARDFUSE_TEST_XLA_FLAGS"]
    for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):  # fmt: skip
        if key in os.environ:
            env[key] = os.environ[key]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([name, blocks]),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    ran = re.findall(r"block at line (\d+): ok", result.stdout)
    assert result.returncode == 0, (
        f"{name}: failed after the blocks at lines {ran}:\n{result.stdout[-3000:]}\n"
        f"{result.stderr[-6000:]}"
    )
    assert [int(n) for n in ran] == [line for line, _ in blocks], (ran, result.stdout)
