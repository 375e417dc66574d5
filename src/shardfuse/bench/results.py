"""Benchmark results: the pytest-benchmark JSON, one record per case, ratios, comparisons.

A run is stored as pytest-benchmark writes it (`--benchmark-json`): machine and
commit info, and per case `group`, `name`, `stats` (seconds) and our
`extra_info` (see `shardfuse.bench.harness`). `pytest-benchmark compare` reads
these files too.

Ratios to a baseline are taken inside one run and one group (cases that
differ only by implementation): `speedup_vs_baseline = baseline median /
median`, > 1 is faster than the baseline. On a loaded or noisy machine both
slow down together, so this ratio is the number that survives; `compare`
uses it when both runs have it, and raw median times otherwise.
"""

import dataclasses
import json
import math
from pathlib import Path

OK, REGRESSION, IMPROVEMENT, NEW, MISSING = "ok", "regression", "improvement", "new", "missing"
# A figure nobody publishes (CPU peaks) or that this run could not compute.
NOT_AVAILABLE = "n/a"


def attach_baseline_ratios(benchmarks: list[dict]) -> list[dict]:
    """Adds `speedup_vs_baseline` and `baseline_median_s` to each benchmark's `extra_info`.

    Args:
      benchmarks: the "benchmarks" list of a pytest-benchmark JSON (edited in place).

    Returns:
      The same list. A case whose group has no timed baseline gets None.

    Example:
      >>> from shardfuse.bench.results import attach_baseline_ratios
      >>> runs = [{"group": "g", "stats": {"median": t},
      ...          "extra_info": {"implementation": impl, "baseline": "b"}}
      ...         for impl, t in (("b", 2.0), ("x", 1.0))]
      >>> attach_baseline_ratios(runs)[1]["extra_info"]["speedup_vs_baseline"]
      2.0
    """
    medians = {}
    for bench in benchmarks:
        info = bench.get("extra_info") or {}
        median = (bench.get("stats") or {}).get("median")
        if median:
            medians[(bench.get("group"), info.get("implementation"))] = median
    for bench in benchmarks:
        info = bench.setdefault("extra_info", {})
        median = (bench.get("stats") or {}).get("median")
        base = medians.get((bench.get("group"), info.get("baseline")))
        info["baseline_median_s"] = base
        info["speedup_vs_baseline"] = base / median if (base and median) else None
    return benchmarks


@dataclasses.dataclass(frozen=True)
class Record:
    """One benchmark case of a run, flattened for tables, plots and comparisons."""

    group: str
    op: str
    implementation: str
    mode: str
    model: str
    variant: str
    shape: dict
    dtype: str
    seq_len: int | None
    median_s: float | None
    tflops_per_s: float | None
    gb_per_s: float | None
    pct_peak_flops: float | str
    temp_bytes: int | None
    baseline: str | None
    speedup_vs_baseline: float | None

    @property
    def key(self) -> str:
        """Identifies the case across runs: group and implementation."""
        return f"{self.group} | {self.implementation}"

    @property
    def shape_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())


def _number(value):
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def records(data: dict) -> list[Record]:
    """The cases of a pytest-benchmark JSON dict, as `Record`s (untimed cases have None times).

    Example:
      >>> from shardfuse.bench.results import records
      >>> records({"benchmarks": []})
      []
    """
    out = []
    for bench in data.get("benchmarks", []):
        info = bench.get("extra_info") or {}
        memory = info.get("memory") or {}
        pct = info.get("pct_peak_flops", NOT_AVAILABLE)
        out.append(
            Record(
                group=bench.get("group") or bench.get("name", ""),
                op=info.get("op", ""),
                implementation=info.get("implementation", bench.get("name", "")),
                mode=info.get("mode", ""),
                model=info.get("model", ""),
                variant=info.get("variant", ""),
                shape=dict(info.get("shape") or {}),
                dtype=info.get("dtype", ""),
                seq_len=info.get("seq_len"),
                median_s=_number((bench.get("stats") or {}).get("median")),
                tflops_per_s=_number(info.get("tflops_per_s")),
                gb_per_s=_number(info.get("gb_per_s")),
                pct_peak_flops=pct if pct == NOT_AVAILABLE else _number(pct),
                temp_bytes=_number(memory.get("temp_bytes")),
                baseline=info.get("baseline"),
                speedup_vs_baseline=_number(info.get("speedup_vs_baseline")),
            )
        )
    return out


