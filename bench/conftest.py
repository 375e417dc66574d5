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

from shardfuse.bench import harness, results, shapes  # noqa: E402


def pytest_addoption(parser):
    group = parser.getgroup("shardfuse bench")
    group.addoption("--bench-quick", action="store_true", help="the small scale")
    group.addoption(
        "--bench-scale", choices=sorted(shapes.SCALES), default=None, help="force a scale"
    )
    group.addoption(
        "--bench-interpret",
        action="store_true",
        help="on CPU, also time Pallas kernels in interpret mode (times the simulator)",
    )


def pytest_configure(config):
    config.bench_scale = shapes.pick_scale(
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


def pytest_benchmark_update_json(config, benchmarks, output_json):
    results.attach_baseline_ratios(output_json["benchmarks"])
    output_json["shardfuse"] = {
        "scale": config.bench_scale.name,
        **harness.device_info(),
        "host_cpu_count": os.cpu_count(),
        # Others' work on a shared machine slows every case: read ratios, not absolute times.
        "load_average_at_start": config.bench_load_at_start,
        "load_average_at_end": _load_average(),
    }


@pytest.fixture(scope="session")
def bench_scale(pytestconfig):
    """The run's `shardfuse.bench.shapes.Scale`."""
    return pytestconfig.bench_scale


@pytest.fixture
def measure(benchmark, bench_scale):
    """`measure(fn, args, case, skip_on=None)`: compile, time, describe (`harness.measure`)."""

    def run(fn, args, case, *, skip_on=None):
        return harness.measure(
            benchmark, fn, args, case, bench_scale, skip=pytest.skip, skip_on=skip_on
        )

    return run
