"""Ulysses and USP: which collectives they issue (jaxpr and compiled HLO), and bad input.

Ulysses, forward + backward: exactly 10 all-to-alls (q, k, v in and out, lse
back; their transposes in the backward), no all-gather of K/V (segment ids,
int32 `[B, L]`, are the only thing gathered), no ppermute. USP: the same 10
all-to-alls over the Ulysses axis only; K/V travel over the ring axis by
ppermute; nothing is all-gathered.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from tests.collectives.ring_attention.test_ring_structure import collectives_in
from tests.jaxprs import sub_jaxprs

pytestmark = pytest.mark.timeout(300)


def _axes_of(jaxpr, primitive):
    """The `axis_name` of every `primitive` equation, in the jaxpr and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            axes = eqn.params.get("axis_name", eqn.params.get("axes"))
            found.append(tuple(axes) if isinstance(axes, (tuple, list)) else (axes,))
        for sub in sub_jaxprs(eqn):
            found += _axes_of(sub, primitive)
    return found


def _jaxpr(mesh, axis, strategy, *, B=1, T=32, H=4, K=2, D=8, segments=False, layout="zigzag"):
    q = jnp.zeros((B, T, H, D), jnp.bfloat16)
    k = jnp.zeros((B, T, K, D), jnp.bfloat16)
    segs = dict(q_segment_ids=jnp.zeros((B, T), jnp.int32)) if segments else {}
    if segments:
        segs["kv_segment_ids"] = segs["q_segment_ids"]

    def forward_backward(q, k, v, d_out, d_lse):
        def attend(q, k, v):
            return sf.ring_attention(
                q, k, v, mesh=mesh, sequence_axis=axis, strategy=strategy, layout=layout,
                causal=True, return_lse=True, **segs,
            )  # fmt: skip

        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp((d_out, d_lse))

    d_lse = jnp.zeros((B, H, T), jnp.float32)
    return jax.make_jaxpr(forward_backward)(q, k, k, q, d_lse).jaxpr


def _ring_mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("sequence",))


def _usp_mesh(ulysses, ring):
    return Mesh(np.array(jax.devices()[: ulysses * ring]).reshape(ring, ulysses), ("ring", "u"))


