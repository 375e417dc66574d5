"""Benchmark harness of shardfuse: shapes, peaks, FLOP formulas, measurement, results, CLI.

The suites themselves live in the repository's `bench/` folder (pytest-benchmark,
one module per op family); this package holds what they share and what
`shardfuse bench` needs to run them, report, compare and plot. See bench/README.md.

Example:
  >>> from shardfuse.bench import flops, peaks
  >>> flops.attention_flops(1, 1024, 1024, 32, 128, causal=True) / 1e9
  8.5983232
  >>> peaks.device_peak("TPU v5 lite").peak_tflops("bfloat16")
  197.0
"""

from shardfuse.bench import flops, harness, peaks, results, shapes
from shardfuse.bench.harness import BenchCase, measure
from shardfuse.bench.shapes import MODELS, SCALES, ModelShape, Scale, pick_scale

__all__ = [
    "MODELS",
    "SCALES",
    "BenchCase",
    "ModelShape",
    "Scale",
    "flops",
    "harness",
    "measure",
    "peaks",
    "pick_scale",
    "results",
    "shapes",
]
