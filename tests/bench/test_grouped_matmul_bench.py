"""The grouped matmul benchmarks' cases: routings, contenders that agree, and the suite's
cases compiling and running once (`--benchmark-disable`)."""

import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse.bench import moe
from shardfuse.bench.cli import SUITES_DIR
from tests.bench.test_cli import REPO, _env


@pytest.mark.parametrize("routing", moe.ROUTINGS)
@pytest.mark.parametrize("groups", [1, 8, 64])
def test_group_sizes_sum_to_the_rows(routing, groups):
    sizes = moe.group_sizes(1000, groups, routing)
    assert sizes.dtype == np.int32 and sizes.shape == (groups,) and sizes.sum() == 1000
    if routing == "balanced":
        assert sizes.max() - sizes.min() <= 1
    elif groups > 1:  # Zipf: the first expert takes the most, far above a balanced share
        assert sizes[0] == sizes.max() > 2 * 1000 / groups


def test_contenders_compute_the_same_product():
    shape = moe.MoeShape("tiny", experts=4, top_k=2, hidden=16, expert_hidden=8)
    lhs, rhs, sizes, _ = moe.inputs(shape, tokens=10, routing="skewed", dtype=jnp.float32)
    sizes = sizes.at[jnp.argmax(sizes)].add(-3)  # 3 rows past the sum: zeros for every one
    outs = {}
    for name in ("shardfuse", *moe.PEERS):
        try:
            outs[name] = moe.contender(name)(lhs, rhs, sizes)
        except ImportError:  # tokamax: the peers extra, not on every CI stack
            assert name == "tokamax.ragged_dot"
    expected = outs.pop("jax.lax.ragged_dot")
    assert not np.asarray(expected[-3:]).any()
    for name, out in outs.items():
        np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5, err_msg=name)
    dense = moe.contender(moe.DENSE)(lhs, rhs[0])
    np.testing.assert_allclose(dense[: sizes[0]], expected[: sizes[0]], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="routing='uniform'"):
        moe.group_sizes(10, 2, "uniform")
    with pytest.raises(ValueError, match="contender 'cublas'"):
        moe.contender("cublas")
    assert jax.default_backend() == "cpu"


def test_suite_cases_run_once():
    """One quick group (every contender, forward + backward) compiles, runs and is finite."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(SUITES_DIR / "bench_grouped_matmul.py"), "--bench-quick", "--benchmark-disable",
         "-k", "olmoe-1b-7b-skewed"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # tokamax (the peers extra) is not on every CI stack: then its case is skipped with why.
    has_tokamax = importlib.util.find_spec("tokamax") is not None
    assert ("5 passed" if has_tokamax else "4 passed, 1 skipped") in proc.stdout, proc.stdout
