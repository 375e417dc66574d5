"""The ring's block backward: every backend's `backward` from the GLOBAL out and lse.

A ring step computes one block's share of the gradients from the out and lse
of the whole ring (`kernels/attention/protocol.py`). Here the keys are cut
into two blocks; the global out/lse is the lse merge of the two blocks'
forwards, and each backend's `backward` on each block must match the
reference's naive block backward (itself checked against autodiff of the
reference on the whole key sequence), with a nonzero `d_lse`.

Structure: the backward pass of ring attention runs only backward kernels.
The block forwards in the jaxpr of the vjp (pallas_call
`shardfuse_flash_attention_fwd`; for xla, the online softmax's float
`reduce_max`) are counted: 0, while the forward pass has them, and a planted
fallback (a block VJP through the differentiable entry, as ring attention
did before every backend had a block backward) is caught.
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.ring_attention import blocks
from shardfuse.collectives.ring_attention.api import ring_attention
from shardfuse.collectives.ring_attention.ring import _merge
from shardfuse.kernels.attention import api, base, pallas_tpu, protocol, reference, xla
from shardfuse.testing import assert_close, iter_eqns
from tests.collectives.ring_attention.ring_cases import oracle_fn, ring_mesh, with_vjp

pytestmark = pytest.mark.timeout(600)

# Same tiling rule as pallas_tpu_cases.STRICT: out-of-bounds reads raise, fresh memory is NaN.
STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")
FORWARD_KERNEL = "shardfuse_flash_attention_fwd"
load_block_ops = blocks.load  # the real one, before any test patches it


@dataclasses.dataclass(frozen=True)
class BlockCase:
    """Queries at positions `q_offset + arange(T)`; keys `arange(S_a + S_b)` cut into two blocks."""

    name: str
    H: int = 2
    K: int = 1
    D: int = 64
    T: int = 24
    S_a: int = 16
    S_b: int = 24
    q_offset: int = 16
    causal: bool = True
    window: tuple | None = None
    softcap: float | None = None
    segments: bool = False  # query segment 7 has no key anywhere: global lse = -inf rows


CASES = [
    BlockCase("causal_mqa"),
    BlockCase("gqa_window_softcap_segments", H=4, K=2, window=(9, 2), softcap=5.0, segments=True),
]


def _inputs(case: BlockCase, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    S = case.S_a + case.S_b
    q = jax.random.normal(keys[0], (1, case.T, case.H, case.D), jnp.float32)
    k = jax.random.normal(keys[1], (1, S, case.K, case.D), jnp.float32)
    v = jax.random.normal(keys[2], (1, S, case.K, case.D), jnp.float32)
    q_pos = jnp.arange(case.T, dtype=jnp.int32) + case.q_offset
    kv_pos = jnp.arange(S, dtype=jnp.int32)
    q_seg = kv_seg = None
    if case.segments:
        q_seg = (jnp.arange(case.T, dtype=jnp.int32)[None] // 10) % 2
        q_seg = q_seg.at[:, 3:6].set(7)  # these queries see no key in any block
        kv_seg = (jnp.arange(S, dtype=jnp.int32)[None] // 13) % 2
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[4], (1, case.H, case.T), jnp.float32)
    return q, k, v, q_pos, kv_pos, q_seg, kv_seg, d_out, d_lse


DEFAULT_BLOCKS = base.BlockSizes()


def _config(case: BlockCase, block_sizes=DEFAULT_BLOCKS):
    return base.AttentionConfig(
        causal=case.causal,
        window=case.window,
        logit_softcap=case.softcap,
        scale=case.D**-0.5,
        block_sizes=block_sizes,
    )


def _split(case, k, v, kv_pos, kv_seg):
    """The two key blocks: `[(k, v, kv_pos, kv_seg)] * 2`."""
    cut = case.S_a
    parts = []
    for sl in (slice(0, cut), slice(cut, None)):
        seg = None if kv_seg is None else kv_seg[:, sl]
        parts.append((k[:, sl], v[:, sl], kv_pos[sl], seg))
    return parts


def _global_out_lse(case, config, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """The ring's global out/lse: the lse merge of the two blocks' reference forwards."""
    B, T, H, D = q.shape
    acc = (jnp.zeros((B, T, H, D), jnp.float32), jnp.full((B, H, T), -jnp.inf, jnp.float32))
    for k_b, v_b, kv_pos_b, kv_seg_b in _split(case, k, v, kv_pos, kv_seg):
        acc = _merge(acc, reference.forward(config, q, k_b, v_b, q_pos, kv_pos_b, q_seg, kv_seg_b))
    out, lse = acc
    return out.astype(q.dtype), lse


def _block_grads(backward, case, config, inputs, **options):
    """`[(dq, dk, dv)]` of each block by `backward`, from the global out/lse, nonzero d_lse."""

    @jax.jit
    def grads(q, k, v, q_pos, kv_pos, q_seg, kv_seg, d_out, d_lse):
        out, lse = _global_out_lse(case, config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)  # as a user's loss would
        return [
            backward(
                config,
                q,
                k_b,
                v_b,
                q_pos,
                kv_pos_b,
                q_seg,
                kv_seg_b,
                out,
                lse,
                d_out,
                d_lse,
                **options,
            )  # fmt: skip
            for k_b, v_b, kv_pos_b, kv_seg_b in _split(case, k, v, kv_pos, kv_seg)
        ]

    return jax.block_until_ready(grads(*inputs))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_block_backward_sums_to_autodiff(case):
    """The oracle: the blocks' shares add up to autodiff of the reference on all keys."""
    inputs = _inputs(case)
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, d_out, d_lse = inputs
    config = _config(case)

    @jax.jit
    def oracle(q, k, v, d_out, d_lse):
        merged = _global_out_lse(case, config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)

        def attend(q, k, v):
            return reference.forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)

        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return merged, (out, lse), vjp((d_out, jnp.where(jnp.isfinite(lse), d_lse, 0.0)))

    (out, lse), (full_out, full_lse), expected = oracle(q, k, v, d_out, d_lse)
    assert_close(out, full_out, name="merged out")
    assert_close(lse, full_lse, name="merged lse")
    if case.segments:
        assert np.all(np.isneginf(np.asarray(lse[:, :, 3:6])))
    (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = _block_grads(reference.backward, case, config, inputs)
    actual = (dq_a + dq_b, jnp.concatenate([dk_a, dk_b], 1), jnp.concatenate([dv_a, dv_b], 1))
    for name, a, e in zip(("dq", "dk", "dv"), actual, expected, strict=True):
        assert_close(a, e, kind="grad", name=name)


def _triton_backward():
    pytest.importorskip("torch", reason="the Triton interpreter runs on torch CPU tensors")
    pytest.importorskip("triton", reason="needs triton (pip install triton)")
    from shardfuse.kernels.attention import triton_gpu
    from shardfuse.kernels.triton.launch import InterpretLauncher

    return triton_gpu.backward, dict(launcher=InterpretLauncher())


# backend -> (block sizes it tiles with, how to get `(backward, static options)`).
BACKENDS = {
    "xla": (base.BlockSizes(16, 16), lambda: (xla.backward, {})),
    "pallas_tpu": (base.BlockSizes(), lambda: (pallas_tpu.backward, dict(interpret=STRICT))),
    # The Triton kernels themselves, in the Triton interpreter on CPU (InterpretLauncher).
    "triton": (base.BlockSizes(16, 16), _triton_backward),
}


def _backend_cases():
    """Every backend on the richest case; the interpreted ones on the plain case with -m slow."""
    for implementation in BACKENDS:
        for case in CASES:
            slow = implementation == "triton" or (implementation != "xla" and case is CASES[0])
            marks = [pytest.mark.slow] if slow else []
            yield pytest.param(
                implementation, case, marks=marks, id=f"{implementation}-{case.name}"
            )


@pytest.mark.parametrize("implementation, case", list(_backend_cases()))
def test_block_backward_matches_reference(implementation, case):
    block_sizes, get = BACKENDS[implementation]
    backward, options = get()
    config = _config(case, block_sizes)
    inputs = _inputs(case, seed=1)
    expected = _block_grads(reference.backward, case, config, inputs)
    actual = _block_grads(backward, case, config, inputs, **options)
    for block, (a_grads, e_grads) in enumerate(zip(actual, expected, strict=True)):
        for name, a, e in zip(("dq", "dk", "dv"), a_grads, e_grads, strict=True):
            assert a.dtype == jnp.float32, (implementation, name, a.dtype)
            assert_close(a, e, kind="grad", name=f"{implementation} block {block} {name}")


def test_every_backend_has_a_block_backward():
    """Each backend module ring attention steps with has the protocol's forward and backward
    (with `grad_dtype`); one without (cudnn: no lse) is refused with NotImplementedError."""
    from shardfuse.collectives.ring_attention.api import RING_ATTENTION

    expected = inspect.signature(protocol.AttentionBackend.backward).parameters
    with pytest.raises(NotImplementedError, match="cudnn"):
        blocks.load("cudnn")
    for name in api.IMPLEMENTATIONS:
        if name not in RING_ATTENTION.names:
            continue
        if name == "triton":
            pytest.importorskip("triton")
        ops = blocks.load(name)
        assert ops.backward.__name__ == "backward", (name, ops.backward)
        params = inspect.signature(ops.backward).parameters
        assert list(params)[:12] == list(expected)[1:13], (name, list(params))
        assert "grad_dtype" in params, name
        assert list(inspect.signature(ops.forward).parameters)[:8] == list(expected)[1:9], name


# --- structure: no block forward in the backward ring -------------------------------------


def _count_forwards(jaxpr, implementation):
    """Block forwards in `jaxpr` (sub-jaxprs included): the pallas forward kernel's calls, or
    for xla the online softmax's running maximum (a float `reduce_max`; the backward
    recomputes `p` from lse and takes no maximum)."""
    count = 0
    for eqn in iter_eqns(jaxpr):
        name = eqn.primitive.name
        if implementation == "pallas_tpu" and name == "pallas_call":
            count += FORWARD_KERNEL in str(eqn.params.get("name"))
        elif implementation == "xla" and name == "reduce_max":
            count += jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
    return count


N = 4
L = 8  # per-shard length: tiny, TPU interpret mode under 4 devices stays small


def _ring_shard_map(implementation, n):
    """Per-shard causal ring attention in `jax.shard_map` over `n` CPU devices: `(out, lse)`."""
    spec = P(None, "sequence")

    def shard(q, k, v):
        return ring_attention(
            q, k, v, "sequence", layout="contiguous", causal=True, return_lse=True,
            implementation=implementation,
        )  # fmt: skip

    return jax.shard_map(
        shard,
        mesh=ring_mesh(n),
        in_specs=spec,
        out_specs=(spec, P(None, None, "sequence")),
        check_vma=False,
    )


def _block_forward_counts(implementation):
    """`(in the forward pass, in the backward pass)` of ring attention over N devices.

    Traced only, never run (TPU interpret mode under a multi-device ring can
    starve the CPU device threads): the backward's count is that of the jaxpr of
    forward + vjp minus that of the forward alone.
    """
    mapped = _ring_shard_map(implementation, N)
    q = jnp.zeros((1, N * L, 1, 64), jnp.float32)
    d_lse = jnp.zeros((1, 1, N * L), jnp.float32)

    def forward_backward(q, k, v, d_out, d_lse):
        _, vjp = jax.vjp(mapped, q, k, v)
        return vjp((d_out, d_lse))

    forward = _count_forwards(jax.make_jaxpr(mapped)(q, q, q), implementation)
    both = _count_forwards(jax.make_jaxpr(forward_backward)(q, q, q, q, d_lse), implementation)
    return forward, both - forward


@pytest.mark.parametrize("implementation", ["pallas_tpu", "xla"])
def test_backward_ring_runs_no_block_forward(implementation):
    forward, backward = _block_forward_counts(implementation)
    # The detector sees the forward ring's blocks (loop body and last step) ...
    assert forward > 0
    # ... and none in the backward ring: only backward kernels from the saved out / lse.
    assert backward == 0


def _fallback_load(name):
    """The pre-protocol block ops: backward as the VJP of the differentiable entry, which
    recomputes the block forward at every ring step."""
    ops = load_block_ops(name)
    attention = protocol.differentiable(ops.forward, ops.backward)

    def backward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse):
        def block(q, k, v):
            return attention(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)

        (out_b, lse_b), vjp = jax.vjp(block, q, k, v)
        lse_ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
        weight = jnp.where(jnp.isfinite(lse_b), jnp.exp(lse_b - lse_ref), 0.0)  # [B, H, T]
        d_out_b = jnp.swapaxes(weight, 1, 2)[..., None] * d_out
        shift = jnp.einsum("BTHD,BTHD->BHT", d_out, out_b - out)
        return vjp((d_out_b.astype(out_b.dtype), weight * (shift + d_lse)))

    return blocks.BlockOps(name, ops.forward, backward)


