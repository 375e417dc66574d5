"""`sf.parallel.parallelize`: the run built from a `Plan` (or options) is the run built by hand.

The oracle is written out here, independently of `parallelize`: the
`Transformer`, the `ZeroOptimizer` and the step (`sf.parallel.Pipeline` or
`sf.parallel.accumulate`) composed by hand from the same options. Same
initial parameters (same seed), same batches: the loss trajectories of 3
steps must agree, on data x model, fsdp with ZeRO-3, and pipeline x data.
"""

import doctest
import importlib

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse import planner
from shardfuse.layers.loss import token_loss
from shardfuse.parallel import RunOptions
from shardfuse.parallel.parallelize import parallelize

AXES = ("pipeline", "data", "fsdp", "sequence", "model")
SPEC = sf.models.ModelSpec.tiny(
    vocab_size=64, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, num_layers=2
)
B, T = 8, 16


def _mesh(sizes: dict):
    return jax.make_mesh(tuple(sizes.get(a, 1) for a in AXES), AXES)


def _rows(step, sharding):
    rng = np.random.default_rng(step)
    start = rng.integers(0, 64, (B, 1))
    rows = (start + rng.integers(1, 4, (B, 1)) * np.arange(T + 1)) % 64
    return jax.device_put(rows.astype(np.int32), sharding)


def _by_hand(mesh, zero=0, num_microbatches=1, schedule="1f1b"):
    """The run composed directly from the library's parts (the oracle)."""
    pipelined = mesh.shape["pipeline"] > 1
    model = sf.models.Transformer(SPEC, mesh=mesh, zero=zero, pipelined=pipelined, rngs=nnx.Rngs(0))
    optimizer = sf.parallel.ZeroOptimizer(model, optax.adamw(1e-2), mesh=mesh, zero=zero)
    spec = P(("data", "fsdp"), "sequence")

    @nnx.jit
    def step(model, optimizer, rows, weights=None):
        tokens, targets = rows[:, :-1], rows[:, 1:]
        ring = mesh.shape["sequence"]
        if ring > 1:  # the model reads the sequence in its ring layout (zigzag)
            tokens, targets = (sf.to_ring_layout(x, ring, "zigzag") for x in (tokens, targets))
            if weights is not None:
                weights = sf.to_ring_layout(weights, ring, "zigzag")
        if pipelined:

            def loss_fn(model):
                pipe = sf.parallel.Pipeline(
                    model.blocks, mesh=mesh, schedule=schedule, num_microbatches=num_microbatches
                )
                return pipe.loss(
                    model.embed_tokens(tokens), targets, head=model.head, weights=weights,
                    targets_spec=spec,
                )  # fmt: skip

            loss, grads = nnx.value_and_grad(loss_fn)(model)
        else:
            batch = {"tokens": tokens, "targets": targets}
            if weights is not None:
                batch["weights"] = weights
            loss, grads = sf.parallel.accumulate(
                lambda m, b: token_loss(m(b["tokens"]), b["targets"], b.get("weights")),
                num_microbatches,
                mesh=mesh,
                zero=zero,
                batch_spec=spec,
            )(model, batch)
        optimizer.update(model, grads)
        return loss

    return model, optimizer, step


