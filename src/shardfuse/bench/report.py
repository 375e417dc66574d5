"""Benchmark tables (rich) and the throughput plot (matplotlib, optional)."""

import importlib.util
from collections import defaultdict

from rich.markup import escape

from shardfuse.bench.results import IMPROVEMENT, MISSING, NEW, NOT_AVAILABLE, REGRESSION

PLOT_HINT = (
    "plotting needs matplotlib, which is not installed: pip install 'shardfuse[plot]' "
    "(or pip install matplotlib)"
)


def format_seconds(seconds) -> str:
    """`1.2 ms`, `340 us`, `2.10 s`; "-" for None.

    Example:
      >>> from shardfuse.bench.report import format_seconds
      >>> format_seconds(0.0012), format_seconds(None)
      ('1.20 ms', '-')
    """
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def format_bytes(count) -> str:
    """`12.0 MiB`; "-" for None.

    Example:
      >>> from shardfuse.bench.report import format_bytes
      >>> format_bytes(3 * 2**20)
      '3.0 MiB'
    """
    if count is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def _number(value, fmt) -> str:
    if value is None:
        return "-"
    if value == NOT_AVAILABLE:
        return NOT_AVAILABLE
    return format(value, fmt)


def _ratio(record) -> str:
    if record.implementation == record.baseline:
        return "baseline"
    return "-" if record.speedup_vs_baseline is None else f"{record.speedup_vs_baseline:.2f}x"


