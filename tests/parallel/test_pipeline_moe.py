"""MoE blocks in every pipeline schedule: loss, aux losses and gradients == one device.

`sf.models.Transformer(spec_with_experts, pipelined=True)`, its blocks in a
`Pipeline`, on a composed mesh (with and without an expert axis, Explicit and
Auto axes) against the same parameters on a 1-device mesh, unpipelined: the
oracle is the non-pipelined step's definition (`accumulate`'s
`(sum_i loss_sum_i + count_i x aux_i) / sum_i count_i`, `count_i` microbatch
i's token weight), over the pipeline's microbatches (rows i, i + m, ... of the
batch). Padding weights make the microbatches' token counts uneven, so that an
aux loss averaged or summed per microbatch instead of weighted by its tokens
differs (the planted mutation below shows the comparison catches it). The loss,
the aux term alone and EVERY gradient leaf (router included) within the
pipeline tests' rtol 1e-5 / atol 4e-5. The default slice is one composed case
and the mutation; `-m slow` runs the matrix (every pair of schedule, expert axis
or not, Explicit or Auto; stored residuals).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import token_loss
from shardfuse.layers.moe import MoEStats, moe_aux_loss
from shardfuse.parallel.pipeline import program
from shardfuse.parallel.pipeline.api import Pipeline
from tests.pairwise import pairwise
from tests.parallel.pipeline_models import ATOL, RTOL, assert_trees_close

AUX, Z = 0.3, 0.05  # large enough that the aux terms matter at the tolerance
VOCAB, SEQ = 32, 8


def moe_spec(layers: int) -> sf.models.ModelSpec:
    return sf.models.ModelSpec.tiny("pipeline-moe", vocab_size=VOCAB, hidden=16, heads=4,
                                    kv_heads=4, ffn_hidden=32, num_layers=layers, experts=4,
                                    top_k=2)  # fmt: skip


def make_model(mesh, layers):
    return sf.models.Transformer(
        moe_spec(layers), mesh=mesh, pipelined=True, layout="contiguous", rngs=nnx.Rngs(0)
    )


def batch(size, m):
    """Tokens, targets and padding weights; microbatch i (rows i, i + m, ...) keeps about
    1 / (i + 1) of its tokens: uneven token counts per microbatch."""
    tokens = jax.random.randint(jax.random.key(3), (size, SEQ), 0, VOCAB)
    targets = jax.random.randint(jax.random.key(4), (size, SEQ), 0, VOCAB)
    keep = 1.0 / (1 + jnp.arange(size) % m)[:, None]
    weights = (jax.random.uniform(jax.random.key(6), (size, SEQ)) < keep).astype(jnp.float32)
    return tokens, targets, weights


def pipelined_loss(model, tokens, targets, weights, *, schedule, m, v, residuals, coefs,
                   return_stats=False):  # fmt: skip
    mesh = model.mesh
    names = mesh.axis_names
    pipe = Pipeline(model.blocks, mesh=mesh, schedule=schedule, num_microbatches=m,
                    virtual_stages=v, residuals=residuals)  # fmt: skip
    batch_axes = tuple(a for a in ("data", "expert") if a in names) or None
    return pipe.loss(model.embed_tokens(tokens), targets, head=model.head, weights=weights,
                     targets_spec=P(batch_axes), aux_loss_coef=coefs[0],
                     z_loss_coef=coefs[1], return_stats=return_stats)  # fmt: skip


def reference_loss(model, tokens, targets, weights, *, m, coefs, aux_only=False):
    """The unpipelined definition: per microbatch `sum + count x aux`, over all counts."""
    total, count = 0.0, 0.0
    for i in range(m):
        s, c = token_loss(model(tokens[i::m]), targets[i::m], weights[i::m])
        aux = c * moe_aux_loss(model, *coefs)
        total, count = total + (aux if aux_only else s + aux), count + c
    return total / count


def one_device_copy(model, names):
    mesh1 = jax.make_mesh(
        (1,) * len(names),
        names,
        devices=jax.devices()[:1],
        axis_types=(AxisType.Auto,) * len(names),
    )
    reference = sf.models.Transformer(
        model.spec, mesh=mesh1, pipelined=False, layout="contiguous", rngs=nnx.Rngs(0)
    )
    nnx.update(reference, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    return reference


def run_case(shape, names, *, explicit=True, schedule="1f1b", m=2, v=1, residuals="recompute"):
    """`(pipelined (loss, grads), reference (loss, grads), model, reference, batch)`."""
    types = None if explicit else (AxisType.Auto,) * len(shape)
    mesh = jax.make_mesh(shape, names, axis_types=types, devices=jax.devices()[: np.prod(shape)])
    p = mesh.shape["pipeline"]
    model = make_model(mesh, p * v)
    reference = one_device_copy(model, names)
    rows = m * int(np.prod([mesh.shape[a] for a in ("data", "expert") if a in names]))
    data = batch(rows, m)
    settings = dict(schedule=schedule, m=m, v=v, residuals=residuals, coefs=(AUX, Z))
    got = nnx.jit(nnx.value_and_grad(lambda mo, *b: pipelined_loss(mo, *b, **settings)))(
        model, *data
    )
    return got, oracle(reference, names, m, data), model, reference, data


_ORACLE = {}


def _digest(arrays):
    digest = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        digest.update(repr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return digest.hexdigest()


def oracle(reference, names, m, data):
    """The one-device `(loss, grads)`, once per mesh axis names, m, parameter values and batch
    (bitwise digests): the matrix's schedules and axis types with the same model and batch
    share it (`make_model` draws the same values on every mesh)."""
    params = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    key = (names, m, _digest(params), _digest(data))
    if key not in _ORACLE:
        loss = lambda mo, *b: reference_loss(mo, *b, m=m, coefs=(AUX, Z))  # noqa: E731
        _ORACLE[key] = nnx.jit(nnx.value_and_grad(loss))(reference, *data)
    return _ORACLE[key]


def check_case(shape, names, **kwargs):
    (loss, grads), (want_loss, want_grads), *_ = run_case(shape, names, **kwargs)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, want_grads)
    router = grads["blocks"]["blocks"]["mlp"]["router"][...]
    assert float(jnp.abs(router).max()) > 0  # the router is trained


EXPERT_MESH = ((2, 2, 2), ("pipeline", "expert", "data"))
DATA_MESH = ((2, 4), ("pipeline", "data"))


def test_expert_data_pipeline_1f1b_matches_one_device_loss_aux_and_every_gradient():
    (loss, grads), (want_loss, want_grads), model, reference, data = run_case(*EXPERT_MESH, m=2)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, want_grads)
    assert float(jnp.abs(grads["blocks"]["blocks"]["mlp"]["router"][...]).max()) > 0
    # the aux term alone: the pipelined loss with and without the coefficients
    settings = dict(schedule="1f1b", m=2, v=1, residuals="recompute")
    task = nnx.jit(lambda mo, *b: pipelined_loss(mo, *b, **settings, coefs=(0.0, 0.0)))(
        model, *data
    )
    want_aux = nnx.jit(lambda mo, *b: reference_loss(mo, *b, m=2, coefs=(AUX, Z), aux_only=True))(
        reference, *data
    )
    assert float(want_aux) > 10 * ATOL
    np.testing.assert_allclose(loss - task, want_aux, rtol=1e-4, atol=ATOL)


@pytest.mark.slow
def test_pipeline_returns_the_layers_stats_averaged_over_microbatches():
    """`return_stats`: each layer's statistics, floats averaged over the microbatches and
    counts summed (as `accumulate` reports them), equal to the one-device model's."""
    mesh = jax.make_mesh(*EXPERT_MESH)
    model = make_model(mesh, 2)
    reference = one_device_copy(model, EXPERT_MESH[1])
    m = 2
    tokens, targets, weights = batch(4 * m, m)
    settings = dict(schedule="gpipe", m=m, v=1, residuals="recompute", coefs=(AUX, Z))
    _, stats = nnx.jit(lambda mo, *b: pipelined_loss(mo, *b, **settings, return_stats=True))(
        model, tokens, targets, weights
    )
    per_microbatch = []
    for i in range(m):
        reference(tokens[i::m])
        per_microbatch.append(nnx.to_pure_dict(nnx.state(reference.blocks, MoEStats)))
    want = jax.tree.map(
        lambda *a: sum(a) if jnp.issubdtype(a[0].dtype, jnp.integer) else sum(a) / m,
        *per_microbatch,
    )
    model.blocks.write_stats(stats)
    got = nnx.to_pure_dict(nnx.state(model.blocks, MoEStats))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_flatten_with_path(got)[0],
        jax.tree_util.tree_flatten_with_path(want)[0],
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path))