@pytest.mark.parametrize("implementation", ["pallas_tpu", "xla"])
def test_planted_fallback_is_caught(implementation, monkeypatch):
    """A block backward through the VJP of a block forward shows up in the count."""
    monkeypatch.setattr(blocks, "load", _fallback_load)
    forward, backward = _block_forward_counts(implementation)
    # One per traced step of the backward ring: first step, loop body, last step.
    assert backward >= 3 * forward // 2 > 0


def test_pallas_tpu_ring_matches_reference(monkeypatch):
    """Ring attention over 4 devices on pallas_tpu blocks: out, lse and gradients.

    The kernels run in Pallas' generic interpreter (`interpret=True`, plain JAX
    ops): TPU interpret mode runs each kernel in a host callback, which
    deadlocks against the ring's ppermute on CPU devices (a device thread waits
    in the collective while the callback needs the CPU client).
    """

    def load_interpreted(name):
        ops = load_block_ops(name)
        forward = functools.partial(ops.forward, interpret=True)
        return blocks.BlockOps(name, forward, functools.partial(ops.backward, interpret=True))

    monkeypatch.setattr(blocks, "load", load_interpreted)
    keys = jax.random.split(jax.random.key(2), 5)
    q, k, v = (jax.random.normal(keys[i], (1, N * L, 1, 64), jnp.float32) for i in range(3))
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[4], (1, 1, N * L), jnp.float32)
    ring = with_vjp(_ring_shard_map("pallas_tpu", N))
    actual = jax.block_until_ready(ring(q, k, v, d_out, d_lse))
    expected = oracle_fn(dict(causal=True))(q, k, v, d_out, d_lse)
    kinds = ("output", "output", "grad", "grad", "grad")
    names = ("out", "lse", "dq", "dk", "dv")
    for name, kind, a, e in zip(names, kinds, actual, expected, strict=True):
        assert_close(a, e, kind=kind, name=name)