def print_table(records, console=None, title="shardfuse bench") -> None:
    """Prints the run: one table per op / mode / model / variant / dtype, one row per case.

    Columns: shape, implementation, median time, TFLOP/s, % of the device's
    peak, GB/s, compiled temp memory, and the speedup over the group's
    baseline (its median / this median, same run; > 1 is faster).

    Example:
      >>> from shardfuse.bench import report
      >>> report.print_table([])
      no benchmark results
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not records:
        console.print("no benchmark results")
        return
    families = defaultdict(list)
    for rec in records:
        families[(rec.op, rec.mode, rec.model, rec.variant, rec.dtype)].append(rec)
    console.rule(title)
    for family, members in sorted(families.items()):
        table = Table(title=escape(" | ".join(p for p in family if p)), title_justify="left")
        for column in ("shape", "implementation"):
            table.add_column(column)
        for column in ("median", "TFLOP/s", "% peak", "GB/s", "temp mem", "vs baseline"):
            table.add_column(column, justify="right")
        previous_group = None
        for rec in sorted(members, key=lambda r: (r.seq_len or 0, r.group, r.implementation)):
            if previous_group is not None and rec.group != previous_group:
                table.add_section()
            previous_group = rec.group
            table.add_row(
                escape(rec.shape_text),
                escape(rec.implementation),
                format_seconds(rec.median_s),
                _number(rec.tflops_per_s, ".3g"),
                _number(rec.pct_peak_flops, ".1f"),
                _number(rec.gb_per_s, ".3g"),
                format_bytes(rec.temp_bytes),
                _ratio(rec),
            )
        console.print(table)
    console.print(
        "vs baseline: the group's baseline median / this median, measured in the same run "
        "(> 1 is faster). % peak: of the device's dense peak (n/a on CPU). GB/s: compulsory "
        "bytes / time. temp mem: compiled temporary memory (memory_analysis)."
    )


def print_skipped(skipped, console=None) -> None:
    """Prints the cases that did not run (so are not in the table), grouped by reason.

    Args:
      skipped: `[{"case": nodeid, "reason": text}, ...]`, the "skipped" list that
        `shardfuse/bench/suites/conftest.py` writes under the JSON's "shardfuse" key. Reasons start
        with the implementation ("shardfuse.triton cannot run this case: ...").
      console: a rich Console (default: a new one).

    Example:
      >>> from shardfuse.bench import report
      >>> report.print_skipped([{"case": "a", "reason": "shardfuse.triton: no GPU"}] * 2)
      skipped (not in the table): 2 case(s)
        2x shardfuse.triton: no GPU
    """
    from rich.console import Console

    console = console or Console()
    if not skipped:
        return
    counts = defaultdict(int)
    for entry in skipped:
        counts[str(entry.get("reason", "skipped"))] += 1
    console.print(f"skipped (not in the table): {len(skipped)} case(s)")
    for reason, count in sorted(counts.items()):
        console.print(f"  {count}x {reason}", markup=False, highlight=False)


def print_comparison(comparisons, threshold, console=None) -> None:
    """Prints the cases that changed between a saved run and this one, regressions first.

    Example:
      >>> from shardfuse.bench import report
      >>> report.print_comparison([], 0.1)  # doctest: +ELLIPSIS
      0 regression(s), 0 case(s) within 10%...
    """
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    order = {REGRESSION: 0, IMPROVEMENT: 1, NEW: 2, MISSING: 3}
    changed = sorted((c for c in comparisons if c.status in order), key=lambda c: order[c.status])
    unchanged = len(comparisons) - len(changed)
    table = Table(title=f"compared with the saved run (threshold {threshold:.0%})")
    for column in ("status", "case", "old median", "new median", "time ratio", "vs-baseline ratio"):
        table.add_column(column)
    style = {REGRESSION: "bold red", IMPROVEMENT: "green"}
    for c in changed:
        table.add_row(
            f"[{style.get(c.status, '')}]{c.status}[/]" if c.status in style else c.status,
            escape(c.key),
            format_seconds(c.old.median_s if c.old else None),
            format_seconds(c.new.median_s if c.new else None),
            "-" if c.time_ratio is None else f"{c.time_ratio:.2f}",
            "-" if c.relative_ratio is None else f"{c.relative_ratio:.2f}",
        )
    if changed:
        console.print(table)
    count = sum(c.status == REGRESSION for c in comparisons)
    console.print(
        f"{count} regression(s), {unchanged} case(s) within {threshold:.0%}. Ratios > 1 are "
        "slower; the vs-baseline ratio (relative to the baseline of each run) decides when known."
    )


def matplotlib_available() -> bool:
    """Whether `import matplotlib` would work."""
    return importlib.util.find_spec("matplotlib") is not None


def plot(records, path) -> int:
    """Draws TFLOP/s against sequence length, one panel per op/mode/model/variant/dtype,
    one line per implementation, and saves it to `path`.

    Args:
      records: `shardfuse.bench.results.Record`s; those without `seq_len` or time are left out.
      path: the image file (its suffix picks the format: .png, .svg, .pdf).

    Returns:
      The number of panels drawn.

    Raises:
      ModuleNotFoundError: matplotlib is not installed (the message says how to install it).

    Example:
      >>> from shardfuse.bench import report
      >>> report.plot([], "/tmp/empty.png")  # doctest: +SKIP
    """
    if not matplotlib_available():
        raise ModuleNotFoundError(PLOT_HINT, name="matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = defaultdict(lambda: defaultdict(list))
    for rec in records:
        if rec.seq_len is None or rec.tflops_per_s is None:
            continue
        title = " ".join(p for p in (rec.op, rec.mode, rec.model, rec.variant, rec.dtype) if p)
        panels[title][rec.implementation].append((rec.seq_len, rec.tflops_per_s))
    count = max(len(panels), 1)
    columns = min(count, 3)
    rows = -(-count // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    # One colour per implementation across all panels.
    names = sorted({name for lines in panels.values() for name in lines})
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for ax, (title, lines) in zip(axes.flat, sorted(panels.items()), strict=False):
        seq_lens = set()
        for implementation, points in sorted(lines.items()):
            points.sort()
            seq_lens.update(p[0] for p in points)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                marker="o",
                color=colours[implementation],
                label=implementation,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(seq_lens), [str(x) for x in sorted(seq_lens)])
        ax.set_ylim(bottom=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return len(panels)
