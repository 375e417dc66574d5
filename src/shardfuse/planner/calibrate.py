"""Fit the cost model's efficiency to a measured step: `sf.plan(..., calibration=...)`.

A calibration is one measured training step of a known mesh and options on
the cluster being planned: `{"profile": <sf.profile Profile, its to_json()
dict, or a path to that JSON>, "parallelism": <Parallelism, or the flat dict
`Parallelism.of` takes>, "global_batch": B, "seq_len": s}` ("layout", the key
of earlier releases, is still read, with a DeprecationWarning; batch and
length default to the plan's). The measured compute (the profile's matmul +
attention categories) fixes the matmul efficiency:
`efficiency = predicted compute at efficiency 1 / measured compute`; without
categories (a bare `{"step_time_s": ...}`) the efficiency is the one whose
predicted step time equals the measured one (bisection: the step time falls
as the efficiency rises). The other assumptions are kept; the result is
named "calibrated" and recorded in every plan's JSON.

On the simulated CPU devices (`cpu_cluster`) the memory and the collectives
are described from a measurement too: `measure_cpu` times a memory-bound
update and ring transfers (`lax.ppermute`, what every ring of the package is
made of) between small matmuls on the local devices, and fits the fixed cost
of one transfer and its bytes per second (`fit_link`);
`cpu_cluster(**measure_cpu())` takes them.
"""

import dataclasses
import json
import warnings
from pathlib import Path

from shardfuse.planner.options import Assumptions, Parallelism


def _measured(profile) -> dict:
    if isinstance(profile, str | Path):
        return json.loads(Path(profile).read_text())
    if hasattr(profile, "to_json"):
        return profile.to_json()
    if isinstance(profile, dict):
        return profile
    raise TypeError(f"calibration profile={profile!r} must be a Profile, its JSON dict or a path")


def calibrate(calibration, *, model, cluster, assumptions: Assumptions | None = None,
              global_batch=None, seq_len=None) -> Assumptions:  # fmt: skip
    """`assumptions` with the efficiency fitted to the measured step of `calibration`.

    Raises:
      ValueError: a calibration without a parallelism or a measured time, or a
        parallelism of another device count.
    """
    from shardfuse.planner.cost import estimate

    a = assumptions or Assumptions()
    if isinstance(calibration, dict) and "layout" in calibration:
        warnings.warn(
            "calibration['layout'] is deprecated and will be removed in the next release: use "
            "calibration['parallelism']",
            DeprecationWarning,
            stacklevel=3,
        )
        calibration = {"parallelism": calibration["layout"], **calibration}
    if not isinstance(calibration, dict) or "parallelism" not in calibration:
        raise ValueError(
            "calibration must be a dict with 'profile' (a Profile, its JSON or a path) and "
            f"'parallelism' (the measured Parallelism); got {calibration!r:.200}"
        )
    parallelism = calibration["parallelism"]
    if isinstance(parallelism, dict):
        parallelism = Parallelism.of(**parallelism)
    measured = _measured(calibration.get("profile", calibration))
    batch = calibration.get("global_batch", global_batch)
    length = calibration.get("seq_len", seq_len)
    if batch is None or length is None:
        raise ValueError("calibration needs 'global_batch' and 'seq_len' (or the plan's)")
    kwargs = dict(global_batch=batch, seq_len=length)
    ideal = dataclasses.replace(a, compute_efficiency=1.0)
    categories = measured.get("categories") or {}
    compute_s = sum(categories.get(k, 0.0) for k in ("matmul", "attention"))
    if compute_s > 0:
        predicted = estimate(model, cluster, parallelism, assumptions=ideal, **kwargs).time[0].value
        efficiency = min(1.0, predicted / compute_s)
    else:
        target = float(measured["step_time_s"])
        lo, hi = 1e-6, 1.0
        for _ in range(60):
            mid = (lo * hi) ** 0.5
            trial = dataclasses.replace(a, compute_efficiency=mid)
            if (
                estimate(model, cluster, parallelism, assumptions=trial, **kwargs).step_time_s
                > target
            ):
                lo = mid
            else:
                hi = mid
        efficiency = hi
    return dataclasses.replace(a, name="calibrated", compute_efficiency=efficiency)


