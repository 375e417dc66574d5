"""Sphinx configuration of the shardfuse documentation (MyST markdown, furo).

Build: `sphinx-build -W -b html docs docs/_build` (the `docs` extra installs what it needs).
"""

import os

# The API pages import shardfuse: one CPU device is enough, and no accelerator is probed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "shardfuse"
author = "the shardfuse developers"
copyright = "2026, the shardfuse developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# API reference: Google-style docstrings, signatures as written, no generated stub files.
autosummary_generate = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# The docstrings are Google style with markdown-like inline code (`x`), written for `help()`
# and the editor: docutils' formatting notes on them (a field list without a blank line,
# an unclosed `*`) are not build failures. Everything else stays an error under -W: the
# pages' own MyST (myst.*), missing references, and any name autodoc cannot import.
suppress_warnings = ["docutils"]

html_theme = "furo"
html_title = "shardfuse"
