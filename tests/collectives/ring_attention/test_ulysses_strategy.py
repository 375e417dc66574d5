"""The cost rule behind `strategy=None` (`strategy.py`) and `ring_attention_plan`.

Predictions checked against the formulas worked by hand on round numbers,
the all-to-all model of a switch and of a torus ring, the rule (the fastest
applicable strategy), and that `sf.ring_attention(strategy=None)` runs what
`ring_attention_plan` says (read from the collectives it traces: all_gather,
all_to_all or ppermute).
"""

import doctest
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse import models
from shardfuse.collectives.collective_matmul.cost_model import Hardware
from shardfuse.collectives.ring_attention import ContextParallelPlan, ring_attention_plan, strategy
from tests.collectives.ring_attention.test_ring_structure import collectives_in

UNIT_SWITCH = Hardware("unit switch", tflops=1.0, link_gb_per_s=1.0, egress_gb_per_s=1.0)
UNIT_TORUS = Hardware("unit torus", tflops=1.0, link_gb_per_s=1.0, egress_gb_per_s=6.0)


def test_costs_worked_by_hand():
    """N = 4, non-causal, T = S = 4096, on a 1 TFLOP/s, 1 GB/s switch, no latency."""
    B, T, H, K, D, n, e = 1, 4096, 8, 2, 64, 4, 2
    costs = strategy.strategy_costs(
        batch=B, seq_len=T, heads=H, kv_heads=K, head_dim=D, sequence_size=n, ulysses_size=2,
        causal=False, hardware=UNIT_SWITCH, latency_us=0.0,
    )  # fmt: skip
    by = {c.strategy: c for c in costs}
    t_f = 4 * B * H * D * T * T / n / 1e12
    kv = 2 * B * (T / n) * K * D * e  # K and V of one device, bytes
    step = kv / 1e9
    assert by["ring"].forward_s == pytest.approx(t_f / n + (n - 1) * max(t_f / n, step))
    dkv = kv * 2  # float32 accumulators
    bwd = 2.5 * t_f / n + (n - 1) * max(2.5 * t_f / n, (kv + dkv) / 1e9) + dkv / 1e9
    assert by["ring"].backward_s == pytest.approx(bwd)
    gather = (n - 1) * kv / 1e9
    assert by["all_gather"].forward_s == pytest.approx(gather + t_f)
    assert by["all_gather"].backward_s == pytest.approx(2.5 * t_f + gather)
    assert by["all_gather"].kv_bytes == pytest.approx(n * kv)
    # Ulysses: q, out (B T/n H D e each) and k, v (kv heads repeated to lcm(2, 4) = 4), lse.
    q_bytes, k_bytes, lse = B * T / n * H * D * e, B * T / n * 4 * D * e, B * T / n * H * 4
    a2a = (2 * q_bytes + 2 * k_bytes + lse) * (n - 1) / n / 1e9
    assert by["ulysses"].forward_s == pytest.approx(a2a + t_f)
    assert by["ulysses"].backward_s == pytest.approx(a2a + 2.5 * t_f)
    # USP 2 x 2: Ulysses over 2 (kv heads 2: scattered), the ring over 2 with H / 2 heads.
    usp = by["ulysses_ring"]
    assert (usp.ulysses_size, usp.ring_size) == (2, 2)
    a2a_2 = (2 * q_bytes + 2 * (B * T / n * K * D * e) + lse) / 2 / 1e9
    ring_kv = 2 * B * (T / 2) * (K / 2) * D * e
    assert usp.forward_s == pytest.approx(a2a_2 + t_f / 2 + max(t_f / 2, ring_kv / 1e9))


def test_all_to_all_switch_and_torus():
    """X bytes per device over n = 8: a switch sends 7/8 X at the egress; a torus ring is
    bisection-bound: X floor(64 / 4) / (2 * 8 * link) = X / link, whatever the egress."""
    x = 8e9
    assert strategy._all_to_all_s(x, 8, UNIT_SWITCH, 0.0) == pytest.approx(7.0)
    assert strategy._all_to_all_s(x, 8, UNIT_TORUS, 0.0) == pytest.approx(8.0)
    assert strategy._all_to_all_s(x, 2, UNIT_TORUS, 0.0) == pytest.approx(2.0)  # 2 links
    assert strategy._all_to_all_s(x, 1, UNIT_TORUS, 1e-3) == 0.0


