"""Generated differential test of `sf.parallel.Pipeline` against the unpipelined model.

Hypothesis draws schedule ("gpipe", "1f1b", "interleaved", "zb-h1") x pipeline size
p in {1, 2, 4} x microbatches m x virtual stages v x residuals ("recompute", "stored") x
mesh (pipeline alone, pipeline x model, data x pipeline, pipeline x sequence x model;
Explicit or Auto axes) x eager or `nnx.jit`, and the model: a residual MLP of `nnx.Linear`s
(tied or untied head) or `ParallelTransformerBlock`s (remat policy, sequence parallelism,
activation, GQA) with a norm and a tensor-parallel vocabulary head
(`strategies_model.pipeline_cases`).

Oracle: the same parameters, no pipeline and no sharding, on one device: the embedding,
the layers looped with plain jnp (`shardfuse.layers.reference` for the transformer), the
head, token-weighted cross entropy. It depends on the model only, never on the schedule or
the mesh, so it is computed once per model configuration (and parameter values) and
cached. Compared: the loss and EVERY gradient leaf (embedding, stack, head), float32,
rtol 1e-5 / atol 4e-5 (TESTING.md, the toolkit rule). A drawn refusal must raise a
ValueError naming the argument.
"""

import contextlib
import hashlib
import re
from collections import Counter

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import reference
from shardfuse.layers.loss import token_loss
from shardfuse.layers.stack import Stack
from shardfuse.parallel.pipeline import program
from shardfuse.parallel.pipeline.api import Pipeline
from tests.differential.budget import assert_catches, budget_params, run, settings
from tests.differential.strategies_model import PipelineCase, pipeline_cases

RTOL, ATOL = 1e-5, 4e-5
FEATURES, HIDDEN, VOCAB = 16, 32, 24
BATCH, SEQ = 16, 8  # fixed: every (m, data) the strategy draws divides it, so one oracle
STATS = Counter()
_ORACLES: dict = {}  # (model key, parameter digest) -> (loss, gradients)


class ResidualMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, FEATURES, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class TiedHead(nnx.Module):
    def __init__(self, embed):
        self.embed = embed

    def __call__(self, y):
        return y @ self.embed[...].T


class Model(nnx.Module):
    """Embedding -> `Pipeline` over a `Stack` -> head, built from a `PipelineCase`."""

    def __init__(self, case: PipelineCase, mesh):
        names = mesh.axis_names
        sequence = "sequence" if "sequence" in names else None
        data = "data" if "data" in names else None
        block = dict(case.block)
        embed = jax.random.normal(jax.random.key(5), (VOCAB, FEATURES)) * 0.5
        self.embed = nnx.Param(jax.device_put(embed, NamedSharding(mesh, P())))
        if case.model == "mlp":
            stack = Stack(ResidualMLP, case.layers, mesh=mesh, layer_axis="pipeline",
                          rngs=nnx.Rngs(0))  # fmt: skip
            io_spec = P()
            self.head = (
                TiedHead(self.embed) if case.tied else nnx.Linear(FEATURES, VOCAB, rngs=nnx.Rngs(1))
            )
            self.targets_spec = P()
        else:  # the blocks and head of an sf.models.Transformer of the drawn configuration
            spec = sf.models.ModelSpec.tiny("diff", vocab_size=VOCAB, hidden=FEATURES, heads=4,
                                            kv_heads=block["num_kv_heads"], ffn_hidden=HIDDEN,
                                            num_layers=case.layers,
                                            activation=block["activation"])  # fmt: skip
            lm = sf.models.Transformer(
                spec,
                mesh=mesh,
                pipelined=True,
                layout="contiguous",
                sequence_parallel=block["sequence_parallel"],
                remat=block["remat"],
                rngs=nnx.Rngs(0),
            )
            stack, self.head = lm.blocks, lm.head
            io_spec = None
            self.targets_spec = P(data, sequence)
        self.pipe = Pipeline(
            stack,
            mesh=mesh,
            schedule=case.schedule,
            num_microbatches=case.m,
            virtual_stages=case.v,
            io_spec=io_spec,
            residuals=case.residuals,
        )

    def loss(self, tokens, targets, weights):
        x = jnp.take(self.embed[...], tokens, axis=0)
        return self.pipe.loss(
            x, targets, head=self.head, weights=weights, targets_spec=self.targets_spec
        )


