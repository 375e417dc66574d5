"""Fit the cost model's efficiency to a measured step: `sf.plan(..., calibration=...)`.

A calibration is one measured training step of a known layout on the
cluster being planned: `{"profile": <sf.profile Profile, its to_json() dict,
or a path to that JSON>, "layout": <Layout or its dict>, "global_batch": B,
"seq_len": s}` (batch and length default to the plan's). The measured compute
(the profile's matmul + attention categories) fixes the matmul efficiency:
`efficiency = predicted compute at efficiency 1 / measured compute`; without
categories (a bare `{"step_time_s": ...}`) the efficiency is the one whose
predicted step time equals the measured one (bisection: the step time falls
as the efficiency rises). The other assumptions are kept; the result is
named "calibrated" and recorded in every plan's JSON.
"""

import dataclasses
import json
from pathlib import Path

from shardfuse.planner.options import Assumptions, Layout


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
      ValueError: a calibration without a layout or a measured time, or a layout
        of another device count.
    """
    from shardfuse.planner.cost import estimate

    a = assumptions or Assumptions()
    if not isinstance(calibration, dict) or "layout" not in calibration:
        raise ValueError(
            "calibration must be a dict with 'profile' (a Profile, its JSON or a path) and "
            f"'layout' (the measured Layout); got {calibration!r:.200}"
        )
    layout = calibration["layout"]
    if isinstance(layout, dict):
        layout = Layout(**layout)
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
        predicted = estimate(model, cluster, layout, assumptions=ideal, **kwargs).time[0].value
        efficiency = min(1.0, predicted / compute_s)
    else:
        target = float(measured["step_time_s"])
        lo, hi = 1e-6, 1.0
        for _ in range(60):
            mid = (lo * hi) ** 0.5
            trial = dataclasses.replace(a, compute_efficiency=mid)
            if estimate(model, cluster, layout, assumptions=trial, **kwargs).step_time_s > target:
                lo = mid
            else:
                hi = mid
        efficiency = hi
    return dataclasses.replace(a, name="calibrated", compute_efficiency=efficiency)


def cpu_cluster(devices: int = 8, *, cores: int | None = None, core_gflops: float = 100.0,
                memory_gb_per_s: float = 20.0):  # fmt: skip
    """The simulated CPU devices of one host as a `Cluster` the cost model can describe honestly.

    `devices` XLA:CPU devices share `cores` cores (default `os.cpu_count()`): the
    per-device rate is `core_gflops x cores / devices` (a nominal AVX2 FMA peak of
    about 100 GFLOP/s per core; `calibrate` fits the fraction reached), the
    per-device memory bandwidth `memory_gb_per_s / devices`, and a collective is a
    memory copy between threads at that bandwidth (overlap 0: it competes with the
    compute for the same cores). One node: every axis is "intra-node".

    Example:
      >>> from shardfuse.planner.calibrate import cpu_cluster
      >>> c = cpu_cluster(8, cores=2)
      >>> c.num_devices, c.device.peak_tflops("float32")
      (8, 0.025)
    """
    import os

    from shardfuse.hardware import Cluster, Device, Link

    cores = cores or os.cpu_count() or 1
    tflops = core_gflops * cores / devices / 1e3
    copy = Link("memcpy", memory_gb_per_s / devices, memory_gb_per_s / devices, latency_us=50.0)
    device = Device(
        "cpu-sim", f"CPU ({devices} devices on {cores} cores)",
        {"float32": tflops, "bfloat16": tflops, "float16": tflops}, 1e3,
        memory_gb_per_s / devices, copy, "cpu",
    )  # fmt: skip
    return Cluster(device, 1, devices, copy, copy)
