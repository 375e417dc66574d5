"""Models and the oracle of the pipeline tests.

`mlp_case`: a residual-MLP stack on a pipeline-only mesh (cheap to compile:
the schedule grid). `lm_case`: an `sf.models.Transformer` (embedding, `Stack`
of `ParallelTransformerBlock`s, norm, tensor-parallel vocabulary head) with its
blocks in a `Pipeline`, on a composed mesh, its oracle the same parameters on
a 1-device mesh.
Both compare the loss and EVERY gradient leaf (stack, head, embedding).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import token_loss
from shardfuse.layers.stack import Stack
from shardfuse.models import ModelSpec
from shardfuse.parallel.pipeline.api import Pipeline

RTOL, ATOL = 1e-5, 4e-5
FEATURES, VOCAB = 8, 16


class ResidualMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.down = nnx.Linear(16, FEATURES, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


class MLPModel(nnx.Module):
    """Embedding, pipelined stack of residual MLPs, tied or untied unembedding."""

    def __init__(self, mesh, *, schedule, m, v, layers, tied=False):
        self.embed = nnx.Param(jax.random.normal(jax.random.key(5), (VOCAB, FEATURES)))
        stack = Stack(ResidualMLP, layers, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
        self.pipe = Pipeline(
            stack, mesh=mesh, schedule=schedule, num_microbatches=m, virtual_stages=v, io_spec=P()
        )
        self.head = TiedHead(self.embed) if tied else nnx.Linear(FEATURES, VOCAB, rngs=nnx.Rngs(1))


class TiedHead(nnx.Module):
    def __init__(self, embed):
        self.embed = embed

    def __call__(self, y):
        return y @ self.embed[...].T


def mlp_batch(m, seq=4):
    batch = 2 * m
    tokens = jax.random.randint(jax.random.key(3), (batch, seq), 0, VOCAB)
    targets = jax.random.randint(jax.random.key(4), (batch, seq), 0, VOCAB)
    weights = (jax.random.uniform(jax.random.key(6), (batch, seq)) > 0.2).astype(jnp.float32)
    return tokens, targets, weights


def pipelined_loss(model, tokens, targets, weights, **kwargs):
    x = jnp.take(model.embed[...], tokens, axis=0)
    return model.pipe.loss(x, targets, head=model.head, weights=weights, **kwargs)


def plain_loss(model, tokens, targets, weights):
    """The oracle: the same parameters, no pipeline (the stack as a scan)."""
    x = jnp.take(model.embed[...], tokens, axis=0)
    s, w = token_loss(model.head(model.pipe.stack(x)), targets, weights)
    return s / w


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
    actual = nnx.to_pure_dict(nnx.State(dict(actual.items())))
    expected = nnx.to_pure_dict(nnx.State(dict(expected.items())))
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert [p for p, _ in flat_a] == [p for p, _ in flat_e]
    assert flat_a, "no gradient leaves"
    for (path, a), (_, e) in zip(flat_a, flat_e, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(e)), jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def check_mlp_case(schedule, p, m, v=1, *, tied=False, layers=None, poison=False, forward=True):
    """Pipelined loss and gradients == the plain model's, on a pipeline-only mesh of size p."""
    mesh = jax.make_mesh((p,), ("pipeline",), devices=jax.devices()[:p])
    model = MLPModel(mesh, schedule=schedule, m=m, v=v, layers=layers or p * v, tied=tied)
    tokens, targets, weights = mlp_batch(m)
    if poison:
        _poison(model.pipe)
    loss, grads = nnx.jit(nnx.value_and_grad(pipelined_loss))(model, tokens, targets, weights)
    expected_loss, expected = nnx.jit(nnx.value_and_grad(plain_loss))(
        model, tokens, targets, weights
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, expected)
    if forward:
        x = jnp.take(model.embed[...], tokens, axis=0)
        np.testing.assert_allclose(model.pipe.forward(x), model.pipe.stack(x), rtol=RTOL, atol=ATOL)
    return model


def _poison(pipe):
    """Makes the pipeline fill its buffers and every unused transfer with NaN."""
    pipe.poison_buffers = True


