"""`sf.models.Transformer` of a mixture-of-experts `ModelSpec`.

Oracles: (1) the same spec and parameters on a 1-device mesh, for the sharded model on
`expert=4, data=2` (Explicit and Auto axes): logits, the loss with the aux losses in
it, the aux losses and tokens per expert, EVERY gradient leaf (float32, rtol 1e-5 /
atol 4e-5); (2) for the 1-device model, the unsharded reference blocks
(`sf.layers.reference.transformer_block`, its MoE the explicit per-expert loop) applied
in a Python loop. The spec mixes kinds: a first dense block, then MoE blocks (shared
expert, gated) as one `Stack` of the same kind (`BlockRuns`).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.layers import reference
from shardfuse.models import ModelSpec, Transformer
from shardfuse.models.block_runs import BlockRuns
from tests.parallel.pipeline_models import assert_trees_close

RTOL, ATOL = 1e-5, 4e-5
VOCAB, SEQ, BATCH = 32, 8, 8
AUX, Z = 0.01, 1e-3
SPEC = ModelSpec.tiny("moe", vocab_size=VOCAB, hidden=16, heads=4, kv_heads=2, ffn_hidden=32,
                      num_layers=3, experts=8, top_k=2, expert_hidden=8, shared_experts=1,
                      shared_expert_hidden=16, shared_expert_gate=True,
                      moe_first_dense=1)  # fmt: skip


def _mesh(shape, names, explicit=True):
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(names)
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)


def _batch():
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ), 0, VOCAB)
    targets = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    return dict(tokens=tokens, targets=targets)


def _loss(model, batch):
    total, count = model.loss(batch)
    stats = sf.layers.moe_stats(model)
    aux = AUX * stats["load_balancing_loss"] + Z * stats["router_z_loss"]
    return total / count + aux, (
        stats["load_balancing_loss"],
        jnp.stack(stats["tokens_per_expert"]),
    )


def _one_device(model, names):
    mesh = _mesh((1,) * len(names), names, explicit=False)
    one = Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(1))
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.update(one, jax.tree.map(np.asarray, values))
    return one


@pytest.mark.parametrize(
    "explicit, shape, names",
    [
        (True, (4, 2), ("expert", "data")),
        (False, (4, 2), ("expert", "data")),
        pytest.param(True, (2, 2, 2), ("expert", "data", "model"), marks=pytest.mark.slow),
    ],
    ids=["explicit", "auto", "expert-data-model"],
)
def test_moe_transformer_on_an_expert_mesh_equals_one_device(explicit, shape, names):
    mesh = _mesh(shape, names, explicit)
    model = Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(0))
    assert isinstance(model.blocks, BlockRuns)
    assert [(run.num_layers, run.has_moe) for run in model.blocks.runs] == [(1, False), (2, True)]
    moe = model.blocks.runs[1].blocks.mlp
    assert moe.gate_up.shape == (2, 8, 16, 16)  # [L, E, F, 2 H]
    assert moe.shared_up.shape == (2, 16, 32)  # S = 1 x shared_expert_hidden
    assert tuple(moe.gate_up[...].sharding.spec)[:2] == (None, "expert")  # [L, E, ...]
    batch = _batch()
    one = _one_device(model, names)
    with jax.set_mesh(mesh):
        logits = model(batch["tokens"])
        (loss, aux), grads = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))(model, batch)
    ref_logits = one(batch["tokens"])
    (ref_loss, ref_aux), ref_grads = nnx.jit(nnx.value_and_grad(_loss, has_aux=True))(one, batch)
    np.testing.assert_allclose(logits, ref_logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux[0], ref_aux[0], rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(aux[1], ref_aux[1])
    assert aux[1].shape == (2, 8) and int(aux[1].sum()) == 2 * BATCH * SEQ * 2
    assert_trees_close(grads, ref_grads)


def test_one_device_moe_transformer_equals_the_reference_blocks():
    mesh = _mesh((1,), ("data",), explicit=False)
    model = Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(0))
    tokens = _batch()["tokens"]
    x = jnp.take(model.embed[...], tokens, axis=0)
    aux = 0.0
    for run in model.blocks.runs:
        graphdef, state = nnx.split(run.blocks)
        p_all = nnx.to_pure_dict(nnx.state(run.blocks, nnx.Param))
        for i in range(run.num_layers):
            block = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            p = jax.tree.map(lambda a, i=i: a[i], p_all)
            if run.has_moe:
                h = x + reference.self_attention(
                    block.attention, p["attention"], reference.norm(block.norm_1, p["norm_1"], x)
                )
                y = reference.norm(block.norm_2, p["norm_2"], h)
                aux = aux + reference.moe(block.mlp, p["mlp"], y)[1]["load_balancing_loss"]
            x = reference.transformer_block(block, p, x)
    expected = model.head(x)
    np.testing.assert_allclose(model(tokens), expected, rtol=RTOL, atol=ATOL)
    got = sf.layers.moe_stats(model)["load_balancing_loss"]
    np.testing.assert_allclose(got, aux, rtol=RTOL, atol=ATOL)


def test_all_moe_blocks_are_one_stack():
    mesh = _mesh((2,), ("expert",))
    model = Transformer(SPEC.replace(moe_first_dense=0), mesh=mesh, rngs=nnx.Rngs(0))
    assert isinstance(model.blocks, sf.layers.Stack) and model.blocks.has_moe


def test_bad_expert_meshes_are_named():
    mesh = _mesh((4, 2), ("expert", "data"))
    dense = ModelSpec.tiny(num_layers=1)
    with pytest.raises(ValueError, match="expert axis 'expert' has size 4 but spec.experts=0"):
        Transformer(dense, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="spec.experts=6 must be divisible by the size 4"):
        Transformer(SPEC.replace(experts=6), mesh=mesh, rngs=nnx.Rngs(0))
    pipe = _mesh((2, 2), ("pipeline", "expert"))
    with pytest.raises(ValueError, match="mixed kinds"):  # one Stack per Pipeline
        Transformer(SPEC, mesh=pipe, pipelined=True, rngs=nnx.Rngs(0))
