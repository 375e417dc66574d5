"""The pytest-benchmark suites of `shardfuse bench`, one module `bench_FAMILY.py` per op family.

Installed with the package, so that `shardfuse bench` runs them from a wheel. Their
pytest setup (options, the run's scale, the JSON's "shardfuse" key) is `conftest.py`
beside them, their pytest settings `pytest.ini`. Run them with `shardfuse bench`, or
through pytest directly: `python -m pytest "$(python -m shardfuse.bench.suites)" --bench-quick`.
"""
