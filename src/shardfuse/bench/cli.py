"""`shardfuse bench`: runs the pytest-benchmark suites, reports, compares, plots.

The suites are installed with the package (`shardfuse.bench.suites`), so the
command works from a wheel, in any working directory.

The suites run in this process through `pytest.main`, serially, with a
progress bar; pytest-benchmark writes the run's JSON (to `--json PATH`, else
to a new file in `./.benchmarks/`, kept either way); then the run is printed
as one table, with the implementations that could not run listed under it and
why, compared with a saved run (regressions flagged) and plotted.
`--load PATH` reports a saved run without running anything.

Running the suites needs pytest and pytest-benchmark (the `test` extra); the
base install only reports saved runs (`--load`).
"""

import argparse
import dataclasses
import datetime
import importlib
import sys
from pathlib import Path

DEFAULT_THRESHOLD = 0.1
# pytest-benchmark's own folder for saved runs; `shardfuse bench` keeps its JSON there too.
DEFAULT_JSON_DIR = ".benchmarks"
# What running the suites imports beyond the base install, and where to get it.
RUN_REQUIREMENTS = ("pytest", "pytest_benchmark")
INSTALL_HINT = 'pip install -e ".[test]" (in a checkout; or pip install pytest pytest-benchmark)'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `shardfuse bench` options to its sub-parser."""
    parser.add_argument(
        "--suite",
        action="append",
        metavar="NAME",
        help="run the suite bench_NAME.py only (repeatable; default: every suite)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="the small scale (CPU: a few minutes in all)"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help=f"write the run's JSON here (default: a new file in ./{DEFAULT_JSON_DIR}/)",
    )
    parser.add_argument("--compare", metavar="PATH", help="compare with a saved run's JSON")
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="relative slow-down that counts as a regression (default 0.1 = 10%%)",
    )
    parser.add_argument(
        "--fail-on-regression",
        action="store_true",
        help="exit with status 3 when --compare finds a regression",
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="draw TFLOP/s vs sequence length (needs matplotlib)"
    )
    parser.add_argument(
        "--scale",
        choices=("cpu", "cpu-quick", "device", "device-quick"),
        help="force a scale (default: by backend and --quick)",
    )
    parser.add_argument("-k", dest="filter", metavar="EXPR", help="pytest -k expression")
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="on CPU, also time Pallas kernels in interpret mode (slow; times the simulator)",
    )
    parser.add_argument(
        "--load", metavar="PATH", help="do not run: report (and compare, plot) a saved run"
    )
    parser.add_argument(
        "--bench-dir",
        metavar="DIR",
        help="a folder of suites to run instead of the installed ones (shardfuse.bench.suites)",
    )


# The suites installed with the package: a folder of bench_*.py, conftest.py and pytest.ini.
SUITES_DIR = Path(__file__).resolve().parent / "suites"


def find_bench_dir(explicit=None) -> Path:
    """The folder of the suites: `explicit`, else the installed `shardfuse.bench.suites`.

    Example:
      >>> from shardfuse.bench.cli import find_bench_dir
      >>> find_bench_dir().name
      'suites'

    Raises:
      FileNotFoundError: the folder has no `conftest.py` and `pytest.ini` beside its suites.
    """
    candidate = Path(explicit) if explicit is not None else SUITES_DIR
    if (candidate / "conftest.py").is_file() and (candidate / "pytest.ini").is_file():
        return candidate.resolve()
    raise FileNotFoundError(
        f"--bench-dir {candidate}: no benchmark suites there (a folder of bench_*.py with "
        f"conftest.py and pytest.ini, as in {SUITES_DIR})"
    )


def missing_run_requirements() -> list[str]:
    """The modules that running the suites needs and that do not import here.

    Example:
      >>> from shardfuse.bench.cli import missing_run_requirements
      >>> missing_run_requirements()  # with the test extra installed
      []
    """
    missing = []
    for name in RUN_REQUIREMENTS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def default_json_path(now: datetime.datetime | None = None) -> Path:
    """Where a run's JSON goes without `--json`: `./.benchmarks/shardfuse-bench_<time>.json`.

    Example:
      >>> import datetime
      >>> from shardfuse.bench.cli import default_json_path
      >>> default_json_path(datetime.datetime(2026, 11, 23, 10, 30, 0)).name
      'shardfuse-bench_20261123-103000.json'
    """
    now = now or datetime.datetime.now()
    return Path.cwd() / DEFAULT_JSON_DIR / f"shardfuse-bench_{now:%Y%m%d-%H%M%S}.json"


def suites(bench_dir: Path) -> dict:
    """`{name: path}` of the suites `bench_NAME.py` in `bench_dir`."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(bench_dir.glob("bench_*.py"))}


