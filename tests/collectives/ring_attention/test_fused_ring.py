"""The fused TPU ring (implementation="pallas_tpu_fused") in TPU interpret mode.

Numerics: forward, lse and gradients against `sf.attention_reference` on the
gathered sequence (float32 1e-5 / 2e-5; bfloat16 the 2x / 3x rule), over
layouts, causal and not, GQA / MQA, window, softcap, segment ids, T != S and
batch / heads sharded over other mesh axes. Races: both kernels run under
`InterpretParams(detect_races=True)` in both DMA execution modes ("on_wait":
DMAs complete when waited on; "eager": at once) and find none; without the
credit handshake (the planted race) the detector fires, in the forward's K/V
ring and in the backward's dK/dV ring. Structure: one kernel per direction
and no XLA collective; causal step skipping from the block-state table. The
Mosaic kernels lower for TPU.

Sizes: rings of 2 and 4 devices, local shards of 8 to 16 rows. TPU interpret
mode runs every simulated device in host callbacks; on the 2-core CI host
larger rings or buffers make the device threads starve each other (and can
deadlock), so nothing here is bigger than it needs to be (fused_ring_cases).
The default suite keeps one case of each kind; the matrix runs with -m slow.
"""

import contextlib
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse._compat import race_detector_params, races_found
from shardfuse.collectives.collective_matmul.pallas_tpu import without_handshake
from shardfuse.collectives.ring_attention import api, pallas_tpu_fused, ring
from shardfuse.kernels.attention import base
from shardfuse.kernels.attention import pallas_tpu_blocks as tiles
from shardfuse.kernels.pallas_interpret import interpret_mode
from shardfuse.testing import assert_close, iter_eqns
from tests.collectives.ring_attention.fused_ring_cases import (
    FUSED,
    case,
    check_fused,
    fused_fn,
)
from tests.collectives.ring_attention.ring_cases import make_inputs, oracle_fn, ring_mesh, with_vjp
from tests.pairwise import pairwise

pytestmark = pytest.mark.timeout(300)

MODES = ("on_wait", "eager")

# The race-free test checks a ring of 4 (zigzag, causal, GQA 2:1) against the reference too.
FAST_CASES = [
    # bf16, every mask, heads sharded over a second mesh axis (4 simulated devices).
    case(
        N=2,
        layout="contiguous",
        mesh="2d",
        B=2,
        H=2,
        K=2,
        dtype="bfloat16",
        causal=True,
        window=(9, None),
        softcap=20.0,
        segments=True,
    ),  # fmt: skip
]
SLOW_CASES = [
    case(N=n, layout=layout, causal=causal, H=4, K=k)
    for n, layout, causal, k in pairwise(
        (2, 4), ("contiguous", "zigzag", "striped"), (True, False), (4, 1)
    )
] + [
    case(N=4, layout="zigzag", causal=True, H=4, K=2),
    case(N=4, layout="contiguous", causal=False, window=(5, 3), H=8, K=2),
    case(N=2, layout="striped", causal=False, segments=True, K=1, B=2),
    case(N=4, layout="zigzag", softcap=10.0, dtype="bfloat16", H=4, K=1),
    case(N=2, layout="zigzag", T=16, S=32, causal=True),  # T < S: queries late in the sequence
    case(N=2, layout="contiguous", T=32, S=16, causal=True),  # T > S: rows that see nothing
    case(N=2, layout="zigzag", T=32, S=32, H=2, K=2),  # 16 rows per shard
    case(N=2, layout="zigzag", mesh="3d", B=2, H=4, K=1, causal=False, segments=True),
    case(N=2, layout="contiguous", mesh="3d", B=2, H=4, K=2, dtype="bfloat16", segments=True),
    case(N=4, layout="striped", dtype="bfloat16", segments=True, window=(7, None)),
]


@pytest.mark.slow  # test_race_free checks the same numerics in the default suite
@pytest.mark.parametrize("c", FAST_CASES, ids=lambda c: c.id)
def test_fused_ring_matches_reference(c):
    check_fused(c)


@pytest.mark.slow
@pytest.mark.parametrize("c", SLOW_CASES, ids=lambda c: c.id)
def test_fused_ring_matrix(c):
    check_fused(c)


