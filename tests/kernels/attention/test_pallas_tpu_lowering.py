"""pallas_tpu attention: every tested configuration lowers for TPU (Mosaic), and it
agrees with JAX's own `jax.experimental.pallas.ops.tpu.flash_attention`.

Lowering runs on this CPU host with `lower(lowering_platforms=("tpu",))`: the
Pallas -> Mosaic lowering checks block shapes, the tiling rule and the ops the
kernels use, so a Mosaic mistake fails here rather than on a TPU.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode
from shardfuse.testing import assert_close
from tests.kernels.attention.attention_backends import PALLAS_TPU, STRICT
from tests.kernels.attention.attention_cases import CASE, make_inputs

# Interpret mode can hang rather than fail (see attention_backends.run): cap each test.
pytestmark = pytest.mark.timeout(300)

KERNEL_NAMES = (
    "shardfuse_flash_attention_fwd",
    "shardfuse_flash_attention_bwd_dq",
    "shardfuse_flash_attention_bwd_dkv",
)


@pytest.mark.parametrize("name", [*PALLAS_TPU.default, *PALLAS_TPU.slow])
def test_lowers_for_tpu_forward_and_backward(name):
    """Every case of the pallas_tpu budget in test_attention_backends.py."""
    case = CASE[name]
    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((case.B, case.T, case.H, case.D), dtype)
    kv = jax.ShapeDtypeStruct((case.B, case.S, case.K, case.D), dtype)
    inputs = make_inputs(case)
    block_sizes = None if case.block is None else sf.BlockSizes(*case.block)

    def attention(q, k, v):
        return sf.flash_attention(
            q,
            k,
            v,
            q_positions=inputs.q_pos,
            kv_positions=inputs.kv_pos,
            q_segment_ids=inputs.q_seg,
            kv_segment_ids=inputs.kv_seg,
            implementation="pallas_tpu",
            return_lse=True,
            block_sizes=block_sizes,
            **case.options(),
        )

    def forward_and_backward(q, k, v):
        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return vjp((out, lse))

    with interpret_mode(False):
        for fn, kernels in ((attention, 1), (forward_and_backward, 3)):
            text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
            assert text.count("stablehlo.custom_call @tpu_custom_call") == kernels
            assert text.count("cost_estimate") == kernels
            for kernel_name in KERNEL_NAMES[:kernels]:
                assert kernel_name in text


@pytest.mark.slow
def test_matches_jax_pallas_tpu_flash_attention():
    """Same results as JAX's TPU flash attention (interpret mode) where both apply:
    MHA, T == S block multiples, causal with segment ids, float32."""
    B, T, H, D = 1, 256, 1, 128
    keys = jax.random.split(jax.random.key(7), 4)
    q, k, v, d_out = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys)
    segments = (jnp.arange(T)[None] * 3 // T).astype(jnp.int32)  # three packed sequences
    scale = 0.125
    blocks = jax_flash.BlockSizes(
        block_q=128,
        block_k_major=128,
        block_k=128,
        block_b=1,
        block_q_major_dkv=128,
        block_k_major_dkv=128,
        block_k_dkv=128,
        block_q_dkv=128,
        block_k_major_dq=128,
        block_k_dq=128,
        block_q_dq=128,
    )

    def theirs(q, k, v):  # [B, H, T, D] layout
        out = jax_flash.flash_attention(
            q.transpose(0, 2, 1, 3),
            k.transpose(0, 2, 1, 3),
            v.transpose(0, 2, 1, 3),
            segment_ids=jax_flash.SegmentIds(segments, segments),
            causal=True,
            sm_scale=scale,
            block_sizes=blocks,
        )
        return out.transpose(0, 2, 1, 3)

    def ours(q, k, v):
        return sf.flash_attention(
            q,
            k,
            v,
            causal=True,
            q_segment_ids=segments,
            kv_segment_ids=segments,
            scale=scale,
            block_sizes=sf.BlockSizes(128, 128),
            implementation="pallas_tpu",
        )

    def with_grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, *vjp(d_out)

    with pltpu.force_tpu_interpret_mode(STRICT), interpret_mode(STRICT):
        # Blocking after each: see attention_backends.run (interpreter deadlock).
        expected = jax.block_until_ready(jax.jit(lambda: with_grads(theirs))())
        actual = jax.block_until_ready(jax.jit(lambda: with_grads(ours))())
    for label, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        assert_close(a, e, kind="output" if label == "out" else "grad", name=label)
