"""pallas_tpu grouped matmul: exported for TPU (Mosaic) without one, and its tile schedule.

`jax.export(..., platforms=["tpu"])` runs the Pallas -> Mosaic lowering on this CPU host
(block shapes, the tiling rule, the scalar-prefetched index maps, the ops the kernels use),
so a Mosaic mistake fails here rather than on a TPU. The kernels' numerics run in TPU
interpret mode in test_grouped_matmul_backends.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import shardfuse as sf
from shardfuse.kernels.grouped_matmul import tiles
from shardfuse.kernels.pallas_interpret import interpret_mode
from tests.kernels.grouped_matmul.grouped_cases import zipf_sizes


@pytest.mark.parametrize(
    "dtype, transpose, offset", [("float32", False, False), ("bfloat16", True, True)]
)
def test_exports_for_tpu_forward_and_backward(dtype, transpose, offset):
    M, K, N, G = 1000, 384, 640, 8  # M, K and N not multiples of the default tiles
    rhs_shape = (G, N, K) if transpose else (G, K, N)

    def step(lhs, rhs, sizes, d_out):
        def f(lhs, rhs):
            return sf.grouped_matmul(
                lhs,
                rhs,
                sizes,
                group_offset=jnp.int32(2) if offset else None,
                transpose_rhs=transpose,
                implementation="pallas_tpu",
            )

        out, pullback = jax.vjp(f, lhs, rhs)
        return out, pullback(d_out)

    args = (
        jax.ShapeDtypeStruct((M, K), dtype),
        jax.ShapeDtypeStruct(rhs_shape, dtype),
        jax.ShapeDtypeStruct((G + 2 if offset else G,), jnp.int32),
        jax.ShapeDtypeStruct((M, N), dtype),
    )
    with interpret_mode(False):
        exported = export.export(jax.jit(step), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert exported.platforms == ("tpu",)
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 3  # out, d_lhs, d_rhs
    assert "shardfuse_grouped_matmul_transposed" in text
    assert "shardfuse_grouped_matmul" in text


def _brute_force(sizes, start, M, block_m, forward):
    """The visits by enumeration: every (tile, segment) pair that shares a row, in row order."""
    ends = start + np.cumsum(sizes)
    segments = [(j, ends[j] - sizes[j], ends[j]) for j in range(len(sizes))]
    if forward:
        segments = [(-1, 0, start), *segments, (-1, ends[-1], M)]
    out = []
    for group, begin, end in segments:
        if end > begin:
            out += [(t, group, begin, end) for t in range(begin // block_m, -(-end // block_m))]
        elif not forward:  # an empty group still visits once, to write its zeros
            out.append((min(begin // block_m, -(-M // block_m) - 1), group, begin, end))
    return out


@pytest.mark.parametrize(
    "sizes, start, M, block_m",
    [
        ((3, 0, 6), 0, 12, 4),
        ((16, 16), 0, 32, 16),
        ((0, 0, 0), 5, 9, 4),
        ((1,) * 9, 2, 16, 4),
        (zipf_sizes(64, 300), 7, 320, 16),
        ((0, 20, 0), 0, 20, 8),
    ],
)
@pytest.mark.parametrize("forward", [True, False])
def test_visits_cover_each_row_once_with_one_partial_tile_per_boundary(
    sizes, start, M, block_m, forward
):
    visits = tiles.visits(
        jnp.array(sizes, jnp.int32), jnp.int32(start), M, block_m, forward=forward
    )
    V = tiles.max_visits(M, len(sizes), block_m, forward=forward)
    assert visits.tile.shape == (V,)
    valid = np.asarray(visits.valid).astype(bool)
    got = list(zip(*(np.asarray(x)[valid].tolist() for x in visits[:4]), strict=True))
    assert got == _brute_force(np.array(sizes), start, M, block_m, forward)
    key = np.asarray(visits.tile if forward else visits.group)[valid]
    first = [i == 0 or key[i] != key[i - 1] for i in range(len(key))]
    last = [i == len(key) - 1 or key[i] != key[i + 1] for i in range(len(key))]
    assert np.asarray(visits.first)[valid].astype(bool).tolist() == first
    assert np.asarray(visits.last)[valid].astype(bool).tolist() == last
    assert not np.asarray(visits.first)[~valid].any() and not np.asarray(visits.last)[~valid].any()
    if forward:  # every row written by exactly one visit
        rows = np.zeros(M, int)
        for tile, _, begin, end in got:
            lo, hi = max(tile * block_m, begin), min((tile + 1) * block_m, end)
            rows[lo:hi] += 1
        assert (rows == 1).all()
        # padding visits repeat the last tile and write nothing
        assert (np.asarray(visits.tile)[~valid] == got[-1][0]).all()
        assert (np.asarray(visits.group)[~valid] == -1).all()


def test_visit_count_bound_is_reached():
    """tiles_m + G + 1 visits when every segment boundary falls inside a tile: the static
    length is exactly enough."""
    sizes = jnp.array([4, 4, 4, 4], jnp.int32)  # rows 1-16: boundaries 1, 5, 9, 13, 17
    visits = tiles.visits(sizes, jnp.int32(1), 20, 4, forward=True)
    assert int(visits.valid.sum()) == tiles.max_visits(20, 4, 4, forward=True) == 10