@pytest.mark.slow
@pytest.mark.parametrize(
    "c",
    [
        case(N=2, layout="zigzag", T=512, S=512, H=1, K=1, causal=True),
        case(N=2, layout="contiguous", T=512, S=512, H=2, K=1, causal=True, segments=True),
        case(N=2, layout="striped", T=512, S=256, H=1, K=1, causal=False, window=(100, 20)),
    ],
    ids=lambda c: c.id,
)
def test_fused_ring_several_blocks_per_shard(c):
    """128-row tiles within a shard (2 x 2 or 2 x 1 per step): the block loops, the
    (query block, key block) state table and its skipped blocks on the diagonal."""
    check_fused(c, block_sizes=base.BlockSizes(128, 128))


# --- races ---------------------------------------------------------------------------------


def _under_detector(c, mode, *, handshake=True, backward=True):
    """One jitted forward (and vjp: both kernels) under the race detector:
    `((out, lse[, dq, dk, dv]), races found)`."""
    q, k, v, kwargs, cotangents = make_inputs(c)
    params = race_detector_params(dma_execution_mode=mode)
    context = contextlib.nullcontext() if handshake else without_handshake()
    attend = fused_fn(c, kwargs)
    with interpret_mode(params), context:
        pltpu.reset_tpu_interpret_mode_state()
        if backward:
            results = with_vjp(attend)(q, k, v, *cotangents)
        else:
            results = jax.jit(attend)(q, k, v)
        return jax.block_until_ready(results), races_found()


def _forward_then_backward(c, mode, *, handshake=True):
    """The forward, then (race state reset) the backward, each under the race detector:
    `(races in the forward, races in the backward)`, to tell the two rings apart."""
    q, k, v, kwargs, (d_out, d_lse) = make_inputs(c)
    params = race_detector_params(dma_execution_mode=mode)
    context = contextlib.nullcontext() if handshake else without_handshake()
    with interpret_mode(params), context:
        pltpu.reset_tpu_interpret_mode_state()
        outputs, vjp = jax.vjp(fused_fn(c, kwargs), q, k, v)
        jax.block_until_ready(outputs)
        forward_races = races_found()
        pltpu.reset_tpu_interpret_mode_state()
        d_lse = jnp.where(jnp.isfinite(outputs[1]), d_lse, 0.0)
        jax.block_until_ready(vjp((d_out, d_lse)))
        return forward_races, races_found()


@pytest.mark.parametrize("mode", ["on_wait", pytest.param("eager", marks=pytest.mark.slow)])
def test_race_free(mode):
    """Ring of 4 on an Explicit mesh (the numerics case runs on Auto axes): the credits of
    both rings are exercised (K/V from step 2 on, dK/dV too); results match the reference."""
    c = case(N=4, layout="zigzag", causal=True, H=2, K=1, mesh="explicit")
    actual, races = _under_detector(c, mode)
    assert not races, f"race in the fused forward or backward ({mode})"
    q, k, v, kwargs, cotangents = make_inputs(c)
    expected = oracle_fn(kwargs)(q, k, v, *cotangents)
    names, kinds = ("out", "lse", "dq", "dk", "dv"), ("output",) * 2 + ("grad",) * 3
    for name, kind, a, e in zip(names, kinds, actual, expected, strict=True):
        assert_close(a, e, kind=kind, name=f"{mode} {name}")


@pytest.mark.parametrize(
    "mode, backward",
    [
        ("on_wait", False),
        pytest.param("on_wait", True, marks=pytest.mark.slow),
        pytest.param("eager", True, marks=pytest.mark.slow),
    ],
    ids=["on_wait-forward", "on_wait-both", "eager-both"],
)
def test_planted_race_is_detected(mode, backward):
    """Without the credits a fast upstream device overwrites a receive slot still being read:
    the detector fires in the forward (K/V ring) and in the backward (dK/dV ring)."""
    c = case(N=4, layout="contiguous", causal=False, H=1, K=1)
    if backward:  # run apart, to tell the two rings' races apart
        forward_races, backward_races = _forward_then_backward(c, mode, handshake=False)
    else:
        _, forward_races = _under_detector(c, mode, handshake=False, backward=False)
    assert forward_races, f"the detector missed the planted race in the forward ({mode})"
    if backward:
        assert backward_races, f"the detector missed the planted race in the backward ({mode})"