def _padding(step, sharding):
    """float32 `[B, T]` token weights: each row's last 0 to T / 2 targets are padding (0)."""
    lengths = np.random.default_rng(100 + step).integers(T // 2, T + 1, (B, 1))
    return jax.device_put((np.arange(T) < lengths).astype(np.float32), sharding)


def _trajectory(model, optimizer, step, mesh, steps=3, padded=False):
    batch = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    sharding = NamedSharding(mesh, P(batch))
    with jax.set_mesh(mesh):
        if padded:
            return [
                float(step(model, optimizer, _rows(i, sharding), _padding(i, sharding)))
                for i in range(steps)
            ]
        return [float(step(model, optimizer, _rows(i, sharding))) for i in range(steps)]


def _plan(sizes, **restrict):
    """`sf.plan`'s best plan for SPEC on 8 devices, restricted to the mesh `sizes`."""
    cluster = sf.hardware.cluster("h100", devices_per_node=8)
    mesh = {a: sizes.get(a, 1) for a in AXES}
    plans = planner.plan(
        SPEC,
        cluster,
        global_batch=B,
        seq_len=T,
        assumptions=planner.Assumptions.float32(embedding_sharded=False, donate=False),
        mesh=mesh,
        **restrict,
    )
    assert plans, (sizes, restrict)
    return plans[0]


CASES = [
    pytest.param({"data": 2, "model": 4}, dict(zero=0, num_microbatches=1), id="data-model"),
    pytest.param(
        {"fsdp": 8}, dict(zero=3, num_microbatches=2), id="fsdp-zero3", marks=pytest.mark.slow
    ),
    pytest.param(
        {"pipeline": 2, "data": 4},
        dict(zero=0, num_microbatches=2),
        id="pipeline-data",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("sizes, restrict", CASES)
def test_step_from_a_plan_equals_the_step_by_hand(sizes, restrict):
    plan = _plan(sizes, zero=restrict["zero"])
    options = plan.run_options()
    # the planner's axes: these and the expert axis (size 1 for a dense model)
    assert options.mesh_shape == {a: sizes.get(a, 1) for a in planner.MESH_AXES}
    mesh = plan.mesh()
    run = parallelize(SPEC, plan, mesh, optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(0))
    got = _trajectory(run.model, run.optimizer, run.step, mesh)
    want = _trajectory(
        *_by_hand(
            mesh,
            zero=options.zero,
            num_microbatches=options.num_microbatches,
            schedule=options.schedule,
        ),
        mesh,
    )
    np.testing.assert_allclose(got, want, rtol=2e-5)
    assert got[-1] < got[0], got  # it trains


@pytest.mark.parametrize("sizes, restrict", CASES[:1] + CASES[2:])
def test_step_from_options_equals_the_step_by_hand(sizes, restrict):
    mesh = _mesh(sizes)
    options = RunOptions(**restrict, remat="none")
    run = parallelize(SPEC, options, mesh, optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(0))
    got = _trajectory(run.model, run.optimizer, run.step, mesh)
    want = _trajectory(*_by_hand(mesh, **restrict), mesh)
    np.testing.assert_allclose(got, want, rtol=2e-5)


@pytest.mark.parametrize(
    "sizes, restrict",
    [
        pytest.param(
            {"data": 2, "sequence": 2, "model": 2},
            dict(num_microbatches=2),
            id="data-sequence-model",
        ),
        pytest.param({"pipeline": 2, "data": 4}, dict(num_microbatches=2), id="pipeline-data"),
    ],  # fmt: skip
)
def test_the_step_takes_token_weights(sizes, restrict):
    """The step's token weights (a padding mask, natural order) are those of `accumulate`
    and `Pipeline.loss`: the same trajectory as the step by hand given them, on a ring
    (reordered with the tokens) and on a pipeline; all-ones weights are no weights."""
    mesh = _mesh(sizes)
    options = RunOptions(**restrict)
    run = parallelize(SPEC, options, mesh, optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(0))
    got = _trajectory(run.model, run.optimizer, run.step, mesh, padded=True)
    want = _trajectory(*_by_hand(mesh, **restrict), mesh, padded=True)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    unpadded = _trajectory(*_by_hand(mesh, **restrict), mesh)
    assert not np.allclose(got, unpadded, rtol=1e-3), (got, unpadded)  # the mask counts
    ones = jax.device_put(np.ones((B, T), np.float32), run.batch_sharding)
    rows = _rows(7, run.batch_sharding)
    fresh = parallelize(SPEC, options, mesh, optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(0))
    again = parallelize(SPEC, options, mesh, optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(0))
    with jax.set_mesh(mesh):
        weighted = float(fresh.step(fresh.model, fresh.optimizer, rows, ones))
        plain = float(again.step(again.model, again.optimizer, rows))
    assert weighted == plain, (weighted, plain)


def test_zero3_prefetch_is_a_run_option():
    """`RunOptions(prefetch=True)` reaches the model's `Stack` (ZeRO-3 next-layer gathers)
    and trains as without it (same values and gradients, `shardfuse.layers.prefetch`)."""
    mesh = _mesh({"data": 2, "fsdp": 4})
    options = RunOptions(zero=3)
    runs = [
        parallelize(SPEC, options.replace(prefetch=prefetch), mesh,
                    optimizer=optax.adamw(1e-2), rngs=nnx.Rngs(0))
        for prefetch in (True, False)
    ]  # fmt: skip
    assert runs[0].model.blocks.prefetch and not runs[1].model.blocks.prefetch
    got, want = (_trajectory(run.model, run.optimizer, run.step, mesh) for run in runs)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    with pytest.raises(ValueError, match="prefetch='yes' must be True or False"):
        RunOptions(prefetch="yes")


def test_the_layer_options_derive_from_the_run_options():
    mesh = _mesh({"fsdp": 8})
    options = RunOptions(zero=3, remat="selective", prefetch=True, sequence_parallel=False)
    layer = options.layer_options(mesh, dtype="bfloat16")
    assert (layer.zero, layer.remat, layer.prefetch, layer.sequence_parallel) == (
        3, "selective", True, False
    )  # fmt: skip
    assert layer.mesh is mesh and layer.dtype == np.dtype("bfloat16")
    run = parallelize(SPEC, options.replace(prefetch=False), mesh, rngs=nnx.Rngs(0))
    assert run.model.options == options.replace(prefetch=False).layer_options(mesh)


def test_microbatches_is_a_deprecated_spelling_of_num_microbatches():
    with pytest.warns(DeprecationWarning, match=r"RunOptions\(microbatches=\.\.\.\) is deprecated"):
        assert RunOptions(microbatches=3) == RunOptions(num_microbatches=3)
    with pytest.warns(DeprecationWarning, match="RunOptions.microbatches is deprecated"):
        assert RunOptions(num_microbatches=3).microbatches == 3
    with pytest.raises(TypeError, match="got both microbatches= .deprecated. and num_microbat"):
        RunOptions(microbatches=3, num_microbatches=3)


@pytest.mark.slow
def test_uneven_layers_are_balanced_over_the_stages():
    spec = SPEC.replace(num_layers=3)
    mesh = _mesh({"pipeline": 2, "data": 4})
    run = parallelize(spec, RunOptions(num_microbatches=2), mesh, rngs=nnx.Rngs(0))
    assert run.stage_layers == sf.parallel.balance_stages([1.0] * 3, 2) == (2, 1)
    losses = _trajectory(run.model, run.optimizer, run.step, mesh, steps=2)
    assert np.all(np.isfinite(losses)), losses


def test_a_plan_for_another_mesh_is_refused():
    plan = _plan({"data": 2, "model": 4})
    with pytest.raises(ValueError, match="does not match the plan's mesh"):
        parallelize(SPEC, plan, _mesh({"data": 8}))


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="plan_or_options"):
        parallelize(SPEC, {"zero": 1}, _mesh({"data": 8}))
    with pytest.raises(ValueError, match="zero=5"):
        RunOptions(zero=5)
    with pytest.raises(ValueError, match="schedule="):
        RunOptions(schedule="nope")
    with pytest.raises(ValueError, match="num_microbatches=0"):
        RunOptions(num_microbatches=0)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved'"):
        RunOptions(virtual_stages=2)
    with pytest.raises(ValueError, match="layout='spiral' is not one of"):
        RunOptions(layout="spiral")
    # named at parallelize, as RunOptions and Pipeline both spell them (the step's trace
    # named them too late, or "stages=4 must be an int from 1 to the 3 layers")
    pipeline = _mesh({"pipeline": 2, "data": 4})
    named = r"num_microbatches=1 must be >= the number of pipeline stages p=2"
    with pytest.raises(ValueError, match=named):
        parallelize(SPEC, RunOptions(), pipeline)
    with pytest.raises(ValueError, match="spec.num_layers=3 is fewer than the mesh's 4 pipeline"):
        parallelize(SPEC.replace(num_layers=3), RunOptions(num_microbatches=4),
                    _mesh({"pipeline": 4, "data": 2}))  # fmt: skip


def test_docstring_examples_run():
    assert doctest.testmod(importlib.import_module("shardfuse.parallel.parallelize")).failed == 0


def test_init_builds_the_model_and_its_spec_is_checked():
    mesh = _mesh({"data": 2, "model": 4})
    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        return sf.models.Transformer(SPEC, rngs=nnx.Rngs(7), **kwargs)

    run = parallelize(SPEC, RunOptions(zero=1), mesh, init=init)
    want = sf.models.Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(7))
    np.testing.assert_array_equal(np.asarray(run.model.embed[...]), np.asarray(want.embed[...]))
    assert seen["options"].zero == 1 and seen["mesh"] is mesh and "rngs" not in seen
    assert seen["options"] == RunOptions(zero=1).layer_options(mesh)
    other = SPEC.replace(num_layers=1)
    with pytest.raises(ValueError, match="init built a model of spec"):
        parallelize(other, RunOptions(), mesh, init=init)
