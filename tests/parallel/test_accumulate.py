"""`accumulate`: token-weighted gradients over microbatches equal the large batch; one reduction.

Oracle: the same tiny LM (same seed, so the same values: see test_init) on
one device, the whole padded batch at once, loss = sum of token losses /
number of real tokens. Microbatches hold unequal token counts (random
padding), so a per-microbatch mean would fail. Structure: collectives of the
compiled step counted per mesh axis, a scan's body once per microbatch
(`hlo_collectives.count`).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from shardfuse.layers import ParallelMLP
from shardfuse.parallel.accumulate import accumulate
from tests.parallel import hlo_collectives
from tests.parallel.memory_cases import (
    assert_trees_close,
    batch_spec,
    for_mesh,
    make_lm,
    mesh_of,
    one_device_mesh,
    padded_batch,
    reference_grads,
    token_loss,
)


def _compiled(model, batch, mesh, zero, microbatches, **kwargs):
    """The jitted accumulate step, compiled once: (run(model, batch), its HLO text)."""
    fn = accumulate(
        token_loss, microbatches, mesh=mesh, zero=zero, batch_spec=batch_spec(mesh), **kwargs
    )
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, batch: fn(nnx.merge(graphdef, state), batch))
    compiled = step.lower(state, batch).compile()
    return (lambda: compiled(state, batch)), compiled.as_text()


@pytest.fixture(scope="module")
def oracle():
    batch = padded_batch(0)
    model = make_lm(one_device_mesh())
    return batch, reference_grads(model, batch)


@pytest.mark.parametrize(
    "zero, mesh_name",
    [
        (3, "data2-fsdp4"),
        pytest.param(0, "data2-fsdp4", marks=pytest.mark.slow),
        pytest.param(0, "fsdp2-seq2-model2", marks=pytest.mark.slow),
        pytest.param(3, "fsdp2-seq2-model2", marks=pytest.mark.slow),
    ],
)
def test_unequal_microbatches_equal_large_batch_and_reduce_once(zero, mesh_name, oracle):
    batch, (want_loss, want) = oracle
    mesh = mesh_of(mesh_name)
    model = make_lm(mesh, zero)
    run, hlo = _compiled(model, for_mesh(batch, mesh), mesh, zero, 4)
    loss, grads = run()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_trees_close(nnx.State(grads), want, rtol=1e-5, atol=1e-6)

    counts = hlo_collectives.count(hlo, mesh, scalars=False)
    batch_axes = [a for a in ("data", "fsdp", "sequence") if a in mesh.axis_names]
    if zero == 0:  # every gradient all-reduce once per step: none in the scan (x4)
        reduce_all = sum(
            n
            for (k, axes), n in counts.items()
            if k == "all-reduce" and set(axes) & set(batch_axes)
        )
        assert 1 <= reduce_all <= len(jax.tree.leaves(grads)), counts
    else:  # fsdp: reduce-scatters, never an all-reduce of gradients
        assert hlo_collectives.total(counts, "all-reduce", "fsdp") == 0, counts
        assert hlo_collectives.total(counts, "reduce-scatter", "fsdp") % 4 == 0, counts
    for axis in set(batch_axes) - {"fsdp"}:  # data / sequence: once per step, not per microbatch
        assert hlo_collectives.total(counts, "all-reduce", axis) <= len(jax.tree.leaves(grads))
    for (kind, axes), n in counts.items():
        if kind == "all-reduce" and "fsdp" not in axes and set(axes) & set(batch_axes):
            assert n < 4, (kind, axes, n)  # would be a multiple of 4 inside the scan


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_gradient_reductions_do_not_grow_with_microbatches(zero):
    mesh = mesh_of("data2-fsdp4")
    model = make_lm(mesh, zero)
    batch = padded_batch(1)

    def reductions(m):
        counts = hlo_collectives.count(
            _compiled(model, batch, mesh, zero, m)[1], mesh, scalars=False
        )
        return {key: n for key, n in counts.items() if key[0] in ("all-reduce", "reduce-scatter")}

    one, four = reductions(1), reductions(4)
    data_all_reduce = lambda c: sum(n for (k, a), n in c.items() if k == "all-reduce")  # noqa: E731
    assert data_all_reduce(four) == data_all_reduce(one) >= 1
    if zero >= 2:  # a sharded buffer holds reduced shards: one reduce-scatter per microbatch
        assert hlo_collectives.total(four, "reduce-scatter", "fsdp") == 4 * (
            hlo_collectives.total(one, "reduce-scatter", "fsdp")
        )
        assert hlo_collectives.total(four, "all-reduce", "fsdp") == 0
    else:
        assert four == one


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_gathers_each_weight_at_most_twice_per_microbatch(reshard):
    mesh = mesh_of("data2-fsdp4")
    model = make_lm(mesh, 3, reshard_after_forward=reshard)
    # the blocks are one scanned Stack: its six stacked weights (fused qkv, o, up, down and
    # the two norms, each [layers, ...]) are gathered as one array each, then the embedding
    # and the head (measured: 8 gathers per microbatch with and without resharding)
    gathered = 6 + 2
    for m in (1, 4):
        hlo = _compiled(model, padded_batch(2), mesh, 3, m)[1]
        gathers = hlo_collectives.total(hlo_collectives.count(hlo, mesh), "all-gather", "fsdp")
        assert gathered * m <= gathers <= (2 if reshard else 1) * gathered * m


def test_bad_input():
    mesh = mesh_of("data2-fsdp4")
    model = ParallelMLP(8, 16, mesh=mesh, rngs=nnx.Rngs(0))
    batch = padded_batch(0, batch=8)
    with pytest.raises(ValueError, match=r"num_microbatches=4 x 8 batch shards"):
        accumulate(token_loss, 4, mesh=mesh)(model, batch)
    with pytest.raises(ValueError, match=r"num_microbatches=0 must be a positive integer"):
        accumulate(token_loss, 0, mesh=mesh)
    with pytest.raises(ValueError, match=r"zero=4 must be one of \(0, 1, 2, 3\)"):
        accumulate(token_loss, 1, mesh=mesh, zero=4)
    with pytest.raises(ValueError, match=r"fsdp_axis='shard' is not an axis of the mesh"):
        accumulate(token_loss, 1, mesh=mesh, fsdp_axis="shard")
    with pytest.raises(TypeError, match=r"num_microbatches=2.0 must be a positive integer"):
        accumulate(token_loss, 2.0, mesh=mesh)
    with pytest.raises(ValueError, match=r"scatter='once' must be one of \('microbatch', 'step'\)"):
        accumulate(token_loss, 2, mesh=mesh, zero=2, scatter="once")
    with pytest.raises(ValueError, match=r"scatter='step' needs zero <= 2"):
        accumulate(token_loss, 2, mesh=mesh, zero=3, scatter="step")


def test_zero2_scatter_once_per_step_reduces_as_often_as_one_microbatch(oracle):
    """ZeRO-2 with scatter="step": the whole local gradient sum reduce-scattered after the
    scan (PyTorch FSDP's no_sync trade: unsharded gradient memory while accumulating), so
    4 microbatches reduce exactly as often as 1, over fsdp and over data; values as ever."""
    batch, (want_loss, want) = oracle
    mesh = mesh_of("data2-fsdp4")
    model = make_lm(mesh, 2)
    run, hlo4 = _compiled(model, for_mesh(batch, mesh), mesh, 2, 4, scatter="step")
    loss, grads = run()
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_trees_close(nnx.State(grads), want, rtol=1e-5, atol=1e-6)
    hlo1 = _compiled(model, for_mesh(batch, mesh), mesh, 2, 1, scatter="step")[1]

    def reductions(hlo):
        counts = hlo_collectives.count(hlo, mesh, scalars=False)
        return {k: n for k, n in counts.items() if k[0] in ("all-reduce", "reduce-scatter")}

    four, one = reductions(hlo4), reductions(hlo1)
    assert four == one, (four, one)
    assert hlo_collectives.total(four, "reduce-scatter", "fsdp") >= 1
    assert hlo_collectives.total(four, "all-reduce", "fsdp") == 0
    # the default scatters per microbatch: 4x the reduce-scatters of one microbatch
    per_micro = reductions(_compiled(model, for_mesh(batch, mesh), mesh, 2, 4)[1])
    assert hlo_collectives.total(per_micro, "reduce-scatter", "fsdp") == 4 * (
        hlo_collectives.total(one, "reduce-scatter", "fsdp")
    )


def _stack_lm_step(layers, zero, scatter="microbatch", microbatches=2):
    """A Llama-style LM whose blocks are an `sf.layers.Stack` (one layer scan), accumulated
    on (data 2, fsdp 4): `(loss, grads, memory_analysis, counts, G, layer)` with G the
    float32 bytes of all gradients and `layer` those of one block."""
    from jax.sharding import PartitionSpec as P

    from shardfuse.models import ModelSpec, Transformer

    mesh = mesh_of("data2-fsdp4")
    spec = ModelSpec.tiny(vocab_size=64, hidden=64, ffn_hidden=256, num_layers=layers)
    model = Transformer(spec, mesh=mesh, zero=zero, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    batch = {
        name: jax.numpy.asarray(rng.integers(0, spec.vocab_size, (16, 8)), jax.numpy.int32)
        for name in ("tokens", "targets")
    }
    fn = accumulate(
        Transformer.loss,
        microbatches,
        mesh=mesh,
        zero=zero,
        scatter=scatter,
        batch_spec=P(("data", "fsdp")),
    )
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, batch: fn(nnx.merge(graphdef, state), batch))
    with jax.set_mesh(mesh):
        compiled = step.lower(state, batch).compile()
        loss, grads = compiled(state, batch)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    layer = sum(x.size * 4 for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param))) // layers
    counts = hlo_collectives.count(compiled.as_text(), mesh, scalars=False)
    return loss, grads, compiled.memory_analysis(), counts, grad_bytes, layer


def _planned_zero2_gradient_bytes(layers):
    """The planner's gradient memory of `_stack_lm_step`'s ZeRO-2 step (float32, data 2,
    fsdp 4): its `gradients` term plus the one layer's whole gradient its backward working
    set adds over ZeRO-1's; and the bytes of the tables (embedding, head) held whole."""
    from shardfuse import hardware
    from shardfuse.models import ModelSpec
    from shardfuse.planner.cost import estimate
    from shardfuse.planner.options import Assumptions, Parallelism

    spec = ModelSpec.tiny(vocab_size=64, hidden=64, ffn_hidden=256, num_layers=layers)
    a = Assumptions(param_bytes=4, grad_bytes=4, activation_bytes=4)
    terms = {}
    for zero in (1, 2):
        parallelism = Parallelism.of(data=2, fsdp=4, zero=zero, num_microbatches=2)
        e = estimate(spec, hardware.cluster("h100"), parallelism, global_batch=16, seq_len=8,
                     assumptions=a)  # fmt: skip
        terms[zero] = {t.name: t.value for t in e.memory}
    one_layer = terms[2]["layer_working_set"] - terms[1]["layer_working_set"]
    assert one_layer == pytest.approx(spec.layer_params() * 4)
    tables = 2 * spec.vocab_size * spec.hidden * 4
    assert terms[2]["gradients"] < terms[1]["gradients"] / 3  # not a whole gradient
    return terms[2]["gradients"] + one_layer, tables


@pytest.mark.parametrize("layers", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_zero2_reduce_scatters_each_layer_inside_the_layer_scan(layers):
    """ZeRO-2 ties each stacked parameter's layer slice to a sharded gradient inside the
    Stack's layer scan (`fsdp.scatter_gradient`): a layer's weight gradient is reduce-
    scattered over fsdp in the scan's backward, as soon as it is produced.

    Memory (compiled, per device): the gradient memory of a program is its temp bytes
    less its non-gradient temp bytes, which are ZeRO-0's temp less the one whole
    microbatch gradient ZeRO-0 holds there (its accumulated sum is its output buffer).
    Measured (8 CPU devices; F 64, hidden 256, G = all gradients, f32):

    | layers | G | G / fsdp | one layer | ZeRO-2 gradient temp | scatter='step' (whole buffer) |
    |---|---|---|---|---|---|
    | 4 | 1.02 MB | 0.255 MB | 0.246 MB | 0.303 MB | 1.78 MB |
    | 8 | 2.00 MB | 0.501 MB | 0.246 MB | 0.549 MB | 3.55 MB |

    The planner's ZeRO-2 gradient memory (`planner.memory`: shards + the tables' whole
    gradients + one layer's whole gradient) is 0.525 / 0.771 MB: above the compiled, below
    G / fsdp + one layer + the tables. Values and gradients equal ZeRO-0's; reduce-scatters:
    one per stacked leaf per layer (inside the loop) plus one per other leaf, per microbatch."""
    m = 2
    want_loss, want, memory0, _, grad_bytes, layer = _stack_lm_step(layers, 0, microbatches=m)
    loss, grads, memory2, counts, _, _ = _stack_lm_step(layers, 2, microbatches=m)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert_trees_close(nnx.State(grads), nnx.State(want), rtol=1e-5, atol=1e-6)

    non_gradient = memory0.temp_size_in_bytes - grad_bytes
    gradient_temp = memory2.temp_size_in_bytes - non_gradient
    sharded = grad_bytes / 4  # fsdp = 4
    assert gradient_temp <= sharded + layer, (gradient_temp, sharded, layer)
    assert memory2.output_size_in_bytes <= sharded + 4096  # the gradient shards (and the loss)

    # the planner charges the same: the shards, the tables' whole gradients (embedding and
    # head, outside the layer scan) and one layer's whole gradient in the backward's working
    # set; at least what the program holds, at most the bound above plus the tables
    planned, tables = _planned_zero2_gradient_bytes(layers)
    assert gradient_temp <= planned <= sharded + layer + tables, (gradient_temp, planned)

    stacked = len(jax.tree.leaves(grads["blocks"]))
    others = len(jax.tree.leaves(grads)) - stacked
    assert hlo_collectives.total(counts, "reduce-scatter", "fsdp") == m * (
        layers * stacked + others
    ), counts
    assert hlo_collectives.total(counts, "all-reduce", "fsdp") == 0


@pytest.mark.slow
def test_zero2_scatter_step_holds_the_whole_gradient():
    """The measure of the test above sees a whole gradient: scatter='step' (a whole
    local buffer, reduce-scattered after the scan) holds at least G beyond ZeRO-0's
    non-gradient temp; the default holds about G / fsdp."""
    _, _, memory0, _, grad_bytes, layer = _stack_lm_step(4, 0)
    _, _, memory_step, _, _, _ = _stack_lm_step(4, 2, scatter="step")
    non_gradient = memory0.temp_size_in_bytes - grad_bytes
    assert memory_step.temp_size_in_bytes - non_gradient >= grad_bytes - layer