def lm_spec(layers: int, *, tied: bool = False) -> ModelSpec:
    """The LM's spec: width 16, 4 heads, MLP 32, vocabulary 32 (Llama-style; tied or not)."""
    return ModelSpec.tiny("pipeline-lm", vocab_size=VOCAB * 2, hidden=FEATURES * 2, heads=4,
                          kv_heads=4, ffn_hidden=32, num_layers=layers,
                          tied_embeddings=tied)  # fmt: skip


class LM(nnx.Module):
    """An `sf.models.Transformer` whose stacked blocks run in a `Pipeline`."""

    def __init__(self, mesh, *, schedule="1f1b", m=2, v=1, layers=2, tied=False, stage_layers=None):
        names = mesh.axis_names
        self.model = sf.models.Transformer(
            lm_spec(layers, tied=tied),
            mesh=mesh,
            pipelined=True,
            layout="contiguous",
            stage_layers=stage_layers,
            rngs=nnx.Rngs(0),
        )
        self.embed, self.head = self.model.embed, self.model.head
        self.pipe = Pipeline(
            self.model.blocks, mesh=mesh, schedule=schedule, num_microbatches=m, virtual_stages=v
        )
        self.targets_spec = P(*(a if a in names else None for a in ("data", "sequence")))

    def loss(self, tokens, targets):
        x = self.model.embed_tokens(tokens)
        return self.pipe.loss(x, targets, head=self.head, targets_spec=self.targets_spec)

    def plain_loss(self, tokens, targets):
        """The oracle's loss: the same model, its stack as one scan (no pipeline)."""
        s, w = token_loss(self.head(self.pipe.stack(self.model.embed_tokens(tokens))), targets)
        return s / w


def one_device_copy(model, shape, names, **kwargs):
    """The same model and parameters on a 1-device mesh (the oracle)."""
    mesh1 = jax.make_mesh(
        (1,) * len(shape),
        names,
        devices=jax.devices()[:1],
        axis_types=(AxisType.Auto,) * len(names),
    )
    reference = LM(mesh1, **kwargs)
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.update(reference, jax.tree.map(np.asarray, values))
    return reference


_ONE_DEVICE = {}


def digest(tree) -> str:
    """A bitwise digest of a pytree's paths and array values."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        h.update(repr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def one_device_value_and_grad(model, shape, names, tokens, targets, **kwargs):
    """The oracle's `(loss, grads)`: `LM.plain_loss` of `one_device_copy(model, ...)`.

    Computed once per mesh axis names, parameter values and batch (bitwise digests), and
    shared by the schedules, m and axis types that have them in common (`LM` draws the
    same values on every mesh; `plain_loss` runs no pipeline)."""
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    key = (tuple(names), digest(values), digest((tokens, targets)))
    if key not in _ONE_DEVICE:
        reference = one_device_copy(model, shape, names, **kwargs)
        _ONE_DEVICE[key] = nnx.jit(nnx.value_and_grad(LM.plain_loss))(reference, tokens, targets)
    return _ONE_DEVICE[key]


def check_lm_case(shape, names, *, explicit=True, schedule="1f1b", m=2, v=1):
    types = None if explicit else (AxisType.Auto,) * len(shape)
    mesh = jax.make_mesh(shape, names, axis_types=types)
    p = mesh.shape["pipeline"]
    kwargs = dict(schedule=schedule, m=m, v=v, layers=p * v)
    model = LM(mesh, **kwargs)
    batch = m * dict(zip(names, shape, strict=True)).get("data", 1)
    tokens = jax.random.randint(jax.random.key(3), (batch, 8), 0, VOCAB * 2)
    targets = jax.random.randint(jax.random.key(4), (batch, 8), 0, VOCAB * 2)
    loss, grads = nnx.jit(nnx.value_and_grad(LM.loss))(model, tokens, targets)
    expected_loss, expected = one_device_value_and_grad(
        model, shape, names, tokens, targets, **kwargs
    )
    np.testing.assert_allclose(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_trees_close(grads, expected)
