"""One home for the differential tests' hypothesis budgets.

Every generated test in this package runs twice: a small, fixed-seed budget in the
default suite, and a large one under ``-m slow`` (CI runs both). ``settings(n_default,
n_slow)`` gives the two hypothesis settings; ``budget_params`` parametrizes a test over
them so that the slow run carries the ``slow`` marker.

``SHARDFUSE_TEST_SEED=<int>`` draws other configurations (hypothesis seeded with it, not
derandomized): a bug hunt beyond the fixed draws, e.g.
``SHARDFUSE_TEST_SEED=7 python -m pytest -m slow tests/differential``. A failure prints
the configuration and the ``@reproduce_failure`` blob.

Example:
  >>> from tests.differential.budget import budget_params
  >>> [p.id for p in budget_params(4, 40)]
  ['default', 'slow']
"""

from __future__ import annotations

import os

import hypothesis
import pytest

SEED = os.environ.get("SHARDFUSE_TEST_SEED")  # None: the fixed (derandomized) draws


def settings(max_examples: int) -> hypothesis.settings:
    """Hypothesis settings for a differential test: derandomized (a fixed seed), no deadline
    (XLA compiles), no database, shrinking kept short (each example compiles a program)."""
    return hypothesis.settings(
        max_examples=max_examples,
        derandomize=SEED is None,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate, hypothesis.Phase.shrink),
    )


def seeded(test):
    """`test` (a `hypothesis.given` test) seeded with SHARDFUSE_TEST_SEED when it is set."""
    return test if SEED is None else hypothesis.seed(int(SEED))(test)


def budget_params(n_default: int, n_slow: int):
    """``pytest.param``s for the default and the slow budget (the slow one marked ``slow``)."""
    return [
        pytest.param(n_default, id="default"),
        pytest.param(n_slow, id="slow", marks=pytest.mark.slow),
    ]


def run(test_body, strategy, max_examples: int) -> None:
    """Draw ``max_examples`` configurations from ``strategy`` and run ``test_body`` on each.

    ``test_body(config)`` compares the entry point with its oracle and asserts; a
    configuration the API refuses must raise ``ValueError``/``TypeError`` from it, which
    the body checks itself.
    """

    @settings(max_examples)
    @hypothesis.given(strategy)
    def _drawn(config):
        test_body(config)

    seeded(_drawn)()


def assert_catches(plant, check, strategy, max_examples: int, monkeypatch) -> None:
    """Under the planted bug `plant(monkeypatch)`, `check` fails on some drawn configuration.

    Compiled programs of the healthy code are dropped before and after (they must not be
    reused), draws are not shrunk, and the mutation is undone whatever happens.
    """
    import jax

    jax.clear_caches()
    plant(monkeypatch)
    try:
        no_shrink = hypothesis.settings(
            settings(max_examples), phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate)
        )

        @no_shrink
        @hypothesis.given(strategy)
        def drawn(case):
            check(case)

        with pytest.raises(AssertionError):
            drawn()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
