"""Measuring one benchmark case under pytest-benchmark, the same way for every op.

`measure` compiles the function ahead of time (`jit(...).lower(...).compile()`,
outside the timing), reads the compiled memory (`memory_analysis`), refuses
cases that would not fit the device, runs one warm-up call and checks that
the outputs are finite, then times the compiled executable with
`benchmark.pedantic` (one call per round, `jax.block_until_ready` inside the
timed function, `Scale.warmup_rounds` untimed first, rounds sized so a case
takes about `Scale.target_seconds`).
It records on `benchmark.extra_info` everything a reader needs: op,
implementation, backend, device kind, device count, versions, shape, dtype,
analytic FLOPs and bytes, TFLOP/s, GB/s, % of the device's peak, compiled
memory, and the seconds spent compiling (`compile_s`) and calling it
(`timed_s`: warm-up and timed rounds). The ratio to the group's baseline is
added once the run ends (see `shardfuse.bench.results.attach_baseline_ratios`),
since the baseline may run after the case.

Under `--benchmark-disable` (and under xdist, where pytest-benchmark turns
itself off) `pedantic` calls the function once: the case still compiles,
runs and checks its outputs, and the timing fields stay None.
"""

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from shardfuse.bench.results import NOT_AVAILABLE
from shardfuse.hardware import detect

# A case is refused (skipped) when its compiled memory exceeds this share of the device's.
MEMORY_HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """What one benchmark case measures.

    Attributes:
      op: the op family ("flash_attention", "all_gather_matmul", ...).
      implementation: who computes it ("shardfuse.xla", "reference", "jax.nn.xla").
      mode: "fwd" or "fwd+bwd".
      shape: named sizes with the axis glossary letters, e.g. `{"B": 1, "T": 512, ...}`.
      dtype: input dtype name.
      flops: analytic FLOPs of one call (`shardfuse.bench.flops`).
      bytes: compulsory HBM bytes of one call.
      baseline: the implementation of the same group that ratios are taken to.
      model: the `shardfuse.models.MODELS` entry the shape comes from ("" for synthetic shapes).
      variant: mask or options ("causal", "causal window=512 softcap=50").
      seq_len: x axis of the throughput plot (None: not plotted).
    """

    op: str
    implementation: str
    mode: str
    shape: dict
    dtype: str
    flops: float
    bytes: float
    baseline: str | None = None
    model: str = ""
    variant: str = ""
    seq_len: int | None = None

    @property
    def shape_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())

    @property
    def group(self) -> str:
        """Cases with the same group differ only by implementation."""
        parts = (self.op, self.mode, self.model, self.variant, self.shape_text, self.dtype)
        return " | ".join(p for p in parts if p)


def device_info() -> dict:
    """Backend, device kind and count, versions: the same for every case of a run."""
    import jaxlib

    device = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "num_devices": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
    }


