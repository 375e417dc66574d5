"""The README runs as written: every fenced python block, in order, one namespace per section.

A new user copies the README's blocks into a fresh Python on a CPU laptop. This
test does the same (`tests/doc_blocks.py`, shared with the docs' test): for each
`## ` section, a fresh interpreter (no conftest, no 8-device setup of the test
suite) runs the README's own device-setup block (the one that calls
`jax_num_cpu_devices`) and then each python block of the section in order, in
one namespace. Any exception fails the test with the block's line number in
README.md.
"""

import ast
import pathlib

import pytest

from tests.doc_blocks import SETUP_MARKER, python_blocks, run_blocks, sections

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_has_python_blocks_and_a_device_setup():
    by_section, setup = sections(README.read_text())
    assert setup is not None, f"README.md shows no block calling {SETUP_MARKER}"
    assert sum(len(b) for b in by_section.values()) >= 3, by_section.keys()


def test_readme_is_short_and_imports_only_the_public_api():
    """At most 300 lines, and the blocks reach everything through `import shardfuse as sf`,
    never through a module path (`shardfuse.layers.stack`, `shardfuse.parallel.zero`)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    deep = []
    for _, line, code in python_blocks(text):
        for node in ast.walk(ast.parse(code)):
            at = f"README.md:{line + getattr(node, 'lineno', 1) - 1}"
            if isinstance(node, ast.Import):
                deep += [f"{at}: import {a.name}" for a in node.names if "shardfuse." in a.name]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardfuse"):
                deep.append(f"{at}: from {node.module} import ...")
    assert not deep, deep


_BY_SECTION, _SETUP = sections(README.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("section", list(_BY_SECTION))
def test_readme_section_runs_as_written(section, tmp_path):
    run_blocks("README.md", _BY_SECTION[section], _SETUP, tmp_path)
