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