def make_mesh(case):
    names = tuple(a for a, _ in case.mesh)
    shape = tuple(s for _, s in case.mesh)
    types = (AxisType.Explicit if case.explicit else AxisType.Auto,) * len(names)
    return jax.make_mesh(
        shape, names, axis_types=types, devices=jax.devices()[: int(np.prod(shape))]
    )


def batch():
    tokens = jax.random.randint(jax.random.key(3), (BATCH, SEQ), 0, VOCAB)
    targets = jax.random.randint(jax.random.key(4), (BATCH, SEQ), 0, VOCAB)
    weights = (jax.random.uniform(jax.random.key(6), (BATCH, SEQ)) > 0.2).astype(jnp.float32)
    return tokens, targets, weights


def _dense(x, kernel, bias=None):
    y = jnp.einsum("BTC,CN->BTN", x, kernel, precision=lax.Precision.HIGHEST)
    return y if bias is None else y + bias


def oracle_loss(model: Model, case: PipelineCase):
    """`loss(params, tokens, targets, weights)`: the model unpipelined, in plain jnp.

    `model` supplies only static options (the blocks' and the head's); `params` is
    `nnx.to_pure_dict(nnx.state(model, nnx.Param))` on one device.
    """
    blocks = model.pipe.stack.blocks

    def loss(params, tokens, targets, weights):
        x = jnp.take(params["embed"], tokens, axis=0)
        stacked = params["pipe"]["stack"]["blocks"]
        for i in range(case.layers):
            p = jax.tree.map(lambda a, i=i: a[i], stacked)
            if case.model == "mlp":
                h = jnp.tanh(_dense(x, p["up"]["kernel"], p["up"]["bias"]))
                x = x + _dense(h, p["down"]["kernel"], p["down"]["bias"])
            else:
                x = reference.transformer_block(blocks, p, x)
        head = params.get("head")  # a tied head holds no parameter of its own
        if case.model == "mlp" and case.tied:
            logits = jnp.einsum("BTF,VF->BTV", x, params["embed"], precision="highest")
        elif case.model == "mlp":
            logits = _dense(x, head["kernel"], head["bias"])
        else:
            y = reference.norm(model.head.norm, head["norm"], x)
            logits = reference.linear(model.head.unembed, head["unembed"], y)
        total, count = token_loss(logits, targets, weights)
        return total / count

    return loss


def _host_params(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _digest(tree) -> str:
    h = hashlib.sha1()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def oracle(model: Model, case: PipelineCase):
    """(loss, gradients) of the unpipelined model on device 0, cached per model config."""
    params = _host_params(model)
    key = (case.model_key, _digest(params))
    if key not in _ORACLES:
        STATS["oracle:computed"] += 1
        device = jax.devices()[0]
        params = jax.device_put(params, device)
        data = jax.device_put(batch(), device)
        _ORACLES[key] = jax.jit(jax.value_and_grad(oracle_loss(model, case)))(params, *data)
    return _ORACLES[key]


def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def check_pipeline(case: PipelineCase, *, jit: bool = True):
    """The differential check of one drawn pipeline configuration."""
    STATS["pipeline:drawn"] += 1
    mesh = make_mesh(case)
    if case.refusal is not None:
        STATS["pipeline:refused"] += 1
        _, match = case.refusal
        with pytest.raises(ValueError, match=re.escape(match)):
            Model(case, mesh)
        return
    model = Model(case, mesh)
    tokens, targets, weights = batch()
    grad_fn = nnx.value_and_grad(Model.loss)
    if jit:
        grad_fn = nnx.jit(grad_fn)
    # Eager autodiff on Explicit axes needs the mesh in context (JAX's rule, see the layers).
    context = jax.set_mesh(mesh) if case.explicit and not jit else contextlib.nullcontext()
    with context:
        loss, grads = grad_fn(model, tokens, targets, weights)
    expected_loss, expected = oracle(model, case)
    assert np.isfinite(float(expected_loss)) and np.isfinite(float(loss)), (loss, expected_loss)
    np.testing.assert_allclose(float(loss), float(expected_loss), rtol=RTOL, atol=ATOL)
    got, want = _flat(nnx.to_pure_dict(grads)), _flat(expected)
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key in want:
        g, e = np.asarray(got[key]), np.asarray(want[key])
        assert np.all(np.isfinite(g)) and np.all(np.isfinite(e)), key
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, err_msg=f"gradient {key}")


