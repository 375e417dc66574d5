"""Shared pieces of the layer tests: meshes and tree comparisons."""

import jax
import numpy as np
from jax.sharding import Mesh

from shardfuse.testing import assert_close, assert_close_low_precision


def mesh_1d(size=4, name="model"):
    return Mesh(np.array(jax.devices()[:size]), (name,))


def mesh_3d():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "sequence", "model"))


def _flat(tree):
    return {
        jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def assert_trees_close(actual, expected, *, kind="grad", name="tree"):
    """float32 comparison of two pytrees with the same structure, leaf by leaf."""
    actual, expected = _flat(actual), _flat(expected)
    assert actual.keys() == expected.keys(), (actual.keys(), expected.keys())
    for key in actual:
        assert_close(
            np.asarray(actual[key]), np.asarray(expected[key]), kind=kind, name=f"{name}{key}"
        )


def assert_trees_close_low_precision(actual, ref32, ref_lp, *, kind="grad", name="tree"):
    actual, ref32, ref_lp = _flat(actual), _flat(ref32), _flat(ref_lp)
    assert actual.keys() == ref32.keys() == ref_lp.keys()
    for key in actual:
        assert_close_low_precision(
            actual[key], ref32[key], ref_lp[key], kind=kind, name=f"{name}{key}", relative_cap=True
        )


def assert_sharded_as(x, mesh, spec):
    """x's sharding is equivalent to `NamedSharding(mesh, spec)` (trailing Nones aside)."""
    from jax.sharding import NamedSharding

    expected = NamedSharding(mesh, spec)
    assert x.sharding.is_equivalent_to(expected, x.ndim), (x.sharding, expected)
