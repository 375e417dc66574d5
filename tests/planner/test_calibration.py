"""`sf.plan(..., calibration=...)`: the efficiency fitted to one measured step predicts others.

On the 8 simulated CPU devices (`calibrate.cpu_cluster`: 8 devices sharing the
host's cores, per-device rate = cores / devices of the host's, collectives
are memory copies that do not overlap), the training example
(`shardfuse.demos.train_lm`, a 4-layer Llama-style LM of width 256) is timed on
one mesh (min of several steps), the efficiency calibrated on it, and the
measured step time of three other meshes predicted within 25%. Compiling
four meshes takes minutes on the shared 2-core machine: under `-m slow`; the
default suite checks the fit itself on synthetic measurements.
"""

import json
import time

import jax
import pytest

from shardfuse.demos.llama import LlamaConfig
from shardfuse.demos.train_lm import TrainConfig, Trainer, layout_of
from shardfuse.planner import Assumptions, Layout, estimate, plan
from shardfuse.planner.calibrate import calibrate, cpu_cluster

MODEL = LlamaConfig(vocab=512, features=256, heads=8, kv_heads=4, hidden=1024, layers=4)
BATCH, SEQ = 16, 128
CALIBRATE_ON = {"data": 8}
UNSEEN = ({"data": 2, "model": 4}, {"fsdp": 8}, {"data": 2, "sequence": 2, "model": 2})
TOLERANCE = 0.25
ASSUMPTIONS = Assumptions.float32(embedding_sharded=False, donate=False)  # as train_lm runs


def _config(mesh):
    return TrainConfig(model=MODEL, mesh=mesh, global_batch=BATCH, seq_len=SEQ, steps=100,
                       zero=3 if mesh.get("fsdp", 1) > 1 else 0)  # fmt: skip


def _measure(mesh, steps=4):
    """Min over `steps` timed steps (after one warm-up that compiles) of the training step."""
    trainer = Trainer(_config(mesh), log=lambda line: None)
    step, args = trainer.step_call()
    times = []
    with jax.set_mesh(trainer.mesh):
        for i in range(steps + 1):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            if i:
                times.append(time.perf_counter() - start)
    return min(times)


def _predict(mesh, assumptions, cluster):
    layout = layout_of(_config(mesh), 8)
    return estimate(MODEL.spec(), cluster, layout, global_batch=BATCH, seq_len=SEQ,
                    assumptions=assumptions).step_time_s  # fmt: skip


def test_calibration_recovers_the_efficiency():
    cluster = cpu_cluster(8, cores=2)
    layout = Layout(data=2, model=4)
    truth = ASSUMPTIONS.__class__(**{**ASSUMPTIONS.__dict__, "compute_efficiency": 0.123})
    e = estimate(MODEL.spec(), cluster, layout, global_batch=BATCH, seq_len=SEQ, assumptions=truth)
    measured = {"profile": {"step_time_s": e.step_time_s}, "layout": layout,
                "global_batch": BATCH, "seq_len": SEQ}  # fmt: skip
    fitted = calibrate(measured, model=MODEL.spec(), cluster=cluster, assumptions=ASSUMPTIONS)
    assert fitted.name == "calibrated"
    assert fitted.compute_efficiency == pytest.approx(0.123, rel=1e-6)
    # from a profile's categories: the compute term alone
    compute = e.time[0].value
    by_category = dict(measured, profile={"step_time_s": 1.0, "categories": {
        "matmul": compute * 0.75, "attention": compute * 0.25, "other": 0.5}})  # fmt: skip
    fitted = calibrate(by_category, model=MODEL.spec(), cluster=cluster, assumptions=ASSUMPTIONS)
    assert fitted.compute_efficiency == pytest.approx(0.123, rel=1e-6)
    # sf.plan takes it, and the plans record it
    plans = plan(MODEL.spec(), cluster, global_batch=BATCH, seq_len=SEQ, assumptions=ASSUMPTIONS,
                 calibration=measured, top_k=2)  # fmt: skip
    assert plans[0].to_dict()["assumptions"]["compute_efficiency"] == pytest.approx(0.123)
    with pytest.raises(ValueError, match="calibration must be a dict with 'profile'"):
        calibrate({"step_time_s": 1.0}, model=MODEL.spec(), cluster=cluster)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_calibrated_cpu_prediction_holds_on_three_unseen_meshes():
    cluster = cpu_cluster(8, cores=2)
    base = _measure(CALIBRATE_ON)
    measured = {"profile": {"step_time_s": base}, "layout": layout_of(_config(CALIBRATE_ON), 8),
                "global_batch": BATCH, "seq_len": SEQ}  # fmt: skip
    fitted = calibrate(measured, model=MODEL.spec(), cluster=cluster, assumptions=ASSUMPTIONS)
    rows = []
    for mesh in UNSEEN:
        actual, predicted = _measure(mesh), _predict(mesh, fitted, cluster)
        rows.append((mesh, actual, predicted, predicted / actual - 1))
    table = "\n".join(f"{json.dumps(m):45} measured {a:.3f} s predicted {p:.3f} s ({e:+.1%})"
                      for m, a, p, e in rows)  # fmt: skip
    print(f"calibrated on {CALIBRATE_ON}: {base:.3f} s, efficiency "
          f"{fitted.compute_efficiency:.3g}\n{table}")  # fmt: skip
    assert all(abs(e) <= TOLERANCE for *_, e in rows), table