def _mean_counts(weights):  # aux_i weighted alike: the loss gets mean_i aux_i
    counts = jnp.sum(weights.astype(jnp.float32), axis=(0, 2))
    return jnp.full_like(counts, jnp.mean(counts))


def _total_counts(weights):  # each aux_i weighted by all tokens: the loss gets sum_i aux_i
    counts = jnp.sum(weights.astype(jnp.float32), axis=(0, 2))
    return jnp.full_like(counts, jnp.sum(counts))


@pytest.mark.parametrize(
    "mutation",
    [
        pytest.param(_mean_counts, id="averaged"),
        pytest.param(_total_counts, id="summed", marks=pytest.mark.slow),
    ],
)
def test_aux_not_weighted_by_tokens_is_caught(monkeypatch, mutation):
    """The planted mutation: each microbatch's aux loss counted with the mean token count
    (an unweighted average over microbatches) or the batch's (the aux losses summed per
    microbatch) instead of its own. With uneven counts the loss and the router's
    gradient move by more than the tolerance: the comparison of the cases above fails
    on it."""
    shape, names = (2,), ("pipeline",)
    monkeypatch.setattr(program, "_microbatch_counts", mutation)
    (loss, grads), (want_loss, want_grads), *_ = run_case(shape, names, m=2)
    router = np.asarray(grads["blocks"]["blocks"]["mlp"]["router"][...])
    want_router = np.asarray(want_grads["blocks"]["blocks"]["mlp"]["router"][...])
    assert abs(float(loss) - float(want_loss)) > ATOL + RTOL * abs(float(want_loss))
    assert not np.allclose(router, want_router, rtol=RTOL, atol=ATOL)
    with pytest.raises(AssertionError):
        assert_trees_close(grads, want_grads)


