"""Ring layouts: exact round trips, the positions each device holds, and load balance."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.collectives.ring_attention import ring_balance

LAYOUTS = ("contiguous", "zigzag", "striped")


@pytest.mark.parametrize(
    "layout, n, axis",
    [*itertools.product(LAYOUTS, (1, 3, 8), (1,)), ("zigzag", 2, 0), ("striped", 4, -1)],
)
def test_round_trip_is_exact_and_matches_positions(layout, n, axis):
    length = 2 * n * 3
    shape = [2, length, 3]
    if axis == 0:
        shape = [length, 2, 3]
    elif axis == -1:
        shape = [2, 3, length]
    rng = np.random.default_rng(n)
    x = rng.standard_normal(shape).astype(np.float32)
    x[tuple(rng.integers(0, s) for s in shape)] = np.nan  # bitwise, NaN included
    x = jnp.asarray(x).astype(jnp.bfloat16)
    ring = sf.to_ring_layout(x, n, layout, axis=axis)
    back = sf.from_ring_layout(ring, n, layout, axis=axis)
    assert back.dtype == x.dtype and back.shape == x.shape
    assert np.array_equal(np.asarray(back).view(np.uint16), np.asarray(x).view(np.uint16))
    positions = np.asarray(sf.ring_positions(length, n, layout)).reshape(-1)
    np.testing.assert_array_equal(
        np.asarray(ring).view(np.uint16),
        np.take(np.asarray(x), positions, axis=axis).view(np.uint16),
    )


def test_positions_by_hand():
    np.testing.assert_array_equal(
        sf.ring_positions(8, 2, "contiguous"), [[0, 1, 2, 3], [4, 5, 6, 7]]
    )
    np.testing.assert_array_equal(sf.ring_positions(8, 2, "zigzag"), [[0, 1, 6, 7], [2, 3, 4, 5]])
    np.testing.assert_array_equal(sf.ring_positions(8, 2, "striped"), [[0, 2, 4, 6], [1, 3, 5, 7]])
    zigzag = np.asarray(sf.ring_positions(16, 4, "zigzag"))
    np.testing.assert_array_equal(zigzag[1], [2, 3, 12, 13])  # chunks 1 and 2N-2 = 6
    for layout in LAYOUTS:
        positions = np.asarray(sf.ring_positions(48, 4, layout))
        assert positions.dtype == np.int32 and positions.shape == (4, 12)
        assert sorted(positions.ravel().tolist()) == list(range(48))


def test_layout_errors():
    x = jnp.zeros((1, 12, 2))
    with pytest.raises(ValueError, match=r"multiple of 2 x ring_size = 8"):
        sf.to_ring_layout(x, 4, "zigzag")
    with pytest.raises(ValueError, match=r"multiple of ring_size = 5"):
        sf.from_ring_layout(x, 5, "striped")
    with pytest.raises(ValueError, match="layout='diagonal' is not one of"):
        sf.ring_positions(12, 2, "diagonal")
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        sf.to_ring_layout(x, 2, "striped", axis=3)
    with pytest.raises(ValueError, match="ring_size=0"):
        sf.ring_positions(12, 0, "contiguous")


def test_balance_at_n8():
    contiguous = ring_balance(8 * 512, 8, "contiguous")
    zigzag = ring_balance(8 * 512, 8, "zigzag")
    striped = ring_balance(8 * 512, 8, "striped")
    assert 1.8 <= contiguous.max_over_mean <= 1.95  # 2N / (N + 1) = 1.875 in the limit
    assert zigzag.max_over_mean <= 1.02
    assert striped.max_over_mean <= 1.02
    # Causal contiguous skips the steps whose keys all lie after the shard: device r computes r + 1.
    np.testing.assert_array_equal(contiguous.steps, np.arange(1, 9))
    np.testing.assert_array_equal(zigzag.steps, np.full(8, 8))
    # Every layout computes the same total: the causal triangle.
    total = 4096 * 4097 // 2
    for report in (contiguous, zigzag, striped):
        assert int(report.pairs.sum()) == total


def test_balance_with_window_counts_exactly():
    # Window (3, 0): every query sees min(p + 1, 4) keys.
    report = ring_balance(64, 4, "zigzag", window=(3, 0))
    expected = sum(min(p + 1, 4) for p in range(64))
    assert int(report.pairs.sum()) == expected
    brute = np.zeros(4, np.int64)
    positions = np.asarray(sf.ring_positions(64, 4, "zigzag"))
    for r in range(4):
        for p in positions[r]:
            brute[r] += sum(1 for j in range(64) if p - 3 <= j <= p)
    np.testing.assert_array_equal(report.pairs, brute)


@pytest.mark.parametrize(
    "causal, window", [(True, None), (False, (3, 1)), (True, (5, 0)), (False, (None, 0))]
)
def test_step_skip_is_sound_and_matches_the_balance_report(causal, window):
    """A ring step is skipped only if its block has no visible pair (never drops work)."""
    import jax

    from shardfuse.collectives.ring_attention import balance, ring
    from shardfuse.kernels.attention import base, masks

    config = base.AttentionConfig(causal=causal, window=window, logit_softcap=None, scale=1.0)
    n, length = 4, 64
    for layout in LAYOUTS:
        positions = np.asarray(sf.ring_positions(length, n, layout))
        q_pos = np.repeat(positions, n, axis=0)  # pair (r, s) at row r * n + s
        kv_pos = np.stack([positions[(r - s) % n] for r in range(n) for s in range(n)])
        visible = jax.jit(jax.vmap(lambda q, kv: ring.step_visible(config, q, kv, None, None)))(
            q_pos, kv_pos
        )
        for row, (qp, kp) in enumerate(zip(q_pos, kv_pos, strict=True)):
            mask = np.asarray(masks.visibility_mask(config, jnp.asarray(qp), jnp.asarray(kp)))
            if mask.any():
                assert visible[row], (layout, row)
            assert bool(visible[row]) == balance._step_computed(config, qp, kp), (layout, row)


@pytest.mark.parametrize("layout, n", [("zigzag", 2), ("zigzag", 8), ("striped", 4)])
def test_per_shard_relayout_equals_global_permutation(layout, n):
    """In shard_map: natural shards -> ring shards equals `to_ring_layout`; back is exact."""
    import jax
    from jax.sharding import PartitionSpec as P

    from shardfuse.collectives.ring_attention import relayout
    from tests.collectives.ring_attention.ring_cases import ring_mesh

    mesh = ring_mesh(n)
    local = 2 * n
    for axis, shape, spec in (
        (1, (2, n * local, 3), P(None, "sequence")),
        (2, (2, 3, n * local), P(None, None, "sequence")),  # an lse [B, H, T]
    ):
        x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)

        def mapped(fn, axis=axis, spec=spec):
            return jax.jit(
                jax.shard_map(
                    lambda shard: fn(shard, "sequence", n, layout, axis),
                    mesh=mesh,
                    in_specs=spec,
                    out_specs=spec,
                )
            )

        ring = mapped(relayout.to_ring)(x)
        np.testing.assert_array_equal(ring, sf.to_ring_layout(x, n, layout, axis=axis))
        np.testing.assert_array_equal(mapped(relayout.from_ring)(ring), x)
