"""`tests/pairwise.py`: generated factor sets, every pair covered, fewer rows than the product."""

import itertools
import random

import pytest

from tests.pairwise import covers_every_pair, pairwise


@pytest.mark.parametrize("seed", range(20))
def test_every_pair_is_covered(seed):
    rng = random.Random(seed)
    factors = [tuple(range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
    rows = pairwise(*factors)
    assert covers_every_pair(rows, factors)
    assert set(rows) <= set(itertools.product(*factors))
    assert len(rows) == len(set(rows)) <= max(len(list(itertools.product(*factors))), 1)
    assert rows == pairwise(*factors)  # deterministic: the same ids on every worker


def test_fewer_rows_than_the_product():
    factors = [(1, 2, 4, 8), ("contiguous", "zigzag", "striped"), (True, False), (2, 1)]
    assert len(pairwise(*factors)) <= 16 < 48


def test_full_matrix_switch(monkeypatch):
    monkeypatch.setenv("SHARDFUSE_FULL_MATRIX", "1")
    assert len(pairwise((1, 2), (1, 2), (1, 2))) == 8


def test_empty_factor_is_refused():
    with pytest.raises(ValueError, match="factors"):
        pairwise((1, 2), ())