def _matrix():
    """Every pair of (schedule, mesh, axis types): 8 of the 16 combinations (`-m slow`)."""
    schedules = [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2), ("zb-h1", 2, 1)]
    meshes = {"expert": EXPERT_MESH, "data": DATA_MESH}
    for (schedule, m, v), mesh_id, explicit in pairwise(schedules, tuple(meshes), (True, False)):
        shape, names = meshes[mesh_id]
        kind = "explicit" if explicit else "auto"
        yield pytest.param(
            shape, names, explicit, schedule, m, v,
            id=f"{mesh_id}-{kind}-{schedule}-m{m}", marks=pytest.mark.slow,
        )  # fmt: skip


@pytest.mark.parametrize("shape, names, explicit, schedule, m, v", list(_matrix()))
def test_schedule_matrix_matches_one_device(shape, names, explicit, schedule, m, v):
    check_case(shape, names, explicit=explicit, schedule=schedule, m=m, v=v)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, m", [("interleaved", 4)])  # 1f1b: the same stored path
def test_stored_residuals_match_one_device(schedule, m):
    v = 2 if schedule == "interleaved" else 1
    check_case(*EXPERT_MESH, schedule=schedule, m=m, v=v, residuals="stored")


@pytest.mark.slow
def test_pipeline_forward_of_moe_blocks_matches_the_stack():
    mesh = jax.make_mesh(*EXPERT_MESH)
    model = make_model(mesh, 2)
    pipe = Pipeline(model.blocks, mesh=mesh, schedule="1f1b", num_microbatches=2)
    tokens = batch(8, 2)[0]
    x = model.embed_tokens(tokens)
    np.testing.assert_allclose(pipe.forward(x), model.blocks(x), rtol=RTOL, atol=ATOL)


