"""Benchmark harness of shardfuse: scales, FLOP formulas, measurement, results, CLI.

The suites (pytest-benchmark, one module per op family) are `shardfuse.bench.suites`,
installed with the package; this package holds what they share and what
`shardfuse bench` needs to run them, report, compare and plot, and
`shardfuse.bench.tools` the stand-alone benchmark programs. See docs/benchmarks.md.
Model shapes and device figures are not here: they live in `shardfuse.models`
and `shardfuse.hardware`, which the library reads too.

Example:
  >>> from shardfuse.bench import flops, harness
  >>> flops.attention_flops(1, 1024, 1024, 32, 128, causal=True) / 1e9
  8.5983232
  >>> harness.percent_of_peak(98.94, 989.4)
  10.0
"""

from shardfuse.bench import flops, harness, results, scales
from shardfuse.bench.harness import BenchCase, measure
from shardfuse.bench.scales import SCALES, Scale, pick_scale

__all__ = [
    "SCALES",
    "BenchCase",
    "Scale",
    "flops",
    "harness",
    "measure",
    "pick_scale",
    "results",
    "scales",
]
