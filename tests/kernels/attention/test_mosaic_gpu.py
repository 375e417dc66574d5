"""The Mosaic GPU attention backend beyond the shared body: lowering for sm_90 from this CPU,
refusals, and its place in dispatch.

The shared body (`test_attention_backends.py`) runs the kernels in Mosaic GPU
interpret mode on CPU (`mosaic_gpu_interpret`, jax >= 0.11) and compiled on a
GPU (`mosaic_gpu`, marked gpu). Here: every kernel (forward, dK/dV, dQ, and the
split dK / dV launches of head dim 256) lowers to Mosaic GPU for sm_90 on any
host, with every mask, on the oldest and newest supported JAX: what the
Pallas-to-Mosaic lowering checks (layouts, tile shapes, TMA and swizzle
constraints, shared-memory budget) holds without a GPU. What only a GPU
checks (ptxas, register allocation, the kernels running) is `pytest -m gpu`.
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import mosaic_gpu

LOWERING_CASES = [
    # (D, T, S, H, K, options)
    (64, 256, 256, 4, 2, dict(causal=True)),
    (128, 200, 333, 2, 1, dict(window=(64, 16), logit_softcap=20.0)),
    (128, 128, 128, 2, 2, dict(causal=True, segments=True)),
    (256, 130, 130, 2, 1, dict(causal=True)),
    (96, 64, 64, 2, 2, dict()),
]


def _inputs(D, T, S, H, K, options, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((2, T, H, D), dtype)
    kv = jax.ShapeDtypeStruct((2, S, K, D), dtype)
    options = dict(options)
    segments = options.pop("segments", False)
    if segments:
        options["q_segment_ids"] = jnp.zeros((2, T), jnp.int32)
        options["kv_segment_ids"] = jnp.zeros((2, S), jnp.int32)
    return q, kv, options


def _fwd_bwd(options):
    def step(q, k, v):
        out, vjp = jax.vjp(
            lambda q, k, v: sf.flash_attention(q, k, v, implementation="mosaic_gpu", **options),
            q,
            k,
            v,
        )
        return out, vjp(out)

    return step


@pytest.mark.parametrize("D, T, S, H, K, options", LOWERING_CASES, ids=str)
def test_lowers_for_sm90_from_any_host(D, T, S, H, K, options):
    """Forward and backward lower to Mosaic GPU custom calls (no GPU needed)."""
    q, kv, options = _inputs(D, T, S, H, K, options)
    with mosaic_gpu.interpret_mode(False):
        lowered = jax.jit(_fwd_bwd(options)).trace(q, kv, kv).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    kernels = text.count("mosaic_gpu")
    # forward, dK/dV (two launches at head dim 256), dQ
    assert kernels >= (4 if D > 128 else 3), text[:2000]


def test_refuses_float32_large_head_dims_and_tiles_it_cannot_run():
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
        sf.flash_attention(q, q, q, implementation="mosaic_gpu")
    big = jnp.zeros((1, 64, 2, 320), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="head dims up to 256"):
        sf.flash_attention(big, big, big, implementation="mosaic_gpu")
    small = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
    with mosaic_gpu.interpret_mode(False), pytest.raises(NotImplementedError, match="block_q"):
        sf.flash_attention(
            small, small, small, implementation="mosaic_gpu", block_sizes=sf.BlockSizes(32, 64)
        )
    with mosaic_gpu.interpret_mode(False), pytest.raises(NotImplementedError, match="block_kv"):
        sf.flash_attention(
            small, small, small, implementation="mosaic_gpu", block_sizes=sf.BlockSizes(64, 256)
        )


def test_default_on_cpu_never_picks_it():
    """CPU's default stays native_cpu / xla: the interpreter is for tests, not for users."""
    assert "mosaic_gpu" not in sf.kernels.registry.get("attention").candidates(None)


