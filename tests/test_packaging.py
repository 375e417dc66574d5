"""What each extra installs: `.[test]` stays light (no torch), and CI installs every test extra."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def names(requirements):
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_test_extra_pulls_no_torch():
    # torch (a CUDA build of several GB on a standard Linux install) only for the Triton
    # interpreter tests, in their own extra (issue 13 item 9).
    assert "torch" not in names(EXTRAS["test"])
    assert {"torch", "triton"} <= names(EXTRAS["triton-interpret"])
    assert "torch" not in names(PROJECT["dependencies"])


def test_readme_test_command_installs_every_test_extra():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    installed = re.search(r'pip install -e "\.\[([^\]]+)\]"', block)
    assert installed, block
    assert {"test", "triton-interpret"} <= set(installed.group(1).split(","))
    assert "pytest" in block


def test_readme_says_what_each_extra_brings():
    readme = (ROOT / "README.md").read_text()
    for extra in EXTRAS:
        assert f"| `{extra}` |" in readme, extra