def cpu_cluster(devices: int = 8, *, cores: int | None = None, core_gflops: float = 100.0,
                memory_gb_per_s: float = 20.0, link: dict | None = None):  # fmt: skip
    """The simulated CPU devices of one host as a `Cluster` the cost model can describe honestly.

    `devices` XLA:CPU devices share `cores` cores (default `os.cpu_count()`): the
    per-device rate is `core_gflops x cores / devices` (a nominal AVX2 FMA peak of
    about 100 GFLOP/s per core; `calibrate` fits the fraction reached) and the
    per-device memory bandwidth `memory_gb_per_s / devices`. A collective is a
    copy between the devices' threads (overlap 0: it competes with the compute
    for the same cores): with `link` (`measure_cpu`'s fit, `{"gb_per_s",
    "latency_us"}` per device) at the measured rate and fixed cost per transfer,
    otherwise a memory copy at the memory bandwidth and 50 us per transfer.
    One node: every axis is "intra-node".

    Example:
      >>> from shardfuse.planner.calibrate import cpu_cluster
      >>> c = cpu_cluster(8, cores=2)
      >>> c.num_devices, c.device.peak_tflops("float32")
      (8, 0.025)
      >>> cpu_cluster(8, cores=2, link={"gb_per_s": 1.5, "latency_us": 80.0}).intra_link.latency_us
      80.0
    """
    import os

    from shardfuse.hardware import Cluster, Device, Link

    cores = cores or os.cpu_count() or 1
    tflops = core_gflops * cores / devices / 1e3
    if link is None:
        copy = Link("memcpy", memory_gb_per_s / devices, memory_gb_per_s / devices, latency_us=50.0)
    else:
        if not isinstance(link, dict) or set(link) < {"gb_per_s", "latency_us"}:
            raise ValueError(f"link={link!r} must be a dict with 'gb_per_s' and 'latency_us'")
        rate, latency = float(link["gb_per_s"]), float(link["latency_us"])
        copy = Link("measured thread copy", rate, rate, latency_us=latency)
    device = Device(
        "cpu-sim", f"CPU ({devices} devices on {cores} cores)",
        {"float32": tflops, "bfloat16": tflops, "float16": tflops}, 1e3,
        memory_gb_per_s / devices, copy, "cpu",
    )  # fmt: skip
    return Cluster(device, 1, devices, copy, copy)


PROBE_BYTES = (16 * 1024, 1024 * 1024)  # per device: latency-bound, bandwidth-bound
MEMORY_PROBE_BYTES = 8 * 1024 * 1024  # per array and device: past the caches


def fit_link(sizes, seconds) -> dict:
    """`{"gb_per_s", "latency_us"}` of the line `seconds = latency + bytes / rate` (probes).

    A least-squares line through `(bytes, seconds)` of one ring transfer per
    device (at least two distinct sizes); the fixed cost is floored at 0 and
    the rate must come out positive.

    Raises:
      ValueError: fewer than two distinct sizes, lengths that differ, or times
        that do not grow with the size (no bandwidth to fit).

    Example:
      >>> from shardfuse.planner.calibrate import fit_link
      >>> fit_link([1e3, 1e6], [100e-6 + 1e3 / 2e9, 100e-6 + 1e6 / 2e9])
      {'gb_per_s': 2.0, 'latency_us': 100.0}
    """
    sizes, seconds = [float(b) for b in sizes], [float(t) for t in seconds]
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ValueError(
            f"sizes={sizes!r} and seconds={seconds!r} need equal lengths and two distinct sizes"
        )
    n = len(sizes)
    mean_b, mean_t = sum(sizes) / n, sum(seconds) / n
    cov = sum((b - mean_b) * (t - mean_t) for b, t in zip(sizes, seconds, strict=True))
    slope = cov / sum((b - mean_b) ** 2 for b in sizes)
    if not slope > 0:
        raise ValueError(f"seconds={seconds!r} do not grow with sizes={sizes!r}: no rate to fit")
    latency = max(0.0, mean_t - slope * mean_b)
    return {"gb_per_s": round(1e-9 / slope, 6), "latency_us": round(latency * 1e6, 6)}


def _timed(run, args, repeats, cores):
    """Process CPU seconds of `run(*args)` over `cores`, min of `repeats` (after one call)."""
    import time

    import jax

    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        jax.block_until_ready(run(*args))
        best = min(best, time.process_time() - start)
    return best / cores