def test_mixed_dense_and_moe_blocks_pipelined_raise_value_error():
    mesh = jax.make_mesh((2,), ("pipeline",), devices=jax.devices()[:2])
    spec = sf.models.ModelSpec.tiny(num_layers=4, experts=4, top_k=2, moe_first_dense=2)
    with pytest.raises(ValueError, match="mixed kinds"):
        sf.models.Transformer(spec, mesh=mesh, pipelined=True, rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved"])  # the quick test runs 1f1b
def test_parallelize_pipelined_moe_step_equals_one_device(schedule):
    """`parallelize` on pipeline 2 x expert 2 x data 2: the step's loss (aux losses
    included), the MoEStats it writes and every parameter after one SGD step equal the
    one-device oracle's over the same microbatches (one row per shard and microbatch:
    rows i, i + m, ..., the unpipelined step's split too)."""
    m, lr = 2, 0.5
    v = 2 if schedule == "interleaved" else 1
    options = sf.parallel.RunOptions(aux_loss_coef=AUX, z_loss_coef=Z, schedule=schedule,
                                     num_microbatches=m, virtual_stages=v)  # fmt: skip
    mesh = jax.make_mesh(*EXPERT_MESH)
    run = sf.parallel.parallelize(moe_spec(2 * v), options, mesh, optimizer=optax.sgd(lr))
    reference = one_device_copy(run.model, EXPERT_MESH[1])
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(run.model, nnx.Param)))
    rows = np.asarray(jax.random.randint(jax.random.key(4), (4 * m, SEQ + 1), 0, VOCAB))
    tokens, targets = rows[:, :-1], rows[:, 1:]
    ones = jnp.ones(targets.shape, jnp.float32)

    def oracle(model):
        lbs = []
        total, count = 0.0, 0.0
        for i in range(m):
            s, c = token_loss(model(tokens[i::m]), targets[i::m], ones[i::m])
            total, count = total + s + c * moe_aux_loss(model, AUX, Z), count + c
            lbs.append(sf.layers.moe_stats(model)["load_balancing_loss"])
        return total / count, sum(lbs) / m

    (want, want_lb), grads = nnx.jit(nnx.value_and_grad(oracle, has_aux=True))(reference)
    with jax.set_mesh(mesh):
        got = run.step(run.model, run.optimizer, jax.device_put(rows, run.batch_sharding))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    stats = sf.layers.moe_stats(run.model)
    np.testing.assert_allclose(stats["load_balancing_loss"], want_lb, rtol=RTOL, atol=ATOL)
    assert int(np.sum(stats["tokens_per_expert"])) == 2 * v * rows.shape[0] * SEQ * 2  # k = 2
    after = jax.tree.map(lambda p, g: p - lr * g, params, nnx.to_pure_dict(grads))
    new = nnx.to_pure_dict(nnx.state(run.model, nnx.Param))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(after), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


class UnevenMoE(nnx.Module):
    """A Stack of 3 MoE blocks over 2 uneven stages (2, 1) and a linear head."""

    def __init__(self, mesh, remat):
        block = lambda rngs: sf.layers.ParallelTransformerBlock(  # noqa: E731
            16, 2, 8, moe=dict(num_experts=4, top_k=2), mesh=mesh, rngs=rngs
        )
        self.stack = sf.layers.Stack(block, 3, mesh=mesh, layer_axis="pipeline",
                                     stage_layers=(2, 1), remat=remat,
                                     rngs=nnx.Rngs(0))  # fmt: skip
        self.head = sf.layers.ColumnParallelLinear(16, VOCAB, mesh=mesh, gather_output=True,
                                                   rngs=nnx.Rngs(1))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full"])  # remat none: the matrix's stages
def test_uneven_stages_skip_the_padding_rows_stats(remat):
    """stage_layers=(2, 1): the padding row's aux losses count nothing; loss and every
    gradient equal the plain stack's over the same microbatches (remat too)."""
    mesh = jax.make_mesh((2, 2), ("pipeline", "expert"), devices=jax.devices()[:4])
    model = UnevenMoE(mesh, remat)
    m = 2
    x = jax.random.normal(jax.random.key(1), (4, SEQ, 16))
    targets = jax.random.randint(jax.random.key(2), (4, SEQ), 0, VOCAB)
    weights = batch(4, m)[2]

    def piped(model):
        pipe = Pipeline(model.stack, mesh=mesh, schedule="1f1b", num_microbatches=m)
        return pipe.loss(x, targets, head=model.head, weights=weights, aux_loss_coef=AUX,
                         z_loss_coef=Z)  # fmt: skip

    def plain(model):
        total, count = 0.0, 0.0
        for i in range(m):
            s, c = token_loss(model.head(model.stack(x[i::m])), targets[i::m], weights[i::m])
            total = total + s + c * moe_aux_loss(model.stack, AUX, Z)
            count = count + c
        return total / count

    loss, grads = nnx.jit(nnx.value_and_grad(piped))(model)
    want, want_grads = nnx.jit(nnx.value_and_grad(plain))(model)
    np.testing.assert_allclose(loss, want, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, want_grads)
