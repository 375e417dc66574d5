"""`ParallelMoE(dispatch_chunks=C)`: the routed rows in C chunks, each dispatched, run
through its experts and combined on its own.

Equal to one chunk (outputs, statistics and every gradient), and overlappable: checked on
the jaxpr, forward and backward, as the collective matmuls' rings are
(`tests/collectives/collective_matmul/test_structure.py`). No all-to-all of a chunk's
dispatch or combine depends, even indirectly, on another chunk's expert compute (named
scope `moe_chunk_{c}/experts`), and no chunk's expert compute on another's combine: so
XLA's asynchronous collectives (GPU, TPU) may run chunk c + 1's dispatch and chunk
c - 1's combine while chunk c's grouped matmuls run. (XLA:CPU's collectives are
synchronous: nothing overlaps here, which is why the check is structural.)
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardfuse as sf
from tests.jaxprs import sub_jaxprs

_CHUNK = re.compile(r"moe_chunk_(\d+)/(dispatch|experts|combine)")


def analyse(jaxpr, prefix="", inherited=None, found=None):
    """`found`: `(kind, chunk, direction, ancestors)` of every all-to-all and every expert
    op, where `ancestors` are the `("experts" | "combine", chunk, direction)` it depends on
    (the backward depends on the whole forward: only same-direction ones are checked).

    Dependence runs through sub-jaxprs (jit, custom_vjp, shard_map): every output of a
    sub-jaxpr depends on what any of its outputs does (coarse, so never missing one)."""
    found = [] if found is None else found
    depends = dict(zip(jaxpr.invars, inherited or [], strict=False))
    for eqn in jaxpr.eqns:
        inputs = [depends.get(v, frozenset()) if not hasattr(v, "val") else frozenset()
                  for v in eqn.invars]  # fmt: skip
        ancestors = frozenset().union(*inputs)
        scope = prefix + "/" + str(eqn.source_info.name_stack)
        tags = _CHUNK.findall(scope)
        chunk, kind = (int(tags[-1][0]), tags[-1][1]) if tags else (None, None)
        direction = "backward" if "transpose" in scope else "forward"
        subs = list(sub_jaxprs(eqn))
        # a cond's branches take its operands after the branch index
        sub_inputs = inputs[1:] if eqn.primitive.name == "cond" else inputs
        for sub in subs:
            ancestors = ancestors | analyse(sub, scope, sub_inputs, found)
        if kind == "experts" and eqn.primitive.name == "ffi_call":
            found.append(("experts", chunk, direction, ancestors))
        if eqn.primitive.name == "all_to_all" and kind is not None:
            found.append((kind, chunk, direction, ancestors))
        if kind == "experts" and not subs:
            ancestors = ancestors | {("experts", chunk, direction)}
        if kind == "combine" and eqn.primitive.name == "all_to_all":
            ancestors = ancestors | {("combine", chunk, direction)}
        for var in eqn.outvars:
            depends[var] = ancestors
    return frozenset().union(*(depends.get(v, frozenset()) for v in jaxpr.outvars
                               if not hasattr(v, "val")))  # fmt: skip


def _layer(mesh, chunks, **kwargs):
    return sf.layers.ParallelMoE(16, 32, num_experts=8, top_k=2, mesh=mesh,
                                 dispatch_chunks=chunks, rngs=nnx.Rngs(0), **kwargs)  # fmt: skip


def _loss_and_grads(moe, x):
    graphdef, state, rest = nnx.split(moe, nnx.Param, ...)

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state, rest).forward_with_stats(x)
        return jnp.sum(y**2) + stats["load_balancing_loss"] + stats["router_z_loss"], (y, stats)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), state


def _violations(found):
    bad = []
    for kind, chunk, direction, ancestors in found:
        experts = {c for k, c, d in ancestors if k == "experts" and d == direction}
        if kind in ("dispatch", "combine") and experts - {chunk}:
            bad.append(f"{direction} {kind} all-to-all of chunk {chunk} waits for the "
                       f"experts of chunks {sorted(experts - {chunk})}")  # fmt: skip
        # (the backward runs each chunk's combine first: its own transposed combine feeds it)
        if kind == "experts" and any(k == "combine" and d == direction and c != chunk
                                     for k, c, d in ancestors):  # fmt: skip
            bad.append(f"{direction} experts of chunk {chunk} wait for another's combine")
    return bad


@pytest.mark.parametrize("chunks", [2, 3])
def test_chunks_leave_every_transfer_independent_of_other_chunks_compute(chunks):
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    moe = _layer(mesh, chunks)
    x = jax.random.normal(jax.random.key(0), (8, 8, 16))
    fn, state = _loss_and_grads(moe, x)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(fn)(state, x).jaxpr
    found = []
    analyse(jaxpr, found=found)
    kinds = {(kind, direction) for kind, _, direction, _ in found}
    assert kinds == {(k, d) for k in ("dispatch", "experts", "combine")
                     for d in ("forward", "backward")}  # fmt: skip
    assert {chunk for _, chunk, _, _ in found} == set(range(chunks))
    assert not _violations(found), _violations(found)
    # and each chunk's combine does wait for its own experts (the analysis sees through)
    for kind, chunk, direction, ancestors in found:
        if kind == "combine" and direction == "forward":
            assert ("experts", chunk, "forward") in ancestors


def test_the_analysis_flags_a_chunk_that_waits_for_the_previous_one(monkeypatch):
    """A mutant whose chunk c + 1 dispatches rows that read chunk c's result."""
    from shardfuse.layers import moe as moe_lib

    original = moe_lib.ParallelMoE._expert_parallel
    previous = []

    def serial(self, rows, *args):
        if previous:
            rows = rows + 0 * previous[-1][: rows.shape[0]]
        out = original(self, rows, *args)
        previous.append(out)
        return out

    monkeypatch.setattr(moe_lib.ParallelMoE, "_expert_parallel", serial)
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    fn, state = _loss_and_grads(_layer(mesh, 2), jnp.ones((8, 8, 16)))
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(fn)(state, jnp.ones((8, 8, 16))).jaxpr
    found = []
    analyse(jaxpr, found=found)
    assert any("dispatch all-to-all of chunk 1 waits" in v for v in _violations(found))


@pytest.mark.parametrize(
    "shape, names, chunks, kwargs",
    [((4, 2), ("expert", "data"), 3, {}),
     ((2, 2, 2), ("expert", "model", "data"), 2, dict(capacity_factor=1.0, shared_experts=1))],
    ids=["expert-data-3", "expert-model-data-capacity-2"],
)  # fmt: skip
def test_chunks_equal_one_chunk(shape, names, chunks, kwargs):
    mesh = jax.make_mesh(shape, names)
    x = jax.random.normal(jax.random.key(1), (8, 8, 16))
    results = []
    for c in (1, chunks):
        fn, state = _loss_and_grads(_layer(mesh, c, **kwargs), x)
        with jax.set_mesh(mesh):
            results.append(fn(state, x))
    (loss1, (y1, stats1)), grads1 = results[0]
    (loss2, (y2, stats2)), grads2 = results[1]
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))  # row by row, same math
    for key in stats1:
        np.testing.assert_allclose(np.asarray(stats1[key]), np.asarray(stats2[key]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert y2.sharding == y1.sharding


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_dispatch_chunks_are_named(bad):
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    with pytest.raises(ValueError, match=f"dispatch_chunks={bad!r}"):
        _layer(mesh, bad)
