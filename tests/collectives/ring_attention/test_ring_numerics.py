"""Ring attention vs the reference on the gathered sequence: forward, lse, gradients.

The default cases cover every ring size (1, 2, 4, 8), every layout, causal and
not, GQA and MQA, segment ids, window, softcap, float32 and bfloat16, padding
(lengths not divisible by the ring), T != S both ways, both strategies, the
reference's naive block backward (implementation="reference") and batch / heads sharded
over other mesh axes. The full cross product runs with `-m slow`.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.collectives.ring_attention.api import ring_attention as ring_attention_shard
from shardfuse.kernels.attention import native_cpu
from shardfuse.testing import assert_close
from tests.collectives.ring_attention.ring_cases import (
    RingCase,
    check_ring,
    make_inputs,
    oracle_fn,
    ring_fn,
    ring_mesh,
    with_vjp,
)
from tests.pairwise import pairwise

pytestmark = pytest.mark.timeout(300)

C = RingCase
NEEDS_NATIVE = pytest.mark.skipif(not native_cpu.status("cpu")[0], reason="native_cpu not built")
FAST_CASES = [
    C(N=1, layout="contiguous", causal=True),
    C(N=4, layout="striped", softcap=20.0),
    C(N=4, layout="contiguous", causal=False, window=(5, 3), H=8, K=2),
    C(N=8, layout="zigzag", H=8, K=2),
    C(N=8, layout="striped", causal=False, segments=True, K=1),
    # Padding: lengths not divisible by the ring (2N for zigzag); T != S both ways.
    C(N=4, layout="zigzag", T=29, S=13),  # T > S: rows with no visible key; pad hidden by causality
    # Low precision: the 2x (outputs) / 3x (gradients) rule.
    C(N=4, layout="zigzag", dtype="bfloat16", H=8, K=2),
    # all_gather strategy; the reference block backward; batch and heads on other mesh axes.
    C(N=4, layout="zigzag", strategy="all_gather", T=30, S=30),
    C(N=4, layout="zigzag", implementation="reference", segments=True),
    C(N=2, layout="zigzag", B=2, H=4, K=2, mesh="3d"),
]
# Covered in spirit by the fast cases; run with -m slow.
MORE_CASES = [
    C(N=2, layout="striped", T=13, S=27, causal=False, segments=True),  # pad masked by segment id
    C(N=2, layout="zigzag", B=2, H=4, K=1, mesh="3d", causal=False, segments=True, T=20, S=20),
    C(N=2, layout="zigzag", K=1, segments=True),
    C(N=8, layout="contiguous", window=(9, 0)),
    C(N=4, layout="zigzag", T=30, S=30, causal=False),
    C(N=2, layout="striped", causal=False, softcap=10.0, dtype="bfloat16"),
    C(N=2, layout="contiguous", B=2, H=4, K=1, mesh="3d", causal=False, T=20, S=20),
]


@pytest.mark.parametrize("case", FAST_CASES, ids=lambda c: c.id)
def test_ring_matches_reference(case):
    check_ring(case)


SLOW_CASES = (
    MORE_CASES
    + [
        C(N=n, layout=layout, causal=causal, H=4, K=k)
        for n, layout, causal, k in pairwise(
            (1, 2, 4, 8), ("contiguous", "zigzag", "striped"), (True, False), (2, 1)
        )
    ]
    + [
        C(N=n, layout=layout, dtype="bfloat16", segments=True, window=(7, None))
        for n, layout in itertools.product((2, 8), ("contiguous", "zigzag", "striped"))
    ]
)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=lambda c: c.id)
def test_ring_matches_reference_full_matrix(case):
    check_ring(case)


def test_ring_is_deterministic():
    case = C(N=4, layout="zigzag", T=32, S=32)
    q, k, v, kwargs, cotangents = make_inputs(case, seed=3)
    ring = ring_fn(case, kwargs)
    first, second = ring(q, k, v, *cotangents), ring(q, k, v, *cotangents)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{name} differs between runs"


def test_nan_in_masked_keys_never_reaches_outputs():
    """Keys of a segment no query has carry NaN; outputs and gradients stay finite."""
    case = C(N=4, layout="zigzag", causal=True)
    q, k, v, _, cotangents = make_inputs(case)
    q_seg = jnp.zeros((1, 32), jnp.int32)
    kv_seg = jnp.zeros((1, 32), jnp.int32).at[:, 8:12].set(7)  # nobody attends to id 7
    k = k.at[:, 8:12].set(jnp.nan)
    v = v.at[:, 8:12].set(jnp.nan)
    kwargs = dict(causal=True, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    out, lse, dq, dk, dv = ring_fn(case, kwargs)(q, k, v, *cotangents)
    ref = oracle_fn(kwargs)(q, k, v, *cotangents)
    for name, a, e in zip(("out", "lse", "dq"), (out, lse, dq), ref, strict=False):
        assert_close(a, e, kind="grad", name=name)
    visible = np.ones(32, bool)
    visible[8:12] = False
    for name, a, e in (("dk", dk, ref[3]), ("dv", dv, ref[4])):
        assert_close(a[:, visible], e[:, visible], kind="grad", name=name)


def _per_shard(n, layout, check_vma, implementation, **kwargs):
    mesh = ring_mesh(n)
    spec = P(None, "sequence")

    def shard(q, k, v):
        return ring_attention_shard(
            q, k, v, "sequence", layout=layout, return_lse=True, implementation=implementation,
            **kwargs,
        )  # fmt: skip

    mapped = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=spec,
        out_specs=(spec, P(None, None, "sequence")),
        check_vma=check_vma,
    )

    def attend(q, k, v):
        q, k, v = (
            jax.device_put(sf.to_ring_layout(x, n, layout), NamedSharding(mesh, spec))
            for x in (q, k, v)
        )
        out, lse = mapped(q, k, v)
        return sf.from_ring_layout(out, n, layout), sf.from_ring_layout(lse, n, layout, axis=2)

    return attend


@pytest.mark.parametrize(
    "implementation, check_vma",
    [
        pytest.param("xla", False, marks=pytest.mark.slow),  # the global wrapper's path
        ("reference", True),  # the reference block backward, clean under vma checks
        # the C++ CPU kernels (CPU's default, where built) as the per-step blocks
        pytest.param("native_cpu", True, marks=NEEDS_NATIVE),
    ],
)
def test_per_shard_function_in_user_shard_map(implementation, check_vma):
    case = C(N=4, layout="striped", T=32, S=32, K=1)
    q, k, v, kwargs, cotangents = make_inputs(case)
    attend = _per_shard(4, "striped", check_vma, implementation, causal=True)
    actual = with_vjp(attend)(q, k, v, *cotangents)
    expected = oracle_fn(dict(causal=True))(q, k, v, *cotangents)
    for name, kind, a, e in zip(
        ("out", "lse", "dq", "dk", "dv"), ("output",) * 2 + ("grad",) * 3, actual, expected,
        strict=True,
    ):  # fmt: skip
        assert_close(a, e, kind=kind, name=name)


def test_explicit_mesh_under_set_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "sequence"))
    case = C(N=4, B=2, T=30, S=30)
    q, k, v, kwargs, _ = make_inputs(case)
    with jax.sharding.set_mesh(mesh):
        out = sf.ring_attention(q, k, v, mesh=mesh, data_axis="data", **kwargs)
    assert_close(out, sf.attention_reference(q, k, v, **kwargs), name="out")
    # and under jit without the context (test_ring_global_api.py has the whole matrix)
    out = jax.jit(lambda q: sf.ring_attention(q, k, v, mesh=mesh, **kwargs))(q)
    assert_close(out, sf.attention_reference(q, k, v, **kwargs), name="out")
