"""Ulysses and USP (Ulysses x ring) against the reference on the gathered sequence.

`sf.ring_attention(strategy="ulysses" | "ulysses_ring")` on 8 CPU devices:
Ulysses over 2, 4 and 8 devices, USP over 2 x 4 and 4 x 2 (ulysses x ring) on
meshes listing the axes in either order (issue 24),
every mask (causal, segment ids, window, softcap), GQA with K >= N (kv heads
scattered) and K < N (repeated), MQA, float32 and bfloat16, lengths the axis
does not divide, and a (data, sequence, model) mesh; forward, lse and
gradients (jax.vjp with random cotangents) with the TESTING.md tolerances
(`ring_cases.compare`). The default run keeps one cell of every kind; the
full matrix runs with -m slow.
"""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.collectives.ring_attention import relayout
from tests.collectives.ring_attention.ring_cases import (
    RingCase,
    compare,
    make_inputs,
    mesh_3d,
    with_vjp,
)
from tests.pairwise import pairwise

pytestmark = pytest.mark.timeout(600)


@dataclasses.dataclass(frozen=True)
class UlyssesCase(RingCase):
    """`N` devices of Ulysses; `ring` > 1: USP over a (ring, ulysses) mesh of `ring x N`."""

    strategy: str = "ulysses"
    ring: int = 1

    @property
    def id(self):
        size = f"u{self.N}xr{self.ring}" if self.strategy == "ulysses_ring" else f"u{self.N}"
        return super().id.replace(f"N{self.N}", size, 1)


@functools.cache
def _usp_mesh(ulysses: int, ring: int) -> Mesh:
    devices = np.array(jax.devices()[: ulysses * ring]).reshape(ring, ulysses)
    return Mesh(devices, ("ring", "ulysses"))


def _attend_fn(case: UlyssesCase, kwargs):
    extra = {}
    if case.mesh == "3d":
        mesh, extra = mesh_3d(), dict(data_axis="data", model_axis="model")
        axis = "sequence"
    elif case.strategy == "ulysses_ring":
        mesh, axis = _usp_mesh(case.N, case.ring), ("ulysses", "ring")
    else:
        mesh, axis = Mesh(np.array(jax.devices()[: case.N]), ("sequence",)), "sequence"
    return with_vjp(
        lambda q, k, v: sf.ring_attention(
            q, k, v, mesh=mesh, sequence_axis=axis, layout=case.layout, strategy=case.strategy,
            return_lse=True, implementation=case.implementation, **extra, **kwargs,
        )
    )  # fmt: skip


def check(case: UlyssesCase, seed: int = 0):
    q, k, v, kwargs, cotangents = make_inputs(case, seed)
    inputs = (q, k, v) if case.dtype == "float32" else (x.astype(case.dtype) for x in (q, k, v))
    actual = _attend_fn(case, kwargs)(*inputs, *cotangents)
    compare(case, actual, q, k, v, kwargs, cotangents)
    return actual


def _usp(ulysses, ring, **kwargs):
    return UlyssesCase(N=ulysses, ring=ring, strategy="ulysses_ring", **kwargs)


# By default (the CI budget): Ulysses with kv heads repeated (K < N) under every mask at once
# (causal, segment ids, window, softcap). USP runs by default in test_ring_global_api.py
# (2 x 2, zigzag, jax.grad on an Explicit mesh). bfloat16, K >= N (scattered), MQA, the USP
# matrix (4 x 2, 2 x 4, 2 x 2, contiguous, padding, T != S) and the 3-axis mesh: -m slow.
DEFAULT = [
    UlyssesCase(N=4, H=8, K=2, segments=True, window=(7, 0), softcap=20.0),
]


def _slow_cases():
    # Ulysses alone: every kv-head count against every ring size (K < N, K == N, K > N
    # place the kv heads differently), then each feature at one ring size in turn.
    cases = [UlyssesCase(N=n, H=8, K=kv) for n in (2, 4, 8) for kv in (1, 2, 8)]
    features = [
        dict(K=4, segments=True, causal=False),
        dict(K=2, window=(6, 0)),
        dict(K=2, softcap=10.0, segments=True),
        dict(K=2, dtype="bfloat16", segments=True),
        dict(K=8, T=24, S=40, window=(None, 4), causal=False),
        dict(K=2, T=40, S=24),
        dict(K=2, T=27, S=27),  # padded to a multiple of N
    ]
    sizes = (2, 4, 8)
    cases += [UlyssesCase(N=sizes[i % 3], H=8, **f) for i, f in enumerate(features)]
    # USP: every pair of (ulysses x ring sizes, layout, feature) (tests/pairwise.py)
    usp_features = [
        dict(H=4, K=2),
        dict(H=4, K=1, segments=True),
        dict(H=8, K=8, window=(9, 2), softcap=30.0),
        dict(H=4, K=4, dtype="bfloat16", segments=True),
        dict(H=4, K=2, T=24, S=40),
        dict(H=4, K=2, T=37, S=37, causal=False),
    ]
    for (ulysses, ring), layout, f in pairwise(
        ((2, 4), (4, 2), (2, 2)), ("zigzag", "contiguous"), range(len(usp_features))
    ):
        cases.append(_usp(ulysses, ring, layout=layout, **usp_features[f]))
    cases += [
        UlyssesCase(N=2, H=4, K=2, dtype="bfloat16", window=(5, 3), softcap=20.0, causal=False),
        _usp(4, 2, H=4, K=2, T=44, S=44),
        _usp(2, 4, layout="contiguous", H=2, K=1, segments=True, causal=False),
        UlyssesCase(N=2, mesh="3d", B=2, H=4, K=2),
        UlyssesCase(N=2, mesh="3d", B=2, H=4, K=1, segments=True),  # MQA over the model axis
        UlyssesCase(N=2, mesh="3d", B=2, H=8, K=2, dtype="bfloat16"),
    ]
    return [c for c in cases if c not in DEFAULT]


