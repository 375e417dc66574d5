"""Expert dispatch and combine (`sf.collectives.expert_dispatch`) against their definition.

The oracle is a NumPy model of the routing: device d's receive buffer holds, chunk by
chunk (chunk s from device s), the rows of device s whose expert lives on d, in order,
then padding. The dense CPU path must give exactly that (padding poisoned with NaN
never reaches a result), and combine must bring every row's result back to it, with
the transposes (the gradient) doing the same in reverse. On a GPU (`-m gpu`) the
ragged path (`lax.ragged_all_to_all`) must equal the dense one.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.collectives import expert_dispatch

E, A, F = 8, 6, 3  # experts, routed rows per device, features


def _routing(seed, ep, *, dropped=1):
    """Per device: rows `[A, F]` and their sorted experts, the last `dropped` rows dropped."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(ep, A, F)).astype(np.float32)
    experts = np.sort(rng.integers(0, E, size=(ep, A - dropped)), axis=-1)
    experts = np.concatenate([experts, np.full((ep, dropped), E)], axis=-1).astype(np.int32)
    return rows, experts


def _expected_receive(rows, experts, ep, chunk=A):
    """NumPy: each device's receive buffer and its experts (padding NaN / E): chunk s
    holds device s's first `chunk` rows for this device."""
    per = E // ep
    buffers = np.full((ep, ep, chunk, F), np.nan, np.float32)
    ids = np.full((ep, ep, chunk), E, np.int32)
    for d in range(ep):
        for s in range(ep):
            mine = (experts[s] // per == d) & (experts[s] < E)
            n = min(mine.sum(), chunk)
            buffers[d, s, :n] = rows[s][mine][:n]
            ids[d, s, :n] = experts[s][mine][:n]
    return buffers.reshape(ep, ep * chunk, F), ids.reshape(ep, ep * chunk)


def _run(mesh, implementation, rows, experts, pad_value=np.nan, chunk=None):
    """dispatch, then `results = 2 * received + expert id`, then combine; per device."""

    def local(rows, experts):
        received, received_ids, plan = expert_dispatch.dispatch(
            rows[0], experts[0], num_experts=E, axis_name="expert",
            implementation=implementation, pad_value=pad_value, chunk=chunk,
        )  # fmt: skip
        results = 2 * received + received_ids[:, None].astype(rows.dtype)
        back = expert_dispatch.combine(results, plan, axis_name="expert",
                                       implementation=implementation)  # fmt: skip
        return received[None], received_ids[None], back[None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P("expert")),
                       out_specs=(P("expert"), P("expert"), P("expert")))  # fmt: skip
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("expert")))
    return jax.jit(fn)(put(rows), put(experts))


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_dense_dispatch_and_combine_match_their_definition(ep):
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    rows, experts = _routing(ep, ep, dropped=1 + ep % 3)
    received, ids, back = (np.asarray(a) for a in _run(mesh, "dense", rows, experts))
    want_rows, want_ids = _expected_receive(rows, experts, ep)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(received, want_rows)  # padding: the poison, NaN
    valid = experts < E
    want_back = np.where(valid[..., None], 2 * rows + experts[..., None].astype(np.float32), 0)
    assert np.isfinite(back).all()  # the NaN padding never comes back
    np.testing.assert_array_equal(back, want_back)


