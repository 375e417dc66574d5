"""`sf.decode_attention` on global arrays sharded over a mesh, Explicit and Auto axis types.

The oracle is the same call on one device. Each case is a layout users give a KV cache
(batch over data, heads over model; the cache's length S over model; everything over
both axes; query heads split while the kv heads are replicated), run eagerly and under
jit. On an Explicit mesh the results are typed as q is (out `[B, T, H, D]`, lse
`[B, H, T]`); on an Auto mesh XLA places them like q in every case here. A cache split
over S on an Explicit mesh used to raise a ShardingTypeError from the backend's einsum.
"""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf

B, T, H, K, D, S = 8, 2, 8, 4, 16, 48
LAYOUTS = {  # q, k and v, lengths
    "batch_data_heads_model": (P("data", None, "model"), P("data", None, "model"), P("data")),
    "cache_length_model": (P(), P(None, "model"), P()),
    "batch_everywhere": (P(("data", "model")), P(("data", "model")), P(("data", "model"))),
    "kv_replicated": (P(None, None, "model"), P(), P()),
}
QUICK = {("cache_length_model", AxisType.Explicit), ("batch_data_heads_model", AxisType.Auto)}


def _inputs():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, D), np.float32)
    k, v = (rng.standard_normal((B, S, K, D), np.float32) for _ in range(2))
    lengths = np.array([48, 5, 17, 1, 0, 33, 2, 40], np.int32)
    return q, k, v, lengths


def _call(q, k, v, lengths):
    return sf.decode_attention(q, k, v, lengths, window=(20, 0), return_lse=True)


CASES = [(n, a) for n in LAYOUTS for a in (AxisType.Explicit, AxisType.Auto)]


@pytest.mark.parametrize(
    "layout, axis_type",
    [pytest.param(n, a, marks=() if (n, a) in QUICK else pytest.mark.slow) for n, a in CASES],
    ids=[f"{n}-{a.name}" for n, a in CASES],
)
def test_sharded_inputs_give_the_one_device_result(layout, axis_type):
    q, k, v, lengths = _inputs()
    want_out, want_lse = _call(*(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, lengths)))
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    q_spec, kv_spec, lengths_spec = LAYOUTS[layout]
    args = [
        jax.device_put(x, NamedSharding(mesh, spec))
        for x, spec in zip(
            (q, k, v, lengths), (q_spec, kv_spec, kv_spec, lengths_spec), strict=True
        )
    ]
    qb, qt, qh, qd = (*q_spec, None, None, None, None)[:4]
    want_shardings = (NamedSharding(mesh, P(qb, qt, qh, qd)), NamedSharding(mesh, P(qb, qh, qt)))
    for mode, fn in (("eager", _call), ("jit", jax.jit(_call))):
        out, lse = fn(*args)
        assert np.isfinite(np.asarray(out)).all(), mode
        # float32 sums over a sharded S merge in another order: a few ulps
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-6, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-6, rtol=1e-6)
        for got, want in zip((out, lse), want_shardings, strict=True):
            assert got.sharding.is_equivalent_to(want, got.ndim), (mode, got.sharding, want)
            if axis_type == AxisType.Explicit:  # the type carries it too
                assert jax.typeof(got).sharding.spec == want.spec, (mode, jax.typeof(got))