@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("n, kv", [(4, 2), (2, 2)])  # kv heads repeated to 4 / scattered
def test_ulysses_collectives(n, kv, segments):
    B, T, H, D = 1, 32, 4, 8
    jaxpr = _jaxpr(_ring_mesh(n), "sequence", "ulysses", K=kv, segments=segments)
    found = collectives_in(jaxpr)
    a2a = [ops for name, ops in found if name == "all_to_all"]
    assert len(a2a) == 10, found
    gathered = [ops for name, ops in found if "all_gather" in name]
    assert gathered == ([[((B, T // n), "int32")]] * 2 if segments else []), found
    assert {name for name, _ in found} <= {"all_to_all", "all_gather"}, found
    # What travels: this device's q / out shard, its k / v shard with lcm(K, n) heads, lse.
    k_heads = np.lcm(kv, n)
    allowed = {
        ((B, T // n, H, D), "bfloat16"),  # q; d_out
        ((B, T // n, k_heads, D), "bfloat16"),  # k, v
        ((B, T, H // n, D), "bfloat16"),  # out; dq
        ((B, T, k_heads // n, D), "bfloat16"),  # dk, dv (in k's dtype)
        ((B, H // n, T), "float32"),  # lse
        ((B, H, T // n), "float32"),  # d_lse
    }
    assert {op for ops in a2a for op in ops} <= allowed, a2a
    assert set(_axes_of(jaxpr, "all_to_all")) == {("sequence",)}


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_usp_collectives(layout):
    jaxpr = _jaxpr(_usp_mesh(2, 4), ("u", "ring"), "ulysses_ring", layout=layout)
    found = collectives_in(jaxpr)
    names = [name for name, _ in found]
    assert names.count("all_to_all") == 10, found
    assert not any("all_gather" in name for name in names), found
    assert set(_axes_of(jaxpr, "all_to_all")) == {("u",)}
    ppermute_axes = set(_axes_of(jaxpr, "ppermute"))
    # K/V (and dK/dV) around the ring; zigzag also moves the natural shards into ring order.
    expected = {("ring",), ("ring", "u")} if layout == "zigzag" else {("ring",)}
    assert ppermute_axes == expected, ppermute_axes


def test_ulysses_hlo_has_no_all_gather():
    """The compiled program: all-to-alls only; nothing all-gathered, no collective-permute."""
    mesh = _ring_mesh(4)
    q = jax.device_put(jnp.zeros((1, 32, 4, 8)), NamedSharding(mesh, P(None, "sequence")))
    k = jax.device_put(jnp.zeros((1, 32, 4, 8)), NamedSharding(mesh, P(None, "sequence")))
    attend = jax.jit(
        lambda q, k, v: sf.ring_attention(q, k, v, mesh=mesh, strategy="ulysses", causal=True)
    )
    hlo = attend.lower(q, k, k).compile().as_text()
    assert "all-to-all" in hlo
    assert "all-gather" not in hlo and "collective-permute" not in hlo


def _inputs(T=16, H=4, K=2):
    q = jnp.zeros((1, T, H, 8))
    k = jnp.zeros((1, T, K, 8))
    return q, k, k


@pytest.mark.parametrize(
    "mesh_shape, axis, strategy, kwargs, error, match",
    [
        ((8,), "sequence", "ulysses", {}, ValueError,
         r"num heads H=4 must be a multiple of the Ulysses axis 'sequence' size 8"),
        ((2, 4), ("u", "ring"), "ulysses_ring", dict(layout="striped"), ValueError,
         r"layout='striped' is not supported with strategy='ulysses_ring'"),
        ((8,), "sequence", "ulysses_ring", {}, ValueError,
         r"strategy='ulysses_ring' needs sequence_axis=\(ulysses_axis, ring_axis\)"),
        ((2, 4), ("u", "ring"), "ring", {}, ValueError,
         r"sequence_axis=\('u', 'ring'\) \(two axes\) runs strategy='ulysses_ring'"),
        ((8,), "sequence", "deepspeed", {}, ValueError,
         r"strategy='deepspeed' is not one of \['ring', 'all_gather', 'ulysses', "
         r"'ulysses_ring'\] or None"),
        ((2, 4), ("u", "ring", "x"), "ulysses_ring", {}, TypeError,
         r"sequence_axis=\('u', 'ring', 'x'\) must be one mesh axis name"),
        ((2, 4), ("u", "context"), "ulysses_ring", {}, ValueError,
         r"sequence_axis=\('u', 'context'\): axis 'context' is not in the mesh"),
        ((2, 4), ("u", "u"), "ulysses_ring", {}, ValueError, r"both use mesh axis 'u'"),
    ],
)  # fmt: skip
def test_bad_input(mesh_shape, axis, strategy, kwargs, error, match):
    names = ("sequence",) if len(mesh_shape) == 1 else ("ring", "u")
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(mesh_shape))]).reshape(mesh_shape), names)
    with pytest.raises(error, match=match):
        sf.ring_attention(*_inputs(), mesh=mesh, sequence_axis=axis, strategy=strategy, **kwargs)
    with pytest.raises(error, match=match):  # under jit too, before anything is traced
        jax.jit(
            lambda q, k, v: sf.ring_attention(
                q, k, v, mesh=mesh, sequence_axis=axis, strategy=strategy, **kwargs
            )
        )(*_inputs())


def test_heads_per_model_shard_must_divide():
    """With a model axis, the heads per model shard (8 / 2 = 4) must divide by the Ulysses axis."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("model", "sequence"))
    q, k, v = _inputs(H=4, K=2)
    with pytest.raises(ValueError, match=r"num heads H=4 / 2 \(\('model',\)\) must be a multiple"):
        sf.ring_attention(q, k, v, mesh=mesh, strategy="ulysses", model_axis="model")