@pytest.mark.parametrize("ep", [4, 8])
def test_a_capped_dense_dispatch_sends_each_destinations_first_chunk(ep):
    """`chunk` rows a destination (`dense_chunk`): each device's first `chunk` rows for a
    destination arrive and come back; the rest are not sent, come back zero, and
    `overflows` says so."""
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    chunk = expert_dispatch.dense_chunk(A, ep)
    assert chunk < A
    rows, experts = _routing(ep + 10, ep, dropped=1)
    experts[0, : A - 1] = 0  # device 0 sends all its rows to device 0: past the chunk
    received, ids, back = (np.asarray(a) for a in _run(mesh, "dense", rows, experts,
                                                        chunk=chunk))  # fmt: skip
    want_rows, want_ids = _expected_receive(rows, experts, ep, chunk)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(received, want_rows)
    per = E // ep
    sent = np.zeros(experts.shape, bool)
    for s in range(ep):
        for d in range(ep):
            mine = np.flatnonzero((experts[s] // per == d) & (experts[s] < E))
            sent[s, mine[:chunk]] = True
    assert not sent[0, chunk : A - 1].any()  # device 0's rows past its chunk
    want_back = np.where(sent[..., None], 2 * rows + experts[..., None].astype(np.float32), 0)
    np.testing.assert_array_equal(back, want_back)
    flags = [
        int(expert_dispatch.overflows(jnp.asarray(e), num_experts=E, ep=ep, chunk=chunk))
        for e in experts
    ]
    assert flags == [int((~sent[s] & (experts[s] < E)).any()) for s in range(ep)]
    assert flags[0] == 1


def test_combine_transpose_is_the_combines_vjp():
    ep = 4
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    rows, experts = _routing(3, ep, dropped=2)
    chunk = expert_dispatch.dense_chunk(A, ep)
    values = np.random.default_rng(4).normal(size=(ep, A, F)).astype(np.float32)

    def local(rows, experts, values):
        _, _, plan = expert_dispatch.dispatch(rows[0], experts[0], num_experts=E,
                                              axis_name="expert", implementation="dense",
                                              chunk=chunk)  # fmt: skip
        combine = functools.partial(expert_dispatch.combine, plan=plan, axis_name="expert",
                                    implementation="dense")  # fmt: skip
        # a primal varying over the axis, as the layer's results are (an invariant one's
        # cotangent would be summed over the axis)
        _, vjp = jax.vjp(combine, jnp.zeros((ep * chunk, F), jnp.float32) + 0 * rows.sum())
        mine = expert_dispatch.combine_transpose(values[0], plan, axis_name="expert")
        return mine[None], vjp(values[0])[0][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"),) * 3,
                       out_specs=(P("expert"), P("expert")))  # fmt: skip
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("expert")))
    mine, theirs = jax.jit(fn)(put(rows), put(experts), put(values))
    np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_chunk_needs_the_dense_implementation():
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2])
    rows, experts = _routing(0, 2)
    with pytest.raises(ValueError, match="chunk=3 needs implementation='dense'"):
        _run(mesh, "ragged", rows, experts, chunk=3)


