"""`shardfuse.testing`'s low-precision rule: the cap, its depth, bad arguments."""

import numpy as np
import pytest

from shardfuse.testing import assert_close_low_precision


def test_the_cap_is_one_percent_of_the_magnitude_per_layer_of_depth():
    import ml_dtypes

    ref32 = np.array([4.0, -1.0, 0.5], np.float32)
    ref_lp = (ref32 + np.array([0.06, 0.0, 0.0], np.float32)).astype(ml_dtypes.bfloat16)
    actual = ref32 + np.array([0.06, 0.0, 0.0], np.float32)
    # Within twice the reference's error, but over 1% of max|ref32| = 0.04: one layer fails.
    with pytest.raises(AssertionError, match="cap"):
        assert_close_low_precision(actual, ref32, ref_lp, relative_cap=True)
    # Two layers round twice: a cap of 0.08 holds.
    assert_close_low_precision(actual, ref32, ref_lp, relative_cap=True, depth=2)
    # A result twice as far off as the reference fails at any depth.
    worse = ref32 + np.array([0.3, 0.0, 0.0], np.float32)
    with pytest.raises(AssertionError, match="low-precision reference error"):
        assert_close_low_precision(worse, ref32, ref_lp, relative_cap=True, depth=8)


@pytest.mark.parametrize("depth", [0, -1, 1.5, True, "2"])
def test_bad_depth_is_named(depth):
    ref = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="depth="):
        assert_close_low_precision(ref, ref, ref, depth=depth)
