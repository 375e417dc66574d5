"""Fused Pallas TPU collective matmuls in TPU interpret mode, with the race detector on.

Each kernel runs with `InterpretParams(detect_races=True)` in both DMA
execution modes ("on_wait" completes pending DMAs newest-first when waited
on; "eager" completes them at once): results match `lax.all_gather(x) @ w` /
`lax.psum_scatter(x @ w)` and no race is found. Without the credit handshake
(the planted race) the detector fires. The real Mosaic kernels lower for TPU.
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse._compat import race_detector_params, races_found
from shardfuse.collectives.collective_matmul import base, pallas_tpu
from shardfuse.kernels.pallas_interpret import interpret_mode
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.collectives.collective_matmul.common import (
    Case,
    ring_mesh,
    run_with_oracle,
    upcast_oracle,
)

pytestmark = pytest.mark.timeout(300)

MODES = ("on_wait", "eager")
NAMES = ("y", "dx", "dw")


def _handshake(handshake: bool):
    return contextlib.nullcontext() if handshake else pallas_tpu.without_handshake()


def _forward(case: Case, mode: str, *, handshake: bool = True):
    """The op's forward under the race detector; returns (output, races found)."""
    x, w, _ = case.placed(*case.inputs())
    params = race_detector_params(dma_execution_mode=mode)
    with interpret_mode(params), _handshake(handshake):
        pltpu.reset_tpu_interpret_mode_state()
        y = jax.block_until_ready(jax.jit(case.sharded(case.call("pallas_tpu")))(x, w))
        return y, races_found()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "case",
    [
        Case("all_gather_matmul", 4, bidirectional=True, m=4),
        Case("matmul_reduce_scatter", 4, bidirectional=True, m=4),
        pytest.param(Case("all_gather_matmul", 4, m=2), marks=pytest.mark.slow),
        pytest.param(Case("matmul_reduce_scatter", 4, m=2), marks=pytest.mark.slow),
    ],
    ids=Case.id,
)
def test_forward_race_free(case, mode):
    y, races = _forward(case, mode)
    assert not races, f"race detected in {case} ({mode})"
    x, w, _ = case.placed(*case.inputs())
    expected = jax.jit(case.sharded(case.oracle))(x, w)
    assert_close(y, expected, name=f"{case} {mode} y")


@pytest.mark.parametrize("mode", MODES)
def test_gather_accumulate_race_free(mode):
    """The weight-gradient kernel: sum_j l[chunk j]^T g_j == l^T all_gather(g), no race."""
    n, m, g_width, l_width = 4, 4, 8, 16
    mesh = ring_mesh(n)
    plan = base.make_plan("model", n, 0, m, bidirectional=True)
    g = jax.random.normal(jax.random.key(0), (n * m, g_width))
    local = jax.random.normal(jax.random.key(1), (n, n * m, l_width))  # one [N m, H] per device

    def per_shard(g, local):
        return pallas_tpu._gather_accumulate(g, local[0], plan, ("model",))[None]

    def oracle(g, local):
        gathered = lax.all_gather(g, "model", tiled=True)
        return jnp.matmul(local[0].T, gathered, precision=lax.Precision.HIGHEST)[None]

    specs = dict(mesh=mesh, in_specs=(P("model"), P("model")), out_specs=P("model"))
    g = jax.device_put(g, NamedSharding(mesh, P("model")))
    local = jax.device_put(local, NamedSharding(mesh, P("model")))
    params = race_detector_params(dma_execution_mode=mode)
    with interpret_mode(params):
        pltpu.reset_tpu_interpret_mode_state()
        got = jax.block_until_ready(jax.jit(jax.shard_map(per_shard, **specs))(g, local))
        assert not races_found()
    assert_close(got, jax.jit(jax.shard_map(oracle, **specs))(g, local), name="gather_accumulate")


@pytest.mark.parametrize(
    "case",
    [
        Case("all_gather_matmul", 4, bidirectional=True, m=4),
        Case("matmul_reduce_scatter", 4, bidirectional=True, m=4),
        Case("all_gather_matmul", 2, data=2, m=3),  # 2-D mesh: the ring on "model"
        pytest.param(Case("matmul_reduce_scatter", 1, m=3), marks=pytest.mark.slow),
    ],
    ids=Case.id,
)
def test_forward_and_gradients(case):
    """Forward and vjp (dx through the other fused kernel, dw through gather-accumulate)."""
    params = pltpu.InterpretParams(dma_execution_mode="eager")
    with interpret_mode(params):
        got, expected = run_with_oracle(case, "pallas_tpu")
    for name, g, e in zip(NAMES, got, expected, strict=True):
        assert_close(g, e, kind="output" if name == "y" else "grad", name=f"{case} {name}")


@pytest.mark.parametrize(
    "op",
    [
        pytest.param("all_gather_matmul", marks=pytest.mark.slow),
        pytest.param("matmul_reduce_scatter", marks=pytest.mark.slow),
    ],
)
def test_bfloat16(op):
    case = Case(op, 2, bidirectional=True, dtype="bfloat16", m=4, c=16, f=16)
    with interpret_mode(pltpu.InterpretParams(dma_execution_mode="eager")):
        got, ref_lp = run_with_oracle(case, "pallas_tpu")
    ref32 = upcast_oracle(case)
    for name, g, r32, rlp in zip(NAMES, got, ref32, ref_lp, strict=True):
        kind = "output" if name == "y" else "grad"
        assert_close_low_precision(g, r32, rlp, kind=kind, name=f"{case} {name}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_planted_race_is_detected(op, mode):
    """Without the handshake a fast upstream device overwrites a slot still being read."""
    _, races = _forward(Case(op, 4, m=2), mode, handshake=False)
    assert races, f"the race detector missed the planted race in {op} ({mode})"


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_lowers_for_tpu(op, bidirectional):
    """The Mosaic kernels (remote DMAs, semaphores) lower for TPU, forward and backward."""
    case = Case(op, 4, bidirectional=bidirectional, layout="rows", m=16, c=128, f=128)
    x, w, cotangent = case.inputs()
    f = case.sharded(case.call("pallas_tpu"))

    def fwd_bwd(x, w, cotangent):
        y, vjp = jax.vjp(f, x, w)
        return y, vjp(cotangent)

    with interpret_mode(False):
        lowered = jax.jit(fwd_bwd).trace(x, w, cotangent).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    kernels = (
        "shardfuse_all_gather_matmul",
        "shardfuse_matmul_reduce_scatter",
        "shardfuse_gather_accumulate",
    )
    for kernel in kernels:
        assert f'kernel_name = "{kernel}"' in text, kernel


def test_not_implemented_falls_back():
    case = Case("all_gather_matmul", 2, dtype="float16")
    x, w, _ = case.placed(*case.inputs())
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        jax.jit(case.sharded(case.call("pallas_tpu")))(x, w)
    all_reduce = dataclasses.replace(case, op="matmul_all_reduce", dtype="float32")
    x, w, _ = all_reduce.placed(*all_reduce.inputs())
    with pytest.raises(NotImplementedError, match="no fused matmul_all_reduce"):
        jax.jit(all_reduce.sharded(all_reduce.call("pallas_tpu")))(x, w)
    assert jnp.isfinite(jax.jit(all_reduce.sharded(all_reduce.call(None)))(x, w)).all()