@pytest.mark.parametrize(
    "dtype, num_experts",
    [("bfloat16", 256), ("bfloat16", 2**14), ("bfloat16", 2**14 + 64), ("float16", 2**16),
     ("float32", 2**20)],
)  # fmt: skip
def test_the_ids_arrive_exactly_with_the_rows_or_beside_them(dtype, num_experts):
    """The dense path sends the ids as two columns of the rows' dtype where they are exact
    (`bfloat16` up to 64 x 256 experts), else in an all-to-all of their own: either way
    every received id is the one sent, the sentinel E included."""
    ep = 4
    fits = expert_dispatch._ids_fit(num_experts, jnp.dtype(dtype))
    assert fits == (num_experts <= 2**14 + 63 or dtype != "bfloat16")
    rng = np.random.default_rng(num_experts)
    experts = np.sort(rng.integers(max(0, num_experts - 300), num_experts, size=(ep, A)), -1)
    experts[:, -1] = num_experts  # one dropped row each
    experts = experts.astype(np.int32)
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("expert")))
    rows, experts = put(jnp.asarray(rng.normal(size=(ep, A, F)), dtype)), put(experts)

    def local(rows, experts):
        received, ids, _ = expert_dispatch.dispatch(
            rows[0], experts[0], num_experts=num_experts, axis_name="expert",
            implementation="dense",
        )  # fmt: skip
        return received[None], ids[None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P("expert"), P("expert")),
                       out_specs=(P("expert"), P("expert")))  # fmt: skip
    text = jax.jit(fn).lower(rows, experts).as_text()
    assert text.count("all_to_all") == (1 if fits else 2)
    received, ids = (np.asarray(a) for a in jax.jit(fn)(rows, experts))
    experts = np.asarray(experts)
    per = num_experts // ep
    for d in range(ep):
        for src in range(ep):
            mine = experts[src][(experts[src] // per == d) & (experts[src] < num_experts)]
            chunk = ids[d, src * A : (src + 1) * A]
            np.testing.assert_array_equal(chunk[: len(mine)], mine)
            assert (chunk[len(mine) :] == num_experts).all()


def test_every_row_to_one_device_is_dropless():
    ep = 4
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    rows, _ = _routing(0, ep, dropped=0)
    experts = np.zeros((ep, A), np.int32)  # every row of every device to expert 0
    received, ids, back = (np.asarray(a) for a in _run(mesh, "dense", rows, experts))
    np.testing.assert_array_equal(received[0].reshape(ep, A, F), rows)
    np.testing.assert_array_equal(back, 2 * rows)


def test_gradient_goes_back_through_both_transfers():
    ep = 4
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    rows, experts = _routing(3, ep, dropped=2)
    ct = np.random.default_rng(1).normal(size=rows.shape).astype(np.float32)

    def f(rows):
        return _run(mesh, "dense", rows, experts, pad_value=0.0)[2]

    _, vjp = jax.vjp(f, jnp.asarray(rows))
    (grad,) = vjp(jnp.asarray(ct))
    np.testing.assert_array_equal(np.asarray(grad), np.where(experts[..., None] < E, 2 * ct, 0.0))


def test_dense_over_one_axis_of_a_bigger_mesh():
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    rows, experts = _routing(5, 8)
    rows4, experts4 = rows.reshape(2, 4, A, F), experts.reshape(2, 4, A)

    def local(rows, experts):
        received, ids, plan = expert_dispatch.dispatch(
            rows[0, 0], experts[0, 0], num_experts=E, axis_name="expert", implementation="dense"
        )
        back = expert_dispatch.combine(2 * received, plan, axis_name="expert",
                                       implementation="dense")  # fmt: skip
        return back[None, None]

    spec = P("data", "expert")
    put = functools.partial(jax.device_put, device=NamedSharding(mesh, spec))
    back = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(
        put(rows4), put(experts4)
    )
    np.testing.assert_array_equal(
        np.asarray(back), np.where(experts4[..., None] < E, 2 * rows4, 0.0)
    )


def test_implementation_is_checked():
    with pytest.raises(ValueError, match="dispatch_implementation='mpi'"):
        expert_dispatch.check_implementation("mpi")
    assert expert_dispatch.default_implementation("cpu") == "dense"
    assert expert_dispatch.default_implementation("gpu") == "ragged"


@pytest.mark.gpu
def test_ragged_equals_dense_on_gpu():
    ep = len(jax.devices())
    if ep < 2:
        pytest.skip("ragged_all_to_all needs at least two GPUs to move anything")
    mesh = jax.make_mesh((ep,), ("expert",))
    rows, experts = _routing(7, ep)
    run = functools.partial(_run, mesh, rows=rows, experts=experts, pad_value=0.0)
    for got, want in zip(run("ragged"), run("dense"), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_ragged_on_this_cpu_equals_dense_or_is_unimplemented():
    """XLA:CPU has no ragged-all-to-all (jax#34755): the day it has, this compares the two."""
    ep = 4
    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    rows, experts = _routing(11, ep)
    dense = _run(mesh, "dense", rows, experts, pad_value=0.0)
    try:
        ragged = _run(mesh, "ragged", rows, experts, pad_value=0.0)
    except jax.errors.JaxRuntimeError as e:
        assert "ragged-all-to-all" in str(e) and "not supported" in str(e), e
        pytest.skip("XLA:CPU cannot run ragged-all-to-all (jax#34755); dense is the CPU path")
    for got, want in zip(ragged, dense, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