def test_rule_picks_the_fastest_applicable():
    costs = strategy.strategy_costs(
        batch=1, seq_len=8192, heads=4, kv_heads=2, head_dim=64, sequence_size=8,
        hardware="h100-sxm",
    )  # fmt: skip
    by = {c.strategy: c for c in costs}
    assert not by["ulysses"].applicable
    assert "H=4 is not a multiple of 8" in by["ulysses"].why_not
    best = min((c for c in costs if c.applicable), key=lambda c: c.total_s)
    assert strategy.choose(costs) == best.strategy
    with pytest.raises(ValueError, match="no context-parallel strategy applies: ulysses: heads"):
        strategy.choose(costs, allowed=("ulysses",))


@pytest.mark.parametrize("hardware", ["h100-sxm", "tpu-v5p"])
def test_predicted_winners_8k_to_1m(hardware):
    """The README's table: a strategy with fewer, larger messages (all_gather, or Ulysses on
    NVLink) wins short sequences, the overlapped ring long ones; the crossovers are where the
    winner changes."""
    lens = [8192 << i for i in range(8)]
    rows = strategy.predicted_winners(models.get("llama3-8b"), hardware=hardware, seq_lens=lens)
    assert [r["seq_len"] for r in rows] == lens
    short = "ulysses" if hardware == "h100-sxm" else "all_gather"
    assert rows[0]["winner"] == short and rows[-1]["winner"] == "ring"
    for row in rows:
        assert row["winner"] == min(("ring", "all_gather", "ulysses"), key=row.get)
    changes = strategy.crossovers(rows)
    assert changes and changes[-1][2] == "ring"


def _mesh(shape, names, kind="explicit"):
    devices = jax.devices()[: int(np.prod(shape))]
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)


def _traced_strategy(q, k, mesh, axis="sequence", **kwargs):
    jaxpr = jax.make_jaxpr(
        lambda q, k, v: sf.ring_attention(
            q, k, v, mesh=mesh, sequence_axis=axis, strategy=None, causal=True, **kwargs
        )
    )(q, k, k).jaxpr
    names = {name for name, _ in collectives_in(jaxpr)}
    if "all_to_all" in names:
        return "ulysses_ring" if "ppermute" in names else "ulysses"
    return "all_gather" if any("all_gather" in n for n in names) else "ring"


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize(
    "T, H, expected",
    [(8192, 32, "ulysses"), (131072, 32, "ring"), (16384, 4, "all_gather")],
)  # the last: Ulysses is predicted fastest, but 4 heads cannot split over 8 devices
def test_strategy_none_runs_the_plan(kind, T, H, expected, caplog):
    """Traced only (ShapeDtypeStructs): the collectives show which strategy ran. On CPU
    the rule uses the H100 SXM figures (shardfuse.hardware has no CPU entry)."""
    mesh = _mesh((8,), ("sequence",), kind)
    q = jax.ShapeDtypeStruct((1, T, H, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, min(H, 8), 128), jnp.bfloat16)
    plan = ring_attention_plan(q, k, mesh=mesh, causal=True)
    assert plan.strategy == expected, str(plan)
    assert plan.hardware.name.startswith("H100 SXM")
    if H == 4:
        assert plan.cost("ulysses").total_s < plan.cost(expected).total_s
        assert not plan.cost("ulysses").applicable
    with caplog.at_level(logging.DEBUG, logger="shardfuse"):
        assert _traced_strategy(q, k, mesh) == expected
    assert f"sf.ring_attention(strategy=None) -> {expected}" in caplog.text


def test_strategy_none_on_two_axes_is_usp():
    mesh = _mesh((2, 4), ("ring", "ulysses"))
    q = jax.ShapeDtypeStruct((1, 8192, 8, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 8192, 2, 64), jnp.bfloat16)
    plan = ring_attention_plan(q, k, mesh=mesh, sequence_axis=("ulysses", "ring"), causal=True)
    assert plan.strategy == "ulysses_ring"
    usp = plan.cost("ulysses_ring")
    assert (usp.ulysses_size, usp.ring_size) == (4, 2)
    assert "needs a single sequence axis" in plan.cost("ring").why_not
    assert "ulysses_ring" in str(plan) and "not applicable" in str(plan)
    assert _traced_strategy(q, k, mesh, axis=("ulysses", "ring")) == "ulysses_ring"