def _transfer_s(mesh, per_device_bytes, transfers, repeats, cores, *, send):
    """Seconds per loop iteration per device: a [256, 256] matmul, then (if `send`) a ring shift."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    ring = [(i, (i + 1) % n) for i in range(n)]

    def body(_, carry):
        x, w = carry
        w = jnp.tanh(w @ w * 0.01)  # compute between transfers: the threads drift apart
        if send:
            x = jax.lax.ppermute(x, "probe", ring)
        return x * 0.5 + w[0, 0], w  # each iteration depends on the last: nothing is hoisted

    def loop(x, w):
        return jax.lax.fori_loop(0, transfers, body, (x, w))[0]

    rows = max(1, per_device_bytes // 4 // 256)
    spec = NamedSharding(mesh, P("probe"))
    x = jax.device_put(jnp.ones((n * rows, 256), jnp.float32), spec)
    w = jax.device_put(jnp.full((n * 256, 256), 0.01, jnp.float32), spec)
    run = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=P("probe"), out_specs=P("probe")))
    return _timed(run, (x, w), repeats, cores) / transfers, rows * 256 * 4


def _memory_s(mesh, per_array_bytes, repeats, cores):
    """Seconds of one AdamW-like update (read 4 arrays, write 3) per device, and its bytes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    size = max(1, per_array_bytes // 4)

    def update(p, g, m, v):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    spec = NamedSharding(mesh, P("probe"))
    arrays = [jax.device_put(jnp.ones((n * size,), jnp.float32), spec) for _ in range(4)]
    run = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=P("probe"), out_specs=P("probe")))
    return _timed(run, arrays, repeats, cores), 7 * size * 4


def measure_cpu(devices: int | None = None, *, cores: int | None = None, sizes=PROBE_BYTES,
                transfers: int = 12, repeats: int = 3) -> dict:  # fmt: skip
    """The local XLA:CPU devices' memory and collectives, measured: `cpu_cluster`'s keywords.

    Returns `{"memory_gb_per_s": ..., "link": {"gb_per_s", "latency_us",
    "probes"}}`, so that `cpu_cluster(devices, cores=cores, **measure_cpu(...))`
    describes this host. Times are the process's CPU seconds over `cores`
    (the unit of the planner's CPU step time: the host's other load does not
    count), min of `repeats`.

    - memory: an AdamW-like update (4 arrays read, 3 written, 8 MiB each per
      device, past the caches) on every device at once: the rate of the
      memory-bound terms (elementwise, optimizer), all devices together.
    - link: every ring of the package (collective matmuls, ring attention,
      pipeline sends) is a chain of `lax.ppermute` transfers, and XLA:CPU's
      all-gather, reduce-scatter and all-reduce are the same copies between
      the devices' threads after one rendezvous. The probe runs `transfers`
      loop iterations of a small matmul then a ring shift of each of `sizes`
      bytes per device over all devices, minus the same loop without the
      shift. The matmul matters: in a training step the threads reach each
      collective at different times and sleep and wake in its rendezvous,
      and the copied data has left the caches; back-to-back transfers (no
      compute) cost 4-5x less fixed time and half the per-byte time on the
      2-core CI host. `fit_link` puts a line through the per-transfer
      times: the fixed cost of one transfer and the copy rate per device.

    Raises:
      ValueError: `devices` not in [2, local devices], not CPU devices, or transfer
        times that do not grow with the size in three tries, each with twice the
        transfers and two more repeats (`fit_link`).

    Example (4 MiB against 64 KiB transfers: the copy's share stands well above the
    run-to-run noise even on a loaded host; 16 KiB against 1 MiB once measured no
    growth at all three tries while another process loaded both cores)::

      >>> from shardfuse.planner.calibrate import cpu_cluster, measure_cpu
      >>> measured = measure_cpu(2, cores=1, sizes=(1 << 16, 1 << 22), repeats=5)
      >>> cpu_cluster(2, cores=1, **measured).num_devices
      2
    """
    import os

    import jax
    import numpy as np

    local = jax.devices()
    devices = len(local) if devices is None else devices
    if isinstance(devices, bool) or not isinstance(devices, int) or not 2 <= devices <= len(local):
        raise ValueError(f"devices={devices!r} must be an int in [2, {len(local)}]")
    if local[0].platform != "cpu":
        raise ValueError(f"measure_cpu probes CPU devices; these are {local[0].platform}")
    cores = cores or os.cpu_count() or 1
    mesh = jax.sharding.Mesh(np.array(local[:devices]), ("probe",))
    for attempt in range(3):  # a loaded host can hide the slope of a short probe: lengthen it
        probes = []
        for size in sizes:
            sent, nbytes = _transfer_s(mesh, size, transfers, repeats, cores, send=True)
            alone, _ = _transfer_s(mesh, size, transfers, repeats, cores, send=False)
            probes.append((nbytes, max(0.0, sent - alone)))
        try:
            link = fit_link([b for b, _ in probes], [t for _, t in probes])
            break
        except ValueError:
            if attempt == 2:
                raise
            transfers, repeats = 2 * transfers, repeats + 2
    seconds, nbytes = _memory_s(mesh, MEMORY_PROBE_BYTES, repeats, cores)
    return {
        "memory_gb_per_s": round(nbytes * devices / seconds / 1e9, 6),
        "link": dict(link, probes=probes),
    }
