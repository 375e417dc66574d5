"""The xla implementation (blockwise flash attention): what only it does.

Block skipping (the visible-tile table) and GQA without repeated K/V. Its
numerics (the TESTING.md matrix) are in test_attention_backends.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import base, xla


@pytest.mark.parametrize(
    "kwargs, expected_fraction",
    [
        (dict(causal=True), (16 * 17 / 2) / 256),
        (dict(causal=True, window=(128, 0)), None),
        (dict(causal=False), 1.0),
    ],
)
def test_masked_blocks_are_skipped(kwargs, expected_fraction):
    T = S = 1024
    config = base.validate(
        jnp.zeros((1, T, 1, 8)),
        jnp.zeros((1, S, 1, 8)),
        jnp.zeros((1, S, 1, 8)),
        q_positions=None,
        kv_positions=None,
        q_segment_ids=None,
        kv_segment_ids=None,
        logit_softcap=None,
        scale=None,
        block_sizes=sf.BlockSizes(64, 64),
        **{"window": None, **kwargs},
    )
    q_pos, kv_pos = base.default_positions(T, S)
    q = jnp.zeros((1, T, 1, 8))
    tiles = xla._Tiles(config, q, q, q, q_pos, kv_pos, None, None)
    fraction = float(jnp.mean(tiles.visible))
    if expected_fraction is None:  # window 128 at block 64: diagonal + 2 blocks back
        expected_fraction = (16 + 15 + 14) / 256
    assert fraction == pytest.approx(expected_fraction)


def test_block_skipping_with_segments_and_padding():
    # Block 16 on length 40: the last block is half padding. Segment ranges
    # 0 | 1 per half make the off-diagonal blocks invisible.
    q = jnp.zeros((1, 40, 1, 8))
    seg = (jnp.arange(40) >= 16).astype(jnp.int32)[None]
    config = base.validate(
        q,
        q,
        q,
        causal=False,
        q_positions=None,
        kv_positions=None,
        q_segment_ids=seg,
        kv_segment_ids=seg,
        window=None,
        logit_softcap=None,
        scale=None,
        block_sizes=sf.BlockSizes(16, 16),
    )
    q_pos, kv_pos = base.default_positions(40, 40)
    tiles = xla._Tiles(config, q, q, q, q_pos, kv_pos, seg, seg)
    np.testing.assert_array_equal(np.asarray(tiles.visible), [[1, 0, 0], [0, 1, 1], [0, 1, 1]])


def _all_avals(jaxpr):
    """Every intermediate's aval in a jaxpr, sub-jaxprs (loops, conds, custom_vjp) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_avals(inner)


def test_gqa_never_repeats_kv():
    # H = 8 query heads on K = 1 kv head, S = 64, D = 24: a repeated K or V (or
    # its gradient) would be some intermediate with 8, 64 and 24 in its shape.
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 16, 8, 24))
    k, v = (jax.random.normal(key, (1, 64, 1, 24)) for key in keys[1:])
    loss = lambda q, k, v: sf.flash_attention(q, k, v, implementation="xla").sum()
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    shapes = [tuple(getattr(aval, "shape", ())) for aval in _all_avals(jaxpr.jaxpr)]
    assert any(64 in s and 24 in s for s in shapes)  # K/V tiles are there...
    repeated = [s for s in shapes if {8, 64, 24} <= set(s)]
    assert not repeated, repeated  # ... but never with the 8 query heads
