"""A head (or embedding) whose width is not the block stack's: a ValueError naming both widths.

Issue 24: such a head failed 19 frames deep in flax with a dot_general shape error. The
demo models and `Pipeline.loss` now check the widths before anything is traced.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.demos.llama import LlamaConfig, LlamaLM, LMHead
from shardfuse.demos.tiny_lm import TinyLM
from shardfuse.layers import stack as stack_lib
from shardfuse.layers.stack import Stack
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
        LMHead(WRONG, VOCAB, mesh=mesh, layer_kwargs={}, rngs=nnx.Rngs(1)),
    ):
        with pytest.raises(
            ValueError, match=f"takes {WRONG} features, but the width of the stack is {F}"
        ):
            pipe.loss(x, targets, head=head, targets_spec=jax.P())
    with pytest.raises(ValueError, match=f"features={F}"):  # the input, too
        pipe.loss(jnp.ones((4, 8, WRONG)), targets, head=nnx.Linear(F, VOCAB, rngs=nnx.Rngs(1)))


def test_llama_head_of_another_width():
    mesh = jax.make_mesh((2,), ("data",))
    model = LlamaLM(LlamaConfig(vocab=VOCAB, features=F, heads=2, kv_heads=1, hidden=2 * F,
                                layers=1), mesh=mesh, rngs=nnx.Rngs(0))  # fmt: skip
    model.head = LMHead(WRONG, VOCAB, mesh=mesh, layer_kwargs={}, rngs=nnx.Rngs(1))
    tokens = jnp.zeros((2, 8), jnp.int32)
    match = f"takes {WRONG} features, but the width of the block stack is {F}"
    with pytest.raises(ValueError, match=match):
        model(tokens)
    with pytest.raises(ValueError, match=match):  # and under jit, before the head's matmul
        nnx.jit(lambda model, tokens: model(tokens))(model, tokens)


def test_tiny_lm_head_of_another_width():
    mesh = jax.make_mesh((2,), ("model",))
    model = TinyLM(vocab=VOCAB, features=F, heads=2, kv_heads=2, hidden=2 * F, layers=1,
                   mesh=mesh, rngs=nnx.Rngs(0))  # fmt: skip
    model.head = sf.layers.ColumnParallelLinear(
        WRONG, VOCAB, mesh=mesh, sequence_parallel=True, gather_output=True, rngs=nnx.Rngs(1)
    )
    with pytest.raises(
        ValueError, match=f"takes {WRONG} features, but the width of the blocks is {F}"
    ):
        model(jnp.zeros((2, 8), jnp.int32))
