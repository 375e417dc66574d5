"""Generated case matrices that cover every pair of factor values (strength-2 covering arrays).

A matrix of k factors with n values each has n**k cells; most bugs that a cell
finds need only two factors to coincide (a layout with a mask, a ring size with
a head grouping). `pairwise` returns rows in which every value of every factor
meets every value of every other factor at least once: for four factors of
2-4 values, 8-16 rows instead of 24-48. The slow suite runs these rows, so CI
can afford it; `SHARDFUSE_FULL_MATRIX=1` returns the whole product for a run
by hand before a change to what a matrix covers.

>>> rows = pairwise((2, 4), ("contiguous", "zigzag", "striped"), (True, False))
>>> len(rows) < 2 * 3 * 2
True
>>> covers_every_pair(rows, [(2, 4), ("contiguous", "zigzag", "striped"), (True, False)])
True
"""

import itertools
import os


def _pairs(row):
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def covers_every_pair(rows, factors):
    """Whether `rows` hold every pair of values of every two factors."""
    want = set().union(*(_pairs(row) for row in itertools.product(*factors)))
    return want <= set().union(*(_pairs(row) for row in rows))


def pairwise(*factors):
    """Rows (tuples, one value per factor) covering every pair of values of any two factors.

    Deterministic greedy construction: each row is the cell of the full product
    that covers the most pairs not yet covered (the earliest cell on ties), so
    the first row is the product's first cell. One factor gives its values; the
    whole product is returned with SHARDFUSE_FULL_MATRIX=1.

    >>> pairwise((1, 2), ("a", "b"))
    [(1, 'a'), (1, 'b'), (2, 'a'), (2, 'b')]
    >>> len(pairwise((1, 2), ("a", "b"), (True, False)))
    4
    """
    if not factors or any(len(f) == 0 for f in factors):
        raise ValueError(f"factors: every factor needs at least one value, got {factors}")
    cells = list(itertools.product(*factors))
    if len(factors) < 3 or os.environ.get("SHARDFUSE_FULL_MATRIX") == "1":
        return cells
    uncovered = set().union(*(_pairs(cell) for cell in cells))
    rows = []
    while uncovered:
        best = max(cells, key=lambda cell: len(_pairs(cell) & uncovered))
        rows.append(best)
        uncovered -= _pairs(best)
    return rows