# --- structure, causal step skipping, lowering ---------------------------------------------


def _kernel_names_and_collectives(c):
    q, k, v, kwargs, cotangents = make_inputs(c)
    run = with_vjp(fused_fn(c, kwargs))
    with interpret_mode(pltpu.InterpretParams()):
        jaxpr = jax.make_jaxpr(run)(q, k, v, *cotangents)
    names, collectives = [], []
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params.get("name")))
        if eqn.primitive.name in ("ppermute", "all_gather", "psum", "all_to_all", "psum_scatter"):
            collectives.append(eqn.primitive.name)
    return names, collectives


@pytest.mark.slow  # test_lowers_for_tpu checks the same in the exported module
def test_one_kernel_per_direction_and_no_xla_collective():
    names, collectives = _kernel_names_and_collectives(case(N=4, layout="zigzag"))
    assert len(names) == 2, names
    for direction, name in zip(("forward", "backward"), names, strict=True):
        assert f"shardfuse_ring_attention_fused_{direction}" in name, names
    assert collectives == [], f"K/V must move inside the kernels, not by {collectives}"


def _states(n, layout, causal, length=8):
    """Every device's per-step block-state table: int32 `[device, step, nq nk]`."""
    zeros = jnp.zeros((1, length, 1, 64))
    config = base.validate(
        zeros, zeros, zeros, causal=causal, q_positions=None, kv_positions=None,
        q_segment_ids=None, kv_segment_ids=None, window=None, logit_softcap=None, scale=None,
        block_sizes=None,
    )  # fmt: skip
    spec = ring.RingSpec("sequence", n, layout, config, 0, "pallas_tpu")
    fz = pallas_tpu_fused._Fused(spec, ("sequence",), pltpu.InterpretParams(), True)

    def table(q):
        st = pallas_tpu_fused._static(fz, q, q, None, backward=False)
        q_pos, _, _ = pallas_tpu_fused._metadata(fz, q, q, None, None)
        return pallas_tpu_fused._step_states(fz, st, q_pos)[None]

    spec_in = P(None, "sequence")
    mapped = jax.shard_map(table, mesh=ring_mesh(n), in_specs=spec_in, out_specs=P("sequence"))
    return np.asarray(jax.jit(mapped)(jnp.zeros((1, n * length, 1, 64)))).reshape(n, n, -1)


def test_causal_step_skipping():
    """Contiguous causal ring of 4: device r computes only steps 0..r (the K/V of devices
    r, r-1, ..., 0); every later step is SKIP and only passes K/V on. Zigzag balances it."""
    states = _states(4, "contiguous", causal=True)  # [device, step, blocks]
    for r in range(4):
        computed = [bool((states[r, s] != tiles.SKIP).any()) for s in range(4)]
        assert computed == [s <= r for s in range(4)], (r, states[r])
        assert (states[r, 0] != tiles.FULL).all()  # its own block: the diagonal, masked
        assert (states[r, 1 : r + 1] == tiles.FULL).all()  # earlier devices: fully visible
    zigzag = _states(4, "zigzag", causal=True)
    assert len({int((zigzag[r] != tiles.SKIP).sum()) for r in range(4)}) == 1
    assert (_states(2, "contiguous", causal=False) == tiles.FULL).all()


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_lowers_for_tpu(dtype):
    """The Mosaic kernels (remote DMAs, semaphores, the block loops) lower for TPU, forward
    and backward, at TPU tile sizes: 256 rows per shard in 128-row tiles, head dim 128."""
    c = case(N=4, layout="zigzag", T=1024, S=1024, H=2, K=1, D=128, dtype=dtype)
    q, k, v, kwargs, cotangents = make_inputs(c)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    run = with_vjp(fused_fn(c, {**kwargs, "block_sizes": base.BlockSizes(128, 128)}))
    with interpret_mode(False):
        exported = jax.export.export(run, platforms=["tpu"])(q, k, v, *cotangents)
    text = exported.mlir_module()
    for direction in ("forward", "backward"):
        assert f'kernel_name = "shardfuse_ring_attention_fused_{direction}"' in text, direction
    for collective in ("collective_permute", "all_gather", "all_reduce", "all_to_all"):
        assert collective not in text, f"K/V must move inside the kernels, not by {collective}"