def test_plan_with_model_and_data_axes():
    """Heads per model shard (32 / 2 = 16) and batch per data shard enter the prediction."""
    mesh = _mesh((2, 2, 2), ("data", "sequence", "model"), "auto")
    q = jax.ShapeDtypeStruct((4, 4096, 32, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((4, 4096, 8, 128), jnp.bfloat16)
    plan = ring_attention_plan(
        q, k, mesh=mesh, data_axis="data", model_axis="model", hardware="tpu-v5p"
    )
    by_hand = strategy.strategy_costs(
        batch=2, seq_len=4096, heads=16, kv_heads=4, head_dim=128, sequence_size=2,
        causal=False, hardware="tpu-v5p",
    )  # fmt: skip
    assert plan.costs == by_hand
    assert plan.hardware.name == "TPU v5p, ICI"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hardware="h900"), r"device 'h900' is not one of"),
        (dict(hardware=3), r"hardware=3 must be None, a key of shardfuse.hardware"),
        (dict(latency_us=-1.0), r"latency_us=-1.0 must be a finite number >= 0"),
        (dict(sequence_axis="context"), r"axis 'context' is not in the mesh"),
    ],
)
def test_plan_bad_input(kwargs, match):
    mesh = _mesh((4,), ("sequence",))
    q = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.float32)
    with pytest.raises(ValueError, match=match):
        ring_attention_plan(q, q, mesh=mesh, **kwargs)


def test_strategy_costs_bad_sizes():
    with pytest.raises(ValueError, match=r"seq_len=0 must be a positive int"):
        strategy.strategy_costs(
            batch=1, seq_len=0, heads=4, kv_heads=4, head_dim=8, sequence_size=2
        )
    with pytest.raises(ValueError, match=r"ulysses_size=3 must be a divisor of sequence_size=8"):
        strategy.strategy_costs(
            batch=1, seq_len=64, heads=4, kv_heads=4, head_dim=8, sequence_size=8, ulysses_size=3
        )


def test_plan_on_explicit_mesh_matches_auto():
    q = jax.ShapeDtypeStruct((1, 65536, 8, 128), jnp.bfloat16)
    plans = [ring_attention_plan(q, q, mesh=_mesh((8,), ("sequence",), kind)) for kind in
             ("explicit", "auto")]  # fmt: skip
    assert plans[0] == plans[1]
    assert isinstance(plans[0], ContextParallelPlan)
    assert plans[0].strategy in ("ring", "all_gather", "ulysses")


@pytest.mark.parametrize(
    "module",
    # The examples that compile shard_maps (20 s and 10 s on the 2-core CI host): -m slow.
    ["plan", "strategy", pytest.param("ulysses", marks=pytest.mark.slow),
     pytest.param("sharded", marks=pytest.mark.slow)],
)  # fmt: skip
def test_docstring_examples(module):
    module = importlib.import_module(f"shardfuse.collectives.ring_attention.{module}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module.__name__} has no examples"
    assert result.failed == 0, f"{result.failed} failing examples in {module.__name__}"


def test_latency_is_the_links():
    """Without latency_us, each collective costs the link's latency_us of shardfuse.hardware."""
    link = sf.hardware.device("tpu-v5p").link
    assert strategy.resolve_hardware("tpu-v5p").step_latency_us == link.latency_us
    sizes = dict(batch=1, seq_len=2048, heads=8, kv_heads=2, head_dim=64, sequence_size=4)
    implicit = strategy.strategy_costs(**sizes, hardware="tpu-v5p")
    explicit = strategy.strategy_costs(**sizes, hardware="tpu-v5p", latency_us=link.latency_us)
    none = strategy.strategy_costs(**sizes, hardware="tpu-v5p", latency_us=0.0)
    assert implicit == explicit
    # all_gather: one gather of K and of V (2 collectives) in each direction.
    extra = implicit[1].total_s - none[1].total_s
    assert extra == pytest.approx(4 * link.latency_us * 1e-6)
