"""pytest setup of the benchmark suites: options, the run's scale, baseline ratios in the JSON.

Options (also set by `shardfuse bench`):
  --bench-quick        the small scale (CPU: a few minutes for every suite together)
  --bench-scale NAME   force "cpu", "cpu-quick", "device" or "device-quick"
  --bench-interpret    on CPU, also time Pallas kernels in interpret mode (slow)
"""

import os

import jax
import pytest

# Collective suites need several devices; `shardfuse bench --cpu-devices N` may have set it.
if jax.config.jax_num_cpu_devices < 0:
    jax.config.update("jax_num_cpu_devices", 8)

from shardfuse.bench import harness, results, scales  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("shardfuse bench")
    group.addoption("--bench-quick", action="store_true", help="the small scale")
    group.addoption(
        "--bench-scale", choices=sorted(scales.SCALES), default=None, help="force a scale"
    )
    group.addoption(
        "--bench-interpret",
        action="store_true",
        help="on CPU, also time Pallas kernels in interpret mode (times the simulator)",
    )


# The cases skipped in this run, with their reasons: the JSON keeps them so that the
# report lists what did not run and why (pytest-benchmark only records timed cases).
_SKIPPED: list[dict] = []


def pytest_configure(config):
    _SKIPPED.clear()
    config.bench_scale = scales.pick_scale(
        jax.default_backend(),
        quick=config.getoption("--bench-quick"),
        override=config.getoption("--bench-scale"),
    )
    config.bench_interpret = config.getoption("--bench-interpret")
    config.bench_load_at_start = _load_average()


def _load_average():
    """1, 5 and 15 minute load averages of the host, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def pytest_report_header(config):
    info = harness.device_info()
    return (
        f"shardfuse bench: scale {config.bench_scale.name}, {info['backend']} "
        f"{info['device_kind']} x{info['num_devices']}, jax {info['jax_version']}"
    )


def pytest_runtest_logreport(report):
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        _SKIPPED.append({"case": report.nodeid, "reason": str(reason).removeprefix("Skipped: ")})


def pytest_benchmark_update_json(config, benchmarks, output_json):
    results.attach_baseline_ratios(output_json["benchmarks"])
    output_json["shardfuse"] = {
        "scale": config.bench_scale.name,
        **harness.device_info(),
        "host_cpu_count": os.cpu_count(),
        # Others' work on a shared machine slows every case: read ratios, not absolute times.
        "load_average_at_start": config.bench_load_at_start,
        "load_average_at_end": _load_average(),
        "skipped": list(_SKIPPED),
    }


@pytest.fixture(scope="session")
def bench_scale(pytestconfig):
    """The run's `shardfuse.bench.scales.Scale`."""
    return pytestconfig.bench_scale


@pytest.fixture
def measure(benchmark, bench_scale, request):
    """`measure(fn, args, case, skip_on=None, inspect=None)`: compile, time, describe
    (`harness.measure`).

    The case's compile and timing seconds go on the test report too (`user_properties`),
    where `shardfuse bench` sums them per suite."""

    def run(fn, args, case, *, skip_on=None, inspect=None):
        info = harness.measure(
            benchmark, fn, args, case, bench_scale, skip=pytest.skip, skip_on=skip_on,
            inspect=inspect,
        )  # fmt: skip
        seconds = {key: info.get(key) or 0.0 for key in ("compile_s", "timed_s")}
        request.node.user_properties.append(("bench_seconds", seconds))
        return info

    return run
