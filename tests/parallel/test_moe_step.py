"""`parallelize`'s step of a mixture-of-experts model: the training loss holds
`aux_loss_coef x load_balancing_loss + z_loss_coef x router_z_loss` (`RunOptions`), the
step writes the model's `MoEStats` (its metrics), `capacity_factor` reaches the layers.

Oracle: the same spec and parameters on one device, `Transformer.loss` with the same
coefficients; compared: the step's loss and EVERY parameter after one SGD step
(float32, rtol 1e-5 / atol 4e-5), the aux losses and tokens per expert.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.models import ModelSpec, Transformer

RTOL, ATOL = 1e-5, 4e-5
VOCAB, SEQ, BATCH, LR = 32, 8, 8, 0.5
SPEC = ModelSpec.tiny("moe", vocab_size=VOCAB, hidden=16, heads=4, kv_heads=2, ffn_hidden=32,
                      num_layers=2, experts=8, top_k=2, expert_hidden=8,
                      moe_first_dense=1)  # fmt: skip
OPTIONS = sf.parallel.RunOptions(aux_loss_coef=0.05, z_loss_coef=1e-2)


def _mesh(explicit):
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * 2
    return jax.make_mesh((4, 2), ("expert", "data"), axis_types=types)


def _rows():
    return np.asarray(jax.random.randint(jax.random.key(3), (BATCH, SEQ + 1), 0, VOCAB))


def _one_device_step(params, rows):
    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    model = Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(1))
    nnx.update(model, params)
    batch = {"tokens": rows[:, :-1], "targets": rows[:, 1:]}

    def loss(model):
        total, count = model.loss(batch, aux_loss_coef=OPTIONS.aux_loss_coef,
                                  z_loss_coef=OPTIONS.z_loss_coef)  # fmt: skip
        return total / count

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    stats = sf.layers.moe_stats(model)
    after = jax.tree.map(lambda p, g: p - LR * g, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                         nnx.to_pure_dict(grads))  # fmt: skip
    return value, after, stats


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_moe_step_trains_the_aux_losses_and_reports_them(explicit):
    mesh = _mesh(explicit)
    run = sf.parallel.parallelize(SPEC, OPTIONS, mesh, optimizer=optax.sgd(LR))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(run.model, nnx.Param)))
    rows = _rows()
    value, after, stats = _one_device_step(params, rows)
    with jax.set_mesh(mesh):
        loss = run.step(run.model, run.optimizer, jax.device_put(rows, run.batch_sharding))
    got = sf.layers.moe_stats(run.model)
    np.testing.assert_allclose(loss, value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["load_balancing_loss"], stats["load_balancing_loss"],
                               rtol=RTOL, atol=ATOL)  # fmt: skip
    np.testing.assert_allclose(got["router_z_loss"], stats["router_z_loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(np.stack(got["tokens_per_expert"]),
                                  np.stack(stats["tokens_per_expert"]))  # fmt: skip
    assert int(np.sum(got["tokens_per_expert"])) == BATCH * SEQ * 2
    new = nnx.to_pure_dict(nnx.state(run.model, nnx.Param))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(new),
        jax.tree_util.tree_leaves_with_path(after),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))  # fmt: skip


def test_capacity_factor_reaches_the_layers_and_drops_are_counted():
    mesh = _mesh(True)
    run = sf.parallel.parallelize(SPEC, OPTIONS.replace(capacity_factor=0.25), mesh)
    moe = run.model.blocks.runs[1].blocks.mlp
    assert moe.capacity_factor == 0.25
    with jax.set_mesh(mesh):
        loss = run.step(run.model, run.optimizer, jax.device_put(_rows(), run.batch_sharding))
    assert np.isfinite(float(loss))
    assert int(sf.layers.moe_stats(run.model)["dropped_tokens"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_moe_step_under_zero_on_three_axes_equals_one_device(zero):
    """expert x fsdp x data, ZeRO 1-3 (zero=2: the layer scan reduce-scatters each MoE
    layer's gradients; zero=3: expert kernels gathered over fsdp just in time)."""
    mesh = jax.make_mesh((2, 2, 2), ("expert", "fsdp", "data"))
    run = sf.parallel.parallelize(SPEC, OPTIONS.replace(zero=zero), mesh, optimizer=optax.sgd(LR))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(run.model, nnx.Param)))
    rows = _rows()
    value, after, _ = _one_device_step(params, rows)
    with jax.set_mesh(mesh):
        loss = run.step(run.model, run.optimizer, jax.device_put(rows, run.batch_sharding))
    np.testing.assert_allclose(loss, value, rtol=RTOL, atol=ATOL)
    new = nnx.to_pure_dict(nnx.state(run.model, nnx.Param))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(after), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_moe_step_over_microbatches_weighs_each_microbatchs_aux_loss_by_its_tokens():
    """num_microbatches=2: each microbatch's aux losses are of its own tokens (the
    routing of a microbatch), added to the loss weighted by its token count, exactly
    as the one-device oracle computes per microbatch (not the whole batch's aux)."""
    mesh = _mesh(True)
    run = sf.parallel.parallelize(SPEC, OPTIONS.replace(num_microbatches=2), mesh,
                                  optimizer=optax.sgd(LR))  # fmt: skip
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(run.model, nnx.Param)))
    rows = np.asarray(jax.random.randint(jax.random.key(4), (2 * BATCH, SEQ + 1), 0, VOCAB))
    # device d holds rows 2d, 2d + 1; microbatch m is every device's m-th row: rows[m::2]
    one = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    model = Transformer(SPEC, mesh=one, rngs=nnx.Rngs(1))
    nnx.update(model, params)

    def loss(model):
        totals, counts, aux = 0.0, 0.0, []
        for m in range(2):
            part = rows[m::2]
            total, count = model.loss({"tokens": part[:, :-1], "targets": part[:, 1:]},
                                      aux_loss_coef=OPTIONS.aux_loss_coef,
                                      z_loss_coef=OPTIONS.z_loss_coef)  # fmt: skip
            totals, counts = totals + total, counts + count
            aux.append(sf.layers.moe_stats(model)["load_balancing_loss"])
        return totals / counts, sum(aux) / 2

    (value, aux), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    with jax.set_mesh(mesh):
        got = run.step(run.model, run.optimizer, jax.device_put(rows, run.batch_sharding))
    np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL)
    stats = sf.layers.moe_stats(run.model)
    np.testing.assert_allclose(stats["load_balancing_loss"], aux, rtol=RTOL, atol=ATOL)
    assert int(np.sum(stats["tokens_per_expert"])) == 2 * BATCH * SEQ * 2  # summed
    after = jax.tree.map(lambda p, g: p - LR * g, params, nnx.to_pure_dict(grads))
    new = nnx.to_pure_dict(nnx.state(run.model, nnx.Param))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(after), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
