"""The documentation site (docs/, Sphinx + MyST) builds cleanly and its examples run.

Every ```python block of every page runs as written, in order, in one namespace
per page, in a fresh Python (`tests/doc_blocks.py`, as for the README); a page
without its own device-setup block gets the one of docs/install.md first. The
build runs `sphinx-build -W` (warnings are errors), skipped where the `docs`
extra (sphinx, myst-parser, furo) is not installed.
"""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from tests.doc_blocks import SETUP_MARKER, python_blocks, run_blocks, sections

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
_, SETUP = sections((DOCS / "install.md").read_text())
WITH_BLOCKS = [name for name in PAGES if python_blocks((DOCS / name).read_text())]


def test_every_capability_has_a_page_in_the_toctree():
    index = (DOCS / "index.md").read_text()
    for page in PAGES:
        if page != "index.md":
            assert f"\n{page.removesuffix('.md')}\n" in index, f"{page} is not in index.md"
    capabilities = ("kernels", "context_parallel", "layers", "memory", "pipeline", "planning",
                    "training", "profiling", "benchmarks", "design", "api")  # fmt: skip
    for capability in capabilities:
        assert f"{capability}.md" in PAGES, capability
    assert SETUP is not None and SETUP_MARKER in SETUP[1]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", WITH_BLOCKS)
def test_page_runs_as_written(page, tmp_path):
    blocks = [(line, code) for _, line, code in python_blocks((DOCS / page).read_text())]
    own_setup = next(((ln, c) for ln, c in blocks if SETUP_MARKER in c), None)
    setup = own_setup or (SETUP[0], SETUP[1])
    run_blocks(f"docs/{page}", blocks, setup, tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("sphinx", "myst_parser", "furo")),
    reason='the docs extra is not installed: pip install -e ".[docs]"',
)
def test_sphinx_build_has_no_warnings(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (tmp_path / "html" / "index.html").is_file()
    assert (tmp_path / "html" / "api.html").is_file()
