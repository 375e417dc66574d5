"""The cost model: bytes and FLOPs match the theory and the rings' actual ppermutes."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from shardfuse.collectives.collective_matmul import cost_model
from shardfuse.collectives.collective_matmul.cost_model import PRESETS, Hardware, ring_cost
from shardfuse.models import MODELS
from tests.collectives.collective_matmul.common import Case
from tests.jaxprs import sub_jaxprs

M, C, F = 8192, 4096, 14336


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_all_gather_bytes_are_the_gathered_tensor_fraction(n, bidirectional):
    cost = ring_cost(
        "all_gather_matmul", rows=M, contract=C, cols=F, ring_size=n,
        hardware="h100_nvlink", dtype_bytes=2, bidirectional=bidirectional,
    )  # fmt: skip
    assert cost.bytes_sent == pytest.approx((n - 1) / n * M * C * 2)
    assert n * cost.flops_per_step == pytest.approx(2 * M * C * F / n)  # this device's share


@pytest.mark.parametrize("n", [2, 8])
def test_reduce_scatter_bytes_are_float32_partial_sums(n):
    cost = ring_cost(
        "matmul_reduce_scatter", rows=M, contract=F, cols=C, ring_size=n, hardware="tpu_v5p_ici"
    )
    assert cost.bytes_sent == pytest.approx((n - 1) / n * M * C * 4)
    assert n * cost.flops_per_step == pytest.approx(2 * M * F * C / n)
    all_reduce = ring_cost(
        "matmul_all_reduce", rows=M, contract=F, cols=C, ring_size=n, hardware="tpu_v5p_ici"
    )
    # reduce-scatter (float32) then all-gather of the result (dtype_bytes = 2)
    assert all_reduce.bytes_sent == pytest.approx((n - 1) / n * M * C * (4 + 2))


def test_overlap_limits():
    fast_link = Hardware("compute-bound", tflops=1.0, link_gb_per_s=1e6, egress_gb_per_s=1e6)
    slow_link = Hardware("transfer-bound", tflops=1e6, link_gb_per_s=1.0, egress_gb_per_s=1.0)
    n = 8
    bound = ring_cost(
        "all_gather_matmul", rows=M, contract=C, cols=F, ring_size=n, hardware=fast_link
    )
    assert bound.hidden_fraction == pytest.approx(1.0)
    assert bound.overlapped_s == pytest.approx(bound.compute_s)
    starved = ring_cost(
        "all_gather_matmul", rows=M, contract=C, cols=F, ring_size=n, hardware=slow_link
    )
    t_compute, t_transfer = starved.compute_s / n, starved.transfer_s / (n - 1)
    assert starved.hidden_fraction == pytest.approx(t_compute / t_transfer)
    assert starved.overlapped_s == pytest.approx(t_compute + (n - 1) * t_transfer)
    single = ring_cost("all_gather_matmul", rows=M, contract=C, cols=F, ring_size=1,
                       hardware=slow_link)  # fmt: skip
    assert single.bytes_sent == 0 and single.hidden_fraction == 1.0


def test_bidirectional_bandwidth_by_topology():
    args = dict(rows=M, contract=C, cols=F, ring_size=8)
    for preset, gain in (("tpu_v5p_ici", 2.0), ("h100_nvlink", 1.0)):
        uni = ring_cost("all_gather_matmul", hardware=preset, **args)
        bi = ring_cost("all_gather_matmul", hardware=preset, bidirectional=True, **args)
        assert uni.transfer_s / bi.transfer_s == pytest.approx(gain), preset


def test_llama_mlp_is_predicted_to_overlap_on_both_presets():
    for preset in PRESETS:
        costs = cost_model.layer_costs(
            MODELS["llama3-70b"], tokens=8192, ring_size=8, hardware=preset, bidirectional=True
        )
        for name, cost in costs.items():
            assert 0.0 < cost.hidden_fraction <= 1.0, (preset, name)
            assert cost.overlapped_s <= cost.serial_s


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(op="all_gather"), "op='all_gather' is not one of"),
        (dict(hardware="a100"), "hardware='a100' is not one of"),
        (dict(ring_size=0), "ring_size=0 must be a positive int"),
        (dict(rows=2.5), "rows=2.5 must be a positive int"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(op="all_gather_matmul", rows=8, contract=8, cols=8, ring_size=2)
    args["hardware"] = "h100_nvlink"
    args.update(kwargs)
    op = args.pop("op")
    with pytest.raises(ValueError, match=match):
        ring_cost(op, **args)
    with pytest.raises(ValueError, match="tflops=0 must be a finite number > 0"):
        Hardware("x", tflops=0, link_gb_per_s=1, egress_gb_per_s=1)


def _ppermute_bytes(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            total += sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars)
        for sub in sub_jaxprs(eqn):
            total += _ppermute_bytes(sub)
    return total


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_model_bytes_match_the_ring(op, bidirectional):
    """The bytes the xla ring hands to ppermute per device equal the model's bytes_sent."""
    case = Case(op, 4, layout="rows", bidirectional=bidirectional, m=6)
    x, w, _ = case.inputs()
    jaxpr = jax.make_jaxpr(case.sharded(case.call("xla")))(x, w).jaxpr
    (rows, c_global), (_, f_global) = x.shape, w.shape
    cost = ring_cost(
        op, rows=rows, contract=c_global, cols=f_global, ring_size=case.n,
        hardware="h100_nvlink", dtype_bytes=np.dtype(case.dtype).itemsize,
        bidirectional=bidirectional,
    )  # fmt: skip
    assert _ppermute_bytes(jaxpr) == pytest.approx(cost.bytes_sent)


def test_prediction_rows_cover_models_presets_and_directions():
    rows = cost_model.prediction_rows(("llama3-8b", "llama3-70b"), tokens=4096, ring_size=8)
    assert len(rows) == 2 * len(PRESETS) * 2 * 2
    assert all(0.0 < row["hidden"] <= 1.0 and row["speedup"] >= 1.0 for row in rows)
    # A bidirectional ring doubles the ICI bandwidth: never less hidden than one direction.
    for uni, bi in zip(rows[0::4], rows[2::4], strict=True):
        assert bi["hidden"] >= uni["hidden"]


def test_presets_read_the_hardware_table():
    from shardfuse import hardware

    h100, v5p = hardware.device("h100-sxm"), hardware.device("tpu-v5p")
    assert PRESETS["h100_nvlink"].tflops == h100.peak_tflops("bfloat16")
    assert PRESETS["h100_nvlink"].link_gb_per_s == h100.link.gb_per_s
    assert PRESETS["tpu_v5p_ici"].egress_gb_per_s == v5p.link.egress_gb_per_s
    assert Hardware.from_device(v5p) == PRESETS["tpu_v5p_ici"]
    v4 = hardware.device("tpu-v4")
    assert Hardware.from_device("tpu-v4").link_gb_per_s == v4.link.gb_per_s
    with pytest.raises(ValueError, match="has no link figures"):
        Hardware.from_device(dataclasses.replace(v4, link=None))
    with pytest.raises(ValueError, match="'tpu-v5e' has no float32 peak"):
        Hardware.from_device("tpu-v5e", dtype="float32")
    # A model name works where a ModelSpec does; unknown names list the valid ones.
    assert cost_model.layer_costs("llama3-8b", tokens=1024, ring_size=8, hardware="h100_nvlink")
    with pytest.raises(ValueError, match="is not one of"):
        cost_model.layer_costs("llama-9", tokens=1024, ring_size=8, hardware="h100_nvlink")
