"""Results of the benchmark harness: JSON round trip, baseline ratios, comparing runs."""

import json

import pytest

from shardfuse.bench import results


def _bench(group, implementation, median, *, baseline="base", speedup=None, **info):
    extra = {
        "op": "flash_attention",
        "implementation": implementation,
        "mode": "fwd",
        "model": "llama3-8b",
        "variant": "causal",
        "shape": {"B": 1, "T": 512, "H": 4},
        "dtype": "float32",
        "seq_len": 512,
        "tflops_per_s": 1.5,
        "gb_per_s": 2.0,
        "pct_peak_flops": "n/a",
        "memory": {"temp_bytes": 1024},
        "baseline": baseline,
        **info,
    }
    if speedup is not None:
        extra["speedup_vs_baseline"] = speedup
    stats = {"median": median} if median is not None else None
    return {"group": group, "name": f"test[{implementation}]", "stats": stats, "extra_info": extra}


def _run(*benches):
    return {"machine_info": {"node": "test"}, "benchmarks": list(benches)}


def test_baseline_ratios_within_each_group():
    benches = [
        _bench("g1", "base", 2.0),
        _bench("g1", "fast", 1.0),
        _bench("g2", "fast", 1.0),  # no baseline in g2
        _bench("g1", "untimed", None),
    ]
    results.attach_baseline_ratios(benches)
    speedups = [b["extra_info"]["speedup_vs_baseline"] for b in benches]
    assert speedups == [1.0, 2.0, None, None]
    assert benches[1]["extra_info"]["baseline_median_s"] == 2.0


def test_json_round_trip(tmp_path):
    data = _run(_bench("g", "base", 2.0), _bench("g", "fast", 0.5))
    path = tmp_path / "sub" / "run.json"
    results.save(data, path)
    loaded = results.load(path)
    expected = json.loads(json.dumps(data))
    results.attach_baseline_ratios(expected["benchmarks"])  # load fills in the ratios
    assert loaded == expected
    assert loaded["machine_info"] == {"node": "test"}
    records = results.records(loaded)
    assert [r.implementation for r in records] == ["base", "fast"]
    fast = records[1]
    assert fast.speedup_vs_baseline == 4.0
    assert fast.shape == {"B": 1, "T": 512, "H": 4}
    assert list(fast.shape) == ["B", "T", "H"]  # order kept for the tables
    assert fast.temp_bytes == 1024 and fast.pct_peak_flops == "n/a"
    assert fast.key == "g | fast"
    results.save(loaded, path)  # a second round trip changes nothing
    assert results.records(results.load(path)) == records


def test_load_rejects_other_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        results.load(bad)
    bad.write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a pytest-benchmark JSON"):
        results.load(bad)
    with pytest.raises(FileNotFoundError):
        results.load(tmp_path / "missing.json")


def _records(*benches):
    data = _run(*benches)
    results.attach_baseline_ratios(data["benchmarks"])
    return results.records(data)


def _status(comparisons):
    return {c.key: c.status for c in comparisons}


def test_compare_flags_regressions_improvements_new_and_missing():
    old = _records(
        _bench("g", "base", 1.0),
        _bench("g", "a", 1.0),
        _bench("g", "b", 1.0),
        _bench("g", "gone", 1.0),
    )
    new = _records(
        _bench("g", "base", 1.0),
        _bench("g", "a", 1.5),
        _bench("g", "b", 0.5),
        _bench("g", "added", 1.0),
    )
    comparisons = results.compare(old, new, threshold=0.1)
    assert _status(comparisons) == {
        "g | base": "ok",
        "g | a": "regression",
        "g | b": "improvement",
        "g | added": "new",
        "g | gone": "missing",
    }
    a = next(c for c in comparisons if c.key == "g | a")
    assert a.time_ratio == pytest.approx(1.5) and a.relative_ratio == pytest.approx(1.5)
    assert [c.key for c in results.regressions(comparisons)] == ["g | a"]


def test_compare_uses_the_ratio_to_the_baseline_of_each_run():
    """A machine twice as slow slows the baseline too: no regression; relative slow-down: one."""
    old = _records(_bench("g", "base", 1.0), _bench("g", "a", 0.5))
    loaded_machine = _records(_bench("g", "base", 2.0), _bench("g", "a", 1.0))
    comparisons = results.compare(old, loaded_machine, threshold=0.1)
    status = _status(comparisons)
    assert status["g | a"] == "ok"  # time 2x, ratio to baseline unchanged
    assert status["g | base"] == "regression"  # the baseline itself is judged on time
    a = next(c for c in comparisons if c.key == "g | a")
    assert a.time_ratio == pytest.approx(2.0) and a.ratio == pytest.approx(1.0)

    relative = _records(_bench("g", "base", 1.0), _bench("g", "a", 0.6))
    assert _status(results.compare(old, relative, threshold=0.1))["g | a"] == "regression"
    assert _status(results.compare(old, relative, threshold=0.25))["g | a"] == "ok"


def test_compare_without_times_or_with_bad_threshold():
    old = _records(_bench("g", "a", None))
    new = _records(_bench("g", "a", 1.0))
    assert _status(results.compare(old, new)) == {"g | a": "ok"}
    for bad in (0, -0.1, float("nan"), "10%"):
        with pytest.raises(ValueError, match="threshold"):
            results.compare(old, new, threshold=bad)
