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


def _modules_named(text: str) -> list[str]:
    """The `...py` files and `.../` folders named in backticks in the rows of a Markdown table."""
    import re

    rows = [line for line in text.splitlines() if line.startswith("| `")]
    return sorted({name for row in rows for name in re.findall(r"`([\w*./]+(?:\.py|/))`", row)})


def _exists(name: str, package: pathlib.Path) -> bool:
    """`name` (a file, a glob like `pallas_tpu*.py`, or a folder ending in `/`) is under
    `package`, at that relative path or as the tail of one (`api.py` of a row's folder)."""
    import fnmatch

    paths = [p.relative_to(package).as_posix() for p in package.rglob("*")]
    paths += [p + "/" for p in paths if (package / p).is_dir()]
    return any(fnmatch.fnmatch(p, name) or fnmatch.fnmatch(p, f"*/{name}") for p in paths)


def test_every_module_the_design_page_names_exists():
    """docs/design.md's map of the source names only modules and folders that exist (a
    `models.py` it once listed did not), and names the packages of `src/shardfuse`."""
    package = pathlib.Path(__file__).resolve().parents[1] / "src" / "shardfuse"
    named = _modules_named((DOCS / "design.md").read_text())
    root = package.parents[1]  # the repository's own folders (`bench/results/`)
    missing = [name for name in named if not (_exists(name, package) or (root / name).exists())]
    assert not missing, f"docs/design.md names modules that do not exist: {missing}"
    packages = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()}
    unnamed = {p for p in packages if not any(name.startswith(p) for name in named)}
    assert not unnamed, f"docs/design.md does not map the packages {sorted(unnamed)}"
    assert not _exists("models.py", package) and _exists("model_spec.py", package)
