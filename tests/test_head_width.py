"""A head (or embedding) whose width is not the block stack's: a ValueError naming both widths.

Issue 24: such a head failed 19 frames deep in flax with a dot_general shape error. The
demo models and `Pipeline.loss` now check the widths before anything is traced.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.layers import stack as stack_lib
from shardfuse.layers.stack import Stack
from shardfuse.models import LMHead, ModelSpec, Transformer
from shardfuse.parallel.pipeline.api import Pipeline

F, WRONG, VOCAB = 16, 32, 32


def test_features_of_and_check_head():
    mesh = jax.make_mesh((2,), ("model",))
    assert stack_lib.features_of(nnx.Linear(WRONG, 4, rngs=nnx.Rngs(0))) == WRONG
    assert stack_lib.features_of(sf.layers.Norm(F, mesh=mesh, rngs=nnx.Rngs(0))) == F
    assert stack_lib.features_of(nnx.Dropout(0.1)) is None  # declares no width: not checked
    stack_lib.check_head(nnx.Dropout(0.1), F)
    with pytest.raises(
        ValueError, match=f"takes {WRONG} features, but the width of the stack is {F}"
    ):
        stack_lib.check_head(nnx.Linear(WRONG, 4, rngs=nnx.Rngs(0)), F)


def test_norm_of_the_wrong_width():
    mesh = jax.make_mesh((2,), ("model",))
    norm = sf.layers.Norm(F, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"Norm expects \\[..., features={F}\\]"):
        norm(jnp.ones((2, 4, WRONG)))


def _pipeline():
    mesh = jax.make_mesh((2,), ("pipeline",))

    def block(rngs):
        return sf.layers.ParallelMLP(F, 2 * F, mesh=mesh, rngs=rngs)

    stack = Stack(block, 2, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
    assert stack.features == F
    return mesh, Pipeline(stack, mesh=mesh, schedule="gpipe", num_microbatches=2)


def test_pipeline_head_of_another_width():
    mesh, pipe = _pipeline()
    x, targets = jnp.ones((4, 8, F)), jnp.zeros((4, 8), jnp.int32)
    for head in (
        nnx.Linear(WRONG, VOCAB, rngs=nnx.Rngs(1)),
        _head(WRONG, mesh),
    ):
        with pytest.raises(
            ValueError, match=f"takes {WRONG} features, but the width of the stack is {F}"
        ):
            pipe.loss(x, targets, head=head, targets_spec=jax.P())
    with pytest.raises(ValueError, match=f"features={F}"):  # the input, too
        pipe.loss(jnp.ones((4, 8, WRONG)), targets, head=nnx.Linear(F, VOCAB, rngs=nnx.Rngs(1)))


def _head(width, mesh):
    spec = ModelSpec.tiny(vocab_size=VOCAB, hidden=width, heads=2, kv_heads=1)
    return LMHead(spec, mesh=mesh, sequence_parallel=False, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("names", [("data",), ("model",)])
def test_transformer_head_of_another_width(names):
    mesh = jax.make_mesh((2,), names)
    spec = ModelSpec.tiny(vocab_size=VOCAB, hidden=F, heads=2, kv_heads=1, ffn_hidden=2 * F,
                          num_layers=1)  # fmt: skip
    model = Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))
    model.head = _head(WRONG, mesh)
    tokens = jnp.zeros((2, 8), jnp.int32)
    match = f"takes {WRONG} features, but the width of the block stack is {F}"
    with pytest.raises(ValueError, match=match):
        model(tokens)
    with pytest.raises(ValueError, match=match):  # and under jit, before the head's matmul
        nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