def _check_drawn(case_and_jit):
    case, jit = case_and_jit
    check_pipeline(case, jit=jit)


@pytest.mark.parametrize("max_examples", budget_params(2, 6))
def test_pipeline_matches_unpipelined(max_examples):
    run(
        _check_drawn,
        hypothesis.strategies.tuples(pipeline_cases(), hypothesis.strategies.booleans()),
        max_examples,
    )


# ---- planted bugs --------------------------------------------------------------------------


def _swap_activation_microbatches(monkeypatch):
    """The split into microbatches exchanges microbatches 0 and 1 of the activations (not
    of the targets): two microbatches' losses are computed against each other's targets.

    Microbatch i is rows i, i + m, ... of the batch (`Pipeline`'s documented split), so the
    swap is a row permutation before the split, whatever layout the split itself uses.
    """
    original = program._microbatches

    def swapped(x, m):
        if x.ndim == 3 and m > 1:
            rows = np.arange(x.shape[0])
            first, second = rows % m == 0, rows % m == 1
            x = x[np.where(first, rows + 1, np.where(second, rows - 1, rows))]
        return original(x, m)

    monkeypatch.setattr(program, "_microbatches", swapped)


def _drop_stage0_weight_gradient(monkeypatch):
    """Stage 0 accumulates no parameter gradient (its forward is unchanged)."""
    original = program._stage_fn

    def stage_fn(config, *args, **kwargs):
        stage = original(config, *args, **kwargs)

        def dropped(chunk_state, x):
            first = lax.axis_index(config.pipeline_axis) == 0
            chunk_state = jax.tree.map(
                lambda a: jnp.where(first, lax.stop_gradient(a), a), chunk_state
            )
            return stage(chunk_state, x)

        return dropped

    monkeypatch.setattr(program, "_stage_fn", stage_fn)


PIPELINE_MUTATIONS = {
    "swap_activation_microbatches": (
        _swap_activation_microbatches,
        pipeline_cases().filter(lambda c: c.refusal is None and c.m > 1),
    ),
    "drop_stage0_weight_gradient": (
        _drop_stage0_weight_gradient,
        pipeline_cases().filter(lambda c: c.refusal is None and c.p > 1),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(PIPELINE_MUTATIONS))
def test_generator_catches_planted_bugs(mutation, monkeypatch):
    """Under each planted bug, the generated pipeline check fails on the drawn configurations."""
    plant, strategy = PIPELINE_MUTATIONS[mutation]
    assert_catches(plant, check_pipeline, strategy, 2, monkeypatch)


def test_pipeline_strategy_is_mostly_valid():
    @settings(200)
    @hypothesis.given(pipeline_cases())
    def count(case):
        STATS["strategy:drawn"] += 1
        STATS["strategy:refused"] += case.refusal is not None

    STATS["strategy:drawn"] = STATS["strategy:refused"] = 0
    count()
    assert STATS["strategy:refused"] <= 0.2 * STATS["strategy:drawn"], STATS