def load(path) -> dict:
    """Reads a run (pytest-benchmark JSON) and fills in baseline ratios if missing.

    Raises:
      FileNotFoundError: no file at `path`.
      ValueError: the file is not a pytest-benchmark JSON.

    Example:
      >>> from shardfuse.bench import results
      >>> data = results.load("bench/results/2026-11-21_cpu_amd-epyc-2core.json")  # doctest: +SKIP
    """
    path = Path(path)
    with path.open() as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ValueError(f"{path} is not a pytest-benchmark JSON (no 'benchmarks' list)")
    attach_baseline_ratios(data["benchmarks"])
    return data


def save(data: dict, path) -> None:
    """Writes a run as JSON (the pytest-benchmark layout), creating parent folders.

    Example:
      >>> from shardfuse.bench import results
      >>> results.save({"benchmarks": []}, "/tmp/run.json")
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One case compared between a saved run (old) and this one (new).

    Attributes:
      key: `Record.key`.
      old, new: the records (None when the case is only in one run).
      time_ratio: new median / old median (> 1: slower).
      relative_ratio: old speedup_vs_baseline / new speedup_vs_baseline
        (> 1: slower relative to the baseline of its own run), when both have one.
      status: "ok", "regression", "improvement", "new" or "missing".
    """

    key: str
    old: Record | None
    new: Record | None
    time_ratio: float | None
    relative_ratio: float | None
    status: str

    @property
    def ratio(self) -> float | None:
        """The ratio the status is decided on: relative when known, else time."""
        return self.relative_ratio if self.relative_ratio is not None else self.time_ratio


def compare(old: list[Record], new: list[Record], threshold: float = 0.1) -> list[Comparison]:
    """Compares two runs case by case and flags regressions.

    A case regresses when its ratio (relative to the baseline when both runs
    have one, else raw median time) is worse by more than `threshold`
    (0.1 = 10% slower); it improves when better by as much. The baseline
    cases themselves have ratio 1 to themselves, so they are compared on time.

    Args:
      old: records of the saved run.
      new: records of this run.
      threshold: relative change that counts, > 0.

    Returns:
      One `Comparison` per case in either run, in `new`'s order then the missing ones.

    Raises:
      ValueError: threshold <= 0 or not finite.

    Example:
      >>> from shardfuse.bench.results import compare, records
      >>> def run(t): return records({"benchmarks": [{"group": "g", "stats": {"median": t},
      ...                             "extra_info": {"implementation": "x"}}]})
      >>> compare(run(1.0), run(1.5))[0].status
      'regression'
    """
    if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold={threshold!r} must be a finite number > 0 (0.1 = 10%)")
    old_by_key = {r.key: r for r in old}
    new_keys = set()
    result = []
    for rec in new:
        new_keys.add(rec.key)
        before = old_by_key.get(rec.key)
        if before is None:
            result.append(Comparison(rec.key, None, rec, None, None, NEW))
            continue
        time_ratio = None
        if before.median_s and rec.median_s:
            time_ratio = rec.median_s / before.median_s
        relative = None
        is_baseline = rec.implementation == rec.baseline
        if not is_baseline and before.speedup_vs_baseline and rec.speedup_vs_baseline:
            relative = before.speedup_vs_baseline / rec.speedup_vs_baseline
        decisive = relative if relative is not None else time_ratio
        status = OK
        if decisive is not None and decisive > 1 + threshold:
            status = REGRESSION
        elif decisive is not None and decisive < 1 / (1 + threshold):
            status = IMPROVEMENT
        result.append(Comparison(rec.key, before, rec, time_ratio, relative, status))
    for rec in old:
        if rec.key not in new_keys:
            result.append(Comparison(rec.key, rec, None, None, None, MISSING))
    return result


def regressions(comparisons: list[Comparison]) -> list[Comparison]:
    """The comparisons with status "regression"."""
    return [c for c in comparisons if c.status == REGRESSION]