# --- dispatch and fallbacks -----------------------------------------------------------------


def test_not_implemented_falls_back(monkeypatch):
    """float16 and shards beyond the VMEM budget: NotImplementedError when named alone, the
    next implementation of a sequence otherwise."""
    c = case(N=2, layout="zigzag")
    q, k, v, kwargs, _ = make_inputs(c)
    half = [x.astype(jnp.float16) for x in (q, k, v)]
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        jax.make_jaxpr(fused_fn(c, kwargs))(*half)  # raised while tracing
    assert pallas_tpu_fused.working_set_bytes(q, k, False) < pallas_tpu_fused.VMEM_BUDGET_BYTES
    long_shard = pallas_tpu_fused.working_set_bytes(
        jnp.zeros((1, 8192, 32, 128), jnp.bfloat16), jnp.zeros((1, 8192, 8, 128)), False
    )
    assert long_shard > pallas_tpu_fused.VMEM_BUDGET_BYTES
    monkeypatch.setattr(pallas_tpu_fused, "VMEM_BUDGET_BYTES", 0)  # nothing fits
    with pytest.raises(NotImplementedError, match="keeps the shard in VMEM"):
        jax.make_jaxpr(fused_fn(c, kwargs))(q, k, v)
    # Traced only (the xla ring's numerics are tested with it): the fallback runs no kernel.
    jaxpr = jax.make_jaxpr(fused_fn(c, kwargs, implementation=(FUSED, "xla")))(q, k, v)
    primitives = {eqn.primitive.name for eqn in iter_eqns(jaxpr)}
    assert "pallas_call" not in primitives and "ppermute" in primitives, primitives


def test_implementation_names():
    """The ring_attention op lists the per-step backends (every attention backend that returns
    an lse: not cudnn) and the fused ring; an unknown name fails before tracing, naming the
    valid ones."""
    assert FUSED in api.RING_ATTENTION.names
    per_step = set(sf.kernels.registry.get("attention").names) - {"cudnn"}
    assert per_step < set(api.RING_ATTENTION.names)
    assert "cudnn" not in api.RING_ATTENTION.names
    q = jnp.zeros((1, 8, 1, 64))
    mesh = ring_mesh(2)
    bad = jax.shard_map(
        lambda q: sf.collectives.ring_attention(q, q, q, "sequence", implementation="fused"),
        mesh=mesh, in_specs=P(None, "sequence"), out_specs=P(None, "sequence"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="pallas_tpu_fused"):
        bad(q)


@pytest.mark.slow
def test_docstring_examples():
    result = doctest.testmod(pallas_tpu_fused, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.slow
def test_ring_size_one():
    """A ring of one device: no DMA, the kernels reduce to flash attention."""
    check_fused(case(N=1, layout="contiguous", causal=True, T=16, S=16, H=2, K=1))


@pytest.mark.slow
def test_global_ring_attention_runs_the_fused_ring():
    """`sf.ring_attention(implementation="pallas_tpu_fused")`: padded zigzag, forward and grad."""
    mesh = jax.make_mesh((4,), ("sequence",))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, 30, 2, 64), jnp.float32) for key in keys)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) ** 2)

    fused = lambda q, k, v: sf.ring_attention(  # noqa: E731
        q, k, v, mesh=mesh, causal=True, implementation="pallas_tpu_fused"
    )
    reference = lambda q, k, v: sf.attention_reference(q, k, v, causal=True)  # noqa: E731
    assert_close(fused(q, k, v), reference(q, k, v))
    got = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(reference, *a), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, atol=2e-5, rtol=2e-5)


def test_global_ring_attention_refuses_the_fused_ring_for_other_strategies():
    mesh = jax.make_mesh((4,), ("sequence",))
    q = jnp.ones((1, 32, 2, 64), jnp.float32)
    for strategy in ("all_gather", "ulysses"):
        with pytest.raises(ValueError, match="strategy='ring' only"):
            sf.ring_attention(
                q, q, q, mesh=mesh, strategy=strategy, implementation="pallas_tpu_fused"
            )