def suite_of(nodeid: str) -> str:
    """The suite a test belongs to: `bench_NAME.py::test[...]` -> NAME.

    Example:
      >>> suite_of("src/shardfuse/bench/suites/bench_matmul.py::test_matmul[x]")
      'matmul'
    """
    return Path(nodeid.split("::")[0]).stem.removeprefix("bench_")


class ProgressPlugin:
    """A pytest plugin that drives a rich progress bar and keeps failures and skip reasons.

    With `lines` (output that is not a terminal: a CI log, a redirected run, where the bar
    does not draw) it prints one line per suite as the suite ends: its cases, how many were
    timed, skipped or failed, its seconds, and of them the seconds compiling and timing
    (`SuiteTime`).
    """

    def __init__(self, progress, console=None, lines=False):
        self.progress = progress
        self.console = console
        self.lines = lines
        self.task = None
        self.failures = []
        self.skips = {}
        self.passed = 0
        self.suites: dict[str, SuiteTime] = {}
        self._current = None

    def pytest_collection_finish(self, session):
        self.task = self.progress.add_task("benchmarks", total=len(session.items))

    def pytest_runtest_logstart(self, nodeid, location):
        if self.task is not None:
            self.progress.update(self.task, description=nodeid.split("::")[-1][:70])
        suite = suite_of(nodeid)
        if suite != self._current:
            self._finish_suite()
            self._current = suite
            self.suites.setdefault(suite, SuiteTime(suite))

    def pytest_sessionfinish(self, session):
        self._finish_suite()

    def _finish_suite(self):
        if self._current is not None and self.lines and self.console is not None:
            self.console.print(self.suites[self._current].line(), markup=False, highlight=False)
        self._current = None

    def pytest_runtest_logreport(self, report):
        self.suites.setdefault(suite_of(report.nodeid), SuiteTime(suite_of(report.nodeid))).add(
            report
        )
        if report.failed:
            self.failures.append((report.nodeid, report.when, report.longreprtext))
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "skipped"
            reason = str(reason).removeprefix("Skipped: ")
            self.skips[reason] = self.skips.get(reason, 0) + 1
        elif report.when == "call":
            self.passed += 1
        if report.when == "teardown" and self.task is not None:
            self.progress.advance(self.task)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failures.append((report.nodeid, "collect", report.longreprtext))


@dataclasses.dataclass
class SuiteTime:
    """Where one suite's time went: its cases, and seconds in all, compiling and timing.

    Example:
      >>> SuiteTime("matmul", cases=3, timed=2, skipped=1, seconds=12.0, compile_s=4.0,
      ...           timed_s=6.0).line()
      'suite matmul: 3 cases (2 timed, 1 skipped, 0 failed) in 12.0 s, compiling 4.0, timing 6.0'
    """

    name: str
    cases: int = 0
    timed: int = 0
    skipped: int = 0
    failed: int = 0
    seconds: float = 0.0
    compile_s: float = 0.0
    timed_s: float = 0.0

    def add(self, report) -> None:
        """Counts one pytest report (setup, call or teardown) of a case of this suite."""
        self.seconds += report.duration
        # The item's properties ride on each of its reports: count them once, with the call.
        for key, value in report.user_properties if report.when == "call" else ():
            if key == "bench_seconds":
                self.compile_s += value["compile_s"]
                self.timed_s += value["timed_s"]
        if report.failed:
            self.failed += 1
        elif report.skipped:
            self.skipped += 1
        elif report.when == "call":
            self.timed += 1
        if report.when == "teardown":
            self.cases += 1

    def line(self) -> str:
        return (
            f"suite {self.name}: {self.cases} cases ({self.timed} timed, {self.skipped} "
            f"skipped, {self.failed} failed) in {self.seconds:.1f} s, compiling "
            f"{self.compile_s:.1f}, timing {self.timed_s:.1f}"
        )