def compiled_memory(compiled) -> dict | None:
    """`memory_analysis()` of a compiled executable as a dict of byte counts, or None."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends (and older PJRT plugins) do not implement it
        return None
    if stats is None:
        return None
    fields = {
        "temp_bytes": "temp_size_in_bytes",
        "argument_bytes": "argument_size_in_bytes",
        "output_bytes": "output_size_in_bytes",
        "alias_bytes": "alias_size_in_bytes",
        "generated_code_bytes": "generated_code_size_in_bytes",
    }
    return {key: int(getattr(stats, attr, 0) or 0) for key, attr in fields.items()}


def _device_memory_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    return (stats or {}).get("bytes_limit")


def _all_finite(tree) -> bool:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)


def rounds_for(seconds_per_call: float, target_seconds: float, min_rounds: int, max_rounds: int):
    """Timed rounds: about `target_seconds / seconds_per_call`, clamped to the bounds.

    Example:
      >>> from shardfuse.bench.harness import rounds_for
      >>> rounds_for(0.01, 1.0, 3, 20), rounds_for(2.0, 1.0, 3, 20)
      (20, 3)
    """
    if seconds_per_call <= 0:
        return max_rounds
    return int(min(max_rounds, max(min_rounds, math.ceil(target_seconds / seconds_per_call))))


def percent_of_peak(achieved: float | None, peak: float | None) -> float | str:
    """`100 * achieved / peak`, or "n/a" when either is unknown.

    Example:
      >>> from shardfuse.bench.harness import percent_of_peak
      >>> percent_of_peak(494.7, 989.4)
      50.0
      >>> percent_of_peak(1.0, None)
      'n/a'
    """
    if achieved is None or not peak:
        return NOT_AVAILABLE
    return 100.0 * achieved / peak


def throughput_info(case: BenchCase, median_s: float | None, device_kind: str) -> dict:
    """TFLOP/s, GB/s and % of the device's peak from a median time (None: not timed).

    Example:
      >>> from shardfuse.bench.harness import BenchCase, throughput_info
      >>> case = BenchCase("matmul", "xla", "fwd", {"M": 1}, "bfloat16", flops=989.4e12,
      ...                  bytes=3.35e12)
      >>> info = throughput_info(case, 2.0, "NVIDIA H100 80GB HBM3")
      >>> info["pct_peak_flops"], info["pct_peak_bandwidth"]
      (50.0, 50.0)
    """
    peak = detect(device_kind)
    peak_tflops = peak.peak_tflops(case.dtype) if peak else None
    peak_gbps = peak.hbm_gb_per_s if peak else None
    tflops = gbps = None
    if median_s:
        tflops = case.flops / median_s / 1e12
        gbps = case.bytes / median_s / 1e9
    return {
        "median_s": median_s,
        "tflops_per_s": tflops,
        "gb_per_s": gbps,
        "peak_device": peak.name if peak else NOT_AVAILABLE,
        "peak_tflops": peak_tflops if peak_tflops else NOT_AVAILABLE,
        "peak_gb_per_s": peak_gbps if peak_gbps else NOT_AVAILABLE,
        "pct_peak_flops": percent_of_peak(tflops, peak_tflops),
        "pct_peak_bandwidth": percent_of_peak(gbps, peak_gbps),
    }


# What the attention suites (prefill and decode) compare: the oracle, shardfuse's
# backends, and jax.nn.dot_product_attention's own implementations.
ATTENTION_IMPLEMENTATIONS = (
    "reference",
    "shardfuse.xla",
    "shardfuse.pallas_tpu",
    "shardfuse.triton",
    "jax.nn.xla",
    "jax.nn.cudnn",
)

# Implementations that only some backends time. The library's own backends that cannot
# run (shardfuse.triton without an NVIDIA GPU) say why themselves: NotImplementedError.
GPU_BACKENDS = ("gpu", "cuda")
INTERPRETED = ("shardfuse.pallas_tpu", "jax.pallas")


def not_timed_reason(implementation: str, backend: str, interpret: bool = False) -> str | None:
    """Why a suite does not time `implementation` on `backend`, or None when it does.

    Pallas TPU kernels run off TPU only in TPU interpret mode, a simulator whose
    time says nothing about a kernel: on CPU they are timed only with `interpret`
    (`shardfuse bench --interpret`), never on GPU. cuDNN needs an NVIDIA GPU.
    JAX's Pallas attention has a GPU kernel, so it runs on GPU too.

    Example:
      >>> from shardfuse.bench.harness import not_timed_reason
      >>> not_timed_reason("shardfuse.xla", "cpu") is None
      True
      >>> not_timed_reason("jax.nn.cudnn", "cpu")
      "jax.nn.cudnn needs an NVIDIA GPU; the JAX backend is 'cpu'"
    """
    gpu = backend in GPU_BACKENDS
    if implementation == "jax.nn.cudnn" and not gpu:
        return f"{implementation} needs an NVIDIA GPU; the JAX backend is {backend!r}"
    if implementation == "shardfuse.pallas_tpu" and gpu:
        return f"{implementation} runs on TPU (on {backend!r} only in TPU interpret mode)"
    if implementation in INTERPRETED and backend not in ("tpu", *GPU_BACKENDS) and not interpret:
        return (
            f"{implementation} runs on {backend!r} only in TPU interpret mode, a simulator: "
            "timed with --interpret"
        )
    return None


def with_backward(fn):
    """`g(*inputs, cotangent) -> (out, input cotangents)`: `fn`'s forward and its VJP, timed as one.

    The fwd+bwd mode of every suite: the cotangent is a random argument, not
    `sum()`, so that the backward does the work a training step does.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.bench.harness import with_backward
      >>> out, (dx,) = with_backward(jnp.sin)(jnp.zeros(2), jnp.ones(2))
      >>> dx.tolist()
      [1.0, 1.0]
    """

    def forward_backward(*inputs_and_cotangent):
        *inputs, cotangent = inputs_and_cotangent
        out, vjp = jax.vjp(fn, *inputs)
        return out, vjp(cotangent)

    return forward_backward


def measure(benchmark, fn, args, case: BenchCase, scale, *, skip=None, skip_on=None, inspect=None):
    """Compiles `fn(*args)`, times it with `benchmark.pedantic`, fills `benchmark.extra_info`.

    Args:
      benchmark: the pytest-benchmark fixture.
      fn: the function to time (jitted here; pass a plain function or a jitted one).
      args: its positional array arguments.
      case: what is measured; `benchmark.group` becomes `case.group`.
      scale: the run's `shardfuse.bench.scales.Scale` (rounds and time budget).
      skip: `pytest.skip` (passed in so that this module does not import pytest).
      skip_on: exception types raised while tracing or compiling that mean "this
        implementation cannot run the case": the case is skipped with the error.
        Default `(NotImplementedError,)`; suites pass `(Exception,)` for
        third-party baselines (cuDNN, JAX's Pallas kernels) whose limits are
        not ours to report as failures.
      inspect: `outputs -> dict`, called on the first call's outputs; its items join
        `extra_info` (what a suite reads off the results, without a second compilation).

    Returns:
      The `extra_info` dict.

    Raises:
      NotImplementedError: from `fn`, when the implementation cannot run the case
        (with `skip` given, the case is skipped with that reason instead).
      AssertionError: the outputs are not all finite.

    Example:
      >>> # inside a pytest-benchmark test:
      >>> # measure(benchmark, f, (q, k, v), case, scale, skip=pytest.skip)
    """
    benchmark.group = case.group
    info = dict(device_info())
    info.update(
        op=case.op,
        implementation=case.implementation,
        mode=case.mode,
        model=case.model,
        variant=case.variant,
        shape=dict(case.shape),
        dtype=case.dtype,
        seq_len=case.seq_len,
        flops=case.flops,
        bytes=case.bytes,
        baseline=case.baseline,
        scale=scale.name,
    )
    benchmark.extra_info.update(info)
    unsupported = tuple(skip_on) if skip_on else (NotImplementedError,)
    try:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        info["compile_s"] = time.perf_counter() - start
    except unsupported as e:
        if skip is None:
            raise
        skip(f"{case.implementation} cannot run this case: {type(e).__name__}: {e}")
    info["memory"] = compiled_memory(compiled)
    limit = _device_memory_limit()
    if info["memory"] and limit:
        needed = sum(info["memory"][k] for k in ("temp_bytes", "argument_bytes", "output_bytes"))
        if needed > MEMORY_HEADROOM * limit and skip is not None:
            skip(
                f"{case.implementation} needs {needed / 2**30:.1f} GiB, "
                f"the device has {limit / 2**30:.1f} GiB"
            )

    def call():
        return jax.block_until_ready(compiled(*args))

    start = time.perf_counter()
    out = call()
    first_call_s = time.perf_counter() - start
    if not _all_finite(out):
        raise AssertionError(f"{case.implementation} on {case.group} returned non-finite values")
    if inspect is not None:
        info.update(inspect(out))
    del out
    rounds = rounds_for(first_call_s, scale.target_seconds, scale.min_rounds, scale.max_rounds)
    start = time.perf_counter()
    benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=scale.warmup_rounds)
    info["timed_s"] = first_call_s + time.perf_counter() - start  # the warm-up calls included
    stats = getattr(benchmark, "stats", None)
    median_s = stats.stats.median if stats is not None else None
    info["rounds"] = rounds if stats is not None else 0
    info.update(throughput_info(case, median_s, info["device_kind"]))
    benchmark.extra_info.update(info)
    return info