def test_tiles_fit_registers_and_shared_memory():
    """Each head dim's tiles: 64-row consumer tiles, shared memory within 227 KiB per CTA,
    wgmma contractions in multiples of 64, float32 accumulators within 232 registers."""
    budget = 227 * 1024
    for D, tiles in mosaic_gpu.TILES.items():
        n = tiles.backward_consumers
        # 16-bit tiles: a consumer's own rows (two tensors) and the ring (two tensors)
        forward = 2 * (2 * tiles.block_q * D + 2 * tiles.stages * tiles.block_kv * D)
        dkdv = 2 * (
            2 * n * tiles.dkdv_block_kv * D + 2 * tiles.backward_stages * tiles.dkdv_block_q * D
        )
        dq = 2 * (2 * n * tiles.dq_block_q * D + 2 * tiles.backward_stages * tiles.dq_block_kv * D)
        assert max(forward, dkdv, dq) <= budget, (D, forward, dkdv, dq)
        for contraction in (tiles.block_kv, tiles.dq_block_kv, tiles.dkdv_block_q):
            assert contraction % 64 == 0, (D, tiles)
        assert tiles.block_q == tiles.dq_block_q == 64

        # float32 registers per thread of a 128-thread consumer: accumulators + two score tiles
        def registers(accumulators, rows, cols, D=D):
            return accumulators * rows * D // 128 + 2 * rows * cols // 128

        dkdv_accumulators = 1 if tiles.split_dkdv else 2
        assert registers(dkdv_accumulators, tiles.dkdv_block_kv, tiles.dkdv_block_q) <= 200
        assert registers(1, tiles.dq_block_q, tiles.dq_block_kv) <= 200, (D, tiles)
        assert registers(1, tiles.block_q, tiles.block_kv) <= 200, (D, tiles)


def test_float32_gradients_lower_for_ring_steps():
    """Ring attention asks its blocks for float32 gradients of bfloat16 inputs: the results
    leave the registers without a bfloat16 staging tile."""
    config = sf.kernels.attention.base.AttentionConfig(
        causal=True, window=None, logit_softcap=None, scale=0.125
    )
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((1, 2, 128), jnp.float32)
    pos = jax.ShapeDtypeStruct((128,), jnp.int32)

    def backward(q, k, v, q_pos, kv_pos, out, lse, d_out, d_lse):
        return mosaic_gpu.backward(
            config, q, k, v, q_pos, kv_pos, None, None, out, lse, d_out, d_lse,
            grad_dtype=jnp.float32,
        )  # fmt: skip

    with mosaic_gpu.interpret_mode(False):
        lowered = jax.jit(backward).trace(q, q, q, pos, pos, q, stats, q, stats)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 2
    assert all(str(x.dtype) == "float32" for x in lowered.out_info)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case_name", ["causal_mqa", "gqa_window_softcap_segments"])
def test_ring_step_backward_from_the_global_lse(case_name):
    """As a ring step: each key block's share of the gradients from the GLOBAL out and lse
    (bfloat16 inputs, float32 gradients as the ring accumulates them), against the
    reference's block backward (interpret mode: a ring itself needs several devices, and
    the interpreter's threads starve on this 2-core machine under shard_map)."""
    from shardfuse import _compat
    from shardfuse.kernels.attention import reference
    from shardfuse.testing import assert_close_low_precision
    from tests.collectives.ring_attention import test_ring_block_backward as ring

    try:
        params = _compat.mosaic_gpu_interpret_params()
    except NotImplementedError as e:
        pytest.skip(str(e))
    case = next(c for c in ring.CASES if c.name == case_name)
    config = ring._config(case)
    q, k, v, *rest = ring._inputs(case, seed=1)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with mosaic_gpu.interpret_mode(params):
        got = ring._block_grads(mosaic_gpu.backward, case, config, (*low, *rest))
    ref_lp = ring._block_grads(reference.backward, case, config, (*low, *rest))
    ref32 = ring._block_grads(
        reference.backward, case, config, (*(x.astype(jnp.float32) for x in low), *rest)
    )
    for block in range(2):
        grads = zip(("dq", "dk", "dv"), got[block], ref32[block], ref_lp[block], strict=True)
        for name, a, r32, rlp in grads:
            assert a.dtype == jnp.float32, (name, a.dtype)
            assert_close_low_precision(a, r32, rlp, kind="grad", name=f"block {block} {name}")