@pytest.mark.parametrize("case", DEFAULT, ids=lambda c: c.id)
def test_ulysses_matches_reference(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _slow_cases(), ids=lambda c: c.id)
def test_ulysses_matrix(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
def test_ulysses_ignores_the_layout(layout):
    """Ulysses sees the whole sequence in natural order: every layout gives the same bits."""
    base = UlyssesCase(N=4, H=4, K=2)
    expected = check(base)
    actual = check(dataclasses.replace(base, layout=layout))
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(a, e)


@pytest.mark.slow
def test_fully_masked_rows_and_nan_padding():
    """Queries whose segment no key has: out 0, lse -inf, finite zero gradients; the padded
    positions (T=30 on 4 devices: 2 pad rows) never reach the output."""
    case = UlyssesCase(N=4, H=4, K=2, T=30, S=30, segments=True, causal=False)
    q, k, v, kwargs, cotangents = make_inputs(case)
    q_seg = kwargs["q_segment_ids"].at[:, :5].set(99)  # no key has segment 99
    kwargs = dict(kwargs, q_segment_ids=q_seg)
    out, lse, dq, dk, dv = _attend_fn(case, kwargs)(q, k, v, *cotangents)
    assert np.all(np.asarray(out[:, :5]) == 0) and np.all(np.isneginf(lse[:, :, :5]))
    assert all(np.isfinite(np.asarray(g)).all() for g in (dq, dk, dv))
    assert np.all(np.asarray(dq[:, :5]) == 0)
    compare(case, (out, lse, dq, dk, dv), q, k, v, kwargs, cotangents)


# Issue 24: USP on a mesh whose axes are listed (ulysses, ring), the order of `sequence_axis`,
# returned wrong values with the default zigzag layout (max error 1.1 at T = 1024): the
# zigzag relayout's ppermute over the two axes numbered the devices in the mesh's order,
# (ulysses, ring), while the sequence is sharded ring-major. Every matrix above builds its
# mesh as (ring, ulysses), where the two orders agree. Here: both axis orders, both layouts
# USP accepts (striped: a clear ValueError), lengths 2N divides and one it pads, Explicit and
# Auto meshes. The issue's own shapes (T = 992, 1000, 1024, H = 8, K = 4, D = 64; about 30 s
# a cell on the 2-core host) run with -m slow; by default the same call at T = 60, D = 16.


@functools.cache
def _named_usp_mesh(ulysses: int, ring: int, order: str, kind: str) -> Mesh:
    """`jax.make_mesh` of `ulysses x ring` devices, axes listed `order`, Explicit or Auto."""
    sizes = {"ulysses": ulysses, "ring": ring}
    names = ("ulysses", "ring") if order == "ulysses_major" else ("ring", "ulysses")
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
    return jax.make_mesh(tuple(sizes[a] for a in names), names, axis_types=types)


def _mesh_order_cells():
    # One end-to-end cell by default (the relayout itself: the exact, cheap test below).
    small = [((2, 4), "ulysses_major", "zigzag", 60, 16, "explicit")]  # 60: padded to 64
    cells = [pytest.param(*cell, id=_cell_id(*cell)) for cell in small]
    issue = [
        ((4, 2), "ulysses_major", "zigzag", 64, 16, "auto"),
        ((4, 2), "ring_major", "zigzag", 64, 16, "explicit"),
        ((2, 4), "ulysses_major", "contiguous", 60, 16, "auto"),
    ]
    # every pair of mesh sizes, layout and length (`tests/pairwise.py`: 6 of the 12 cells;
    # SHARDFUSE_FULL_MATRIX=1 runs all)
    for sizes, layout, T in pairwise(((2, 4), (4, 2)), ("zigzag", "contiguous"), (992, 1000, 1024)):
        issue.append((sizes, "ulysses_major", layout, T, 64, "explicit"))
    for sizes in ((2, 4), (4, 2)):
        issue.append((sizes, "ulysses_major", "zigzag", 1024, 64, "auto"))
        issue.append((sizes, "ring_major", "zigzag", 1000, 64, "explicit"))
    slow = pytest.mark.slow
    # XLA:CPU aborts these T = 1024 Auto cells now and then when another process competes
    # for the cores (`pytest -n 2`: 3 of 10 runs on jax 0.10.2, 2 of 6 on 0.12; not seen
    # alone): a CHECK in its in-process collectives, `rendezvous.h:314] Check failed: id <
    # num_threads (9 vs. 8) ... name=collective permute RendezvousKey{run_id=...,
    # global_devices=[0, ..., 7], num_local_participants=8, ..., op_id=1}` in
    # `InProcessCommunicator::CollectivePermute` (a core dump's stack and log buffer,
    # 2026-11-26). Every collective-permute key in the log buffer has op_id 1, so likely a
    # device that runs ahead into the next permute joins a rendezvous the others have not left.
    # A race in XLA:CPU's runtime, not in the program (the cells that finish match the
    # reference; the runtimes of GPU and TPU meet per op). They run on request
    # (SHARDFUSE_USP_AUTO_1024=1), so that the abort cannot take a CI worker down; the
    # Explicit cells at T = 1024 and the Auto cells at T = 64 still run.
    aborts = pytest.mark.skipif(
        os.environ.get("SHARDFUSE_USP_AUTO_1024") != "1",
        reason="XLA:CPU's collective-permute rendezvous races here under load (see above); "
        "SHARDFUSE_USP_AUTO_1024=1 runs it",
    )
    return cells + [
        pytest.param(
            *cell,
            id=_cell_id(*cell),
            marks=(slow, aborts) if cell[3] == 1024 and cell[5] == "auto" else slow,
        )
        for cell in issue
    ]


def _cell_id(sizes, order, layout, T, D, kind):
    return f"u{sizes[0]}xr{sizes[1]}-{order}-{layout}-T{T}-D{D}-{kind}"


@pytest.mark.parametrize("sizes, order, layout, T, D, kind", _mesh_order_cells())
def test_usp_on_either_mesh_axis_order(sizes, order, layout, T, D, kind):
    case = _usp(*sizes, layout=layout, T=T, S=T, H=8, K=4, D=D)
    mesh = _named_usp_mesh(*sizes, order, kind)
    q, k, v, kwargs, cotangents = make_inputs(case)
    attend = with_vjp(
        lambda q, k, v: sf.ring_attention(
            q, k, v, mesh=mesh, sequence_axis=("ulysses", "ring"), strategy="ulysses_ring",
            layout=layout, return_lse=True, **kwargs,
        )
    )  # fmt: skip
    compare(case, attend(q, k, v, *cotangents), q, k, v, kwargs, cotangents)


@pytest.mark.parametrize("order", ["ulysses_major", "ring_major"])
def test_usp_refuses_striped(order):
    mesh = _named_usp_mesh(2, 4, order, "explicit")
    q = k = jax.numpy.zeros((1, 32, 8, 16), jax.numpy.float32)
    with pytest.raises(ValueError, match=r"layout='striped' is not supported with strategy="):
        sf.ring_attention(
            q, k, k, mesh=mesh, sequence_axis=("ulysses", "ring"), strategy="ulysses_ring",
            layout="striped", causal=True,
        )  # fmt: skip


@pytest.mark.parametrize(
    "shape, names",
    [((2, 4), ("ulysses", "ring")), ((4, 2), ("ulysses", "ring")), ((4, 2), ("ring", "ulysses")),
     ((2, 2, 2), ("ulysses", "data", "ring")), ((2, 2, 2), ("ring", "data", "ulysses"))],
    ids=lambda x: "x".join(map(str, x)),
)  # fmt: skip
def test_zigzag_relayout_over_two_axes_in_any_mesh_order(shape, names):
    """The root of issue 24, exactly and in about a second: the per-shard zigzag relayout over
    `(ring, ulysses)` (ring-major, as USP shards the sequence) puts every position where
    `ring_positions` says, whatever order the mesh lists its axes in (a third axis between
    them too); `from_ring` undoes it."""
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    seq = ("ring", "ulysses")
    n = mesh.shape["ring"] * mesh.shape["ulysses"]
    x = jax.numpy.arange(4 * n, dtype=jax.numpy.int32)[None]  # [1, T]: natural positions
    spec = P(None, seq)

    def there_and_back(x):
        ring_order = relayout.to_ring(x, seq, n, "zigzag")
        return ring_order, relayout.from_ring(ring_order, seq, n, "zigzag")

    ring_order, back = jax.jit(
        jax.shard_map(there_and_back, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
    )(x)
    expected = np.asarray(sf.ring_positions(4 * n, n, "zigzag")).reshape(1, -1)
    np.testing.assert_array_equal(np.asarray(ring_order), expected)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