def run_suites(args, bench_dir: Path, json_path: Path, console) -> int:
    """Runs the chosen suites with pytest-benchmark; returns pytest's exit status."""
    import pytest
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    available = suites(bench_dir)
    chosen = args.suite or list(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise ValueError(f"--suite {unknown[0]!r} is not one of {sorted(available)}")
    pytest_args = [
        *(str(available[s]) for s in chosen),
        "-c",
        str(bench_dir / "pytest.ini"),
        "--rootdir",
        str(bench_dir),
        "-p",
        "no:terminal",
        "-p",
        "no:cacheprovider",
        "--capture=sys",
        f"--benchmark-json={json_path}",
    ]
    if args.quick:
        pytest_args.append("--bench-quick")
    if args.scale:
        pytest_args.append(f"--bench-scale={args.scale}")
    if args.interpret:
        pytest_args.append("--bench-interpret")
    if args.filter:
        pytest_args += ["-k", args.filter]
    columns = (*Progress.get_default_columns()[:2], BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=console, transient=False) as progress:
        plugin = ProgressPlugin(progress, console, lines=not console.is_terminal)
        status = int(pytest.main(pytest_args, plugins=[plugin]))
    skipped = sum(plugin.skips.values())
    console.print(f"{plugin.passed} case(s) timed, {skipped} skipped (listed under the table)")
    for nodeid, when, text in plugin.failures:
        console.rule(f"[red]FAILED[/] {nodeid} ({when})")
        console.print(text, markup=False, highlight=False)
    return status


def main(args) -> int:
    """Runs `shardfuse bench` with parsed arguments; returns the exit status.

    Example:
      >>> # shardfuse bench --quick --json run.json --plot run.png
    """
    from rich.console import Console

    from shardfuse.bench import report, results

    console = Console(file=sys.stdout)
    if not console.is_terminal:  # logs and pipes: wide enough for the tables
        console.width = max(console.width, 130)
    if args.threshold <= 0:
        raise ValueError(f"--threshold={args.threshold} must be > 0 (0.1 = 10%)")
    if args.plot and not report.matplotlib_available():
        console.print(f"--plot {args.plot}: {report.PLOT_HINT}", markup=False, style="red")
        return 2
    if args.compare and not Path(args.compare).is_file():
        raise FileNotFoundError(f"--compare {args.compare}: no such file")
    status = 0
    if args.load:
        data = results.load(args.load)
    else:
        missing = missing_run_requirements()
        if missing:
            print(  # one line on stderr, no traceback
                f"shardfuse bench: running the suites needs {' and '.join(missing)}, not "
                f"installed here: {INSTALL_HINT}. Without them, --load PATH reports a saved run.",
                file=sys.stderr,
            )
            return 2
        bench_dir = find_bench_dir(args.bench_dir)
        json_path = Path(args.json) if args.json else default_json_path()
        json_path.parent.mkdir(parents=True, exist_ok=True)
        status = run_suites(args, bench_dir, json_path, console)
        if not json_path.is_file():
            console.print("[red]no results were written[/] (no case ran)")
            return status or 1
        data = results.load(json_path)
        results.save(data, json_path)  # with the baseline ratios filled in
        # One unwrapped line: a path broken over two lines cannot be copied.
        console.print(f"results written to {json_path.resolve()}", markup=False, soft_wrap=True)
    run = results.records(data)
    info = data.get("machine_info", {})
    run_info = data.get("shardfuse", {})
    console.print(
        f"machine: {info.get('node', '?')} {info.get('cpu', {}).get('brand_raw', '')}, "
        f"{run_info.get('device_kind', '?')} x{run_info.get('num_devices', '?')}, "
        f"scale {run_info.get('scale', '?')}, load average at start "
        f"{run_info.get('load_average_at_start')} and end {run_info.get('load_average_at_end')}",
        markup=False,
    )
    report.print_table(run, console)
    report.print_skipped(run_info.get("skipped", []), console)
    if args.compare:
        comparisons = results.compare(
            results.records(results.load(args.compare)), run, args.threshold
        )
        report.print_comparison(comparisons, args.threshold, console)
        if args.fail_on_regression and results.regressions(comparisons) and status == 0:
            status = 3
    if args.plot:
        panels = report.plot(run, args.plot)
        console.print(f"plot with {panels} panel(s) written to {args.plot}")
    return status
