"""Pipelined loss and gradients equal the unpipelined model's, for every schedule.

The oracle runs the same parameters on the same batch without a pipeline
(the stack as one `lax.scan`; for the composed meshes on a 1-device mesh):
loss and every gradient leaf (stack, head, embedding) within rtol 1e-5 /
atol 4e-5 in float32. The default slice is small; under `-m slow` the rows of
the issue's grid (every schedule, p in {2, 4}, m in {p, 2p, 4p}, v in {1, 2}) that
cover every pair of its factors run (`tests/pairwise.py`; SHARDFUSE_FULL_MATRIX=1 runs
the whole grid).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.pairwise import pairwise
from tests.parallel import pipeline_models
from tests.parallel.pipeline_models import check_lm_case, check_mlp_case

# The default slice: the split (zero-bubble) and the plain backward, both wrapping around the
# ring (interleaved), NaN-poisoned buffers and a tied embedding. 1F1B and GPipe run the same
# code path with other tables: in the slow grid.
DEFAULT = [("zb-h1", 2, 4, 1), ("interleaved", 2, 4, 2)]


def _grid():
    """The rows covering every pair of schedule, p and m / p (`tests/pairwise.py`: 12 of
    the 24 cells; SHARDFUSE_FULL_MATRIX=1 gives all). The DEFAULT cells stay in when drawn:
    here they check the forward path too."""
    schedules = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
    for (schedule, v), p, per_stage in pairwise(schedules, (2, 4), (1, 2, 4)):
        yield schedule, p, per_stage * p, v


@pytest.mark.parametrize("schedule, p, m, v", DEFAULT)
def test_schedule_matches_unpipelined_nan_poisoned_tied(schedule, p, m, v):
    # Every buffer starts as NaN and every tick that sends nothing sends NaN.
    # (the forward-only path is checked by the slow grid)
    check_mlp_case(schedule, p, m, v, poison=True, tied=schedule == "interleaved", forward=False)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, p, m, v", list(_grid()))
def test_schedule_grid_matches_unpipelined(schedule, p, m, v):
    check_mlp_case(schedule, p, m, v)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, v", [("1f1b", 1), ("gpipe", 1), ("zb-h1", 1), ("interleaved", 2)]
)
def test_tied_embedding_gets_both_ends(schedule, v):
    check_mlp_case(schedule, 2, 4, v, tied=True, forward=False)


@pytest.mark.slow
def test_interleaved_more_layers_per_chunk():
    check_mlp_case("interleaved", 2, 4, 2, layers=8)


@pytest.mark.parametrize(
    "shape, names, explicit, schedule, m, v",
    [
        pytest.param(
            (2, 2),
            ("pipeline", "model"),
            True,
            "1f1b",
            2,
            1,
            id="pipeline-model-2x2",
        ),
        pytest.param(
            (4, 2),
            ("pipeline", "model"),
            True,
            "1f1b",
            4,
            1,
            id="pipeline-model",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            (2, 4),
            ("data", "pipeline"),
            True,
            "1f1b",
            4,
            1,
            id="data-pipeline",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            (4, 2),
            ("pipeline", "model"),
            False,
            "zb-h1",
            4,
            1,
            id="pipeline-model-auto",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            (2, 2, 2),
            ("pipeline", "sequence", "model"),
            True,
            "interleaved",
            2,
            2,
            id="pipeline-sequence-model",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            (2, 2, 2),
            ("pipeline", "sequence", "model"),
            False,
            "gpipe",
            2,
            1,
            id="pipeline-sequence-model-auto",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_composed_mesh_matches_one_device(shape, names, explicit, schedule, m, v):
    check_lm_case(shape, names, explicit=explicit, schedule=schedule, m=m, v=v)


def test_bad_input_named_before_tracing():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from shardfuse.layers.stack import Stack
    from shardfuse.parallel.pipeline.api import Pipeline
    from tests.parallel.pipeline_models import ResidualMLP

    mesh = jax.make_mesh((2,), ("pipeline",), devices=jax.devices()[:2])
    stack = Stack(ResidualMLP, 4, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
    no_pipeline = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    cases = [
        (dict(mesh=no_pipeline, num_microbatches=2), r"pipeline_axis='pipeline' is not an axis"),
        (dict(mesh=mesh, num_microbatches=1), r"num_microbatches=1 must be >= .* p=2"),
        (
            dict(mesh=mesh, num_microbatches=3, schedule="interleaved", virtual_stages=2),
            r"num_microbatches=3 must be a multiple of .* p=2",
        ),
        (
            dict(mesh=mesh, num_microbatches=4, schedule="interleaved", virtual_stages=4),
            r"num_layers=4 must be divisible by p \* virtual_stages = 2 \* 4 = 8",
        ),
        (dict(mesh=mesh, num_microbatches=2, schedule="zero"), "schedule='zero' must be one of"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            Pipeline(stack, **kwargs)
    pipe = Pipeline(stack, mesh=mesh, num_microbatches=4, io_spec=jax.P())
    x = jnp.ones((6, 4, 8))
    with pytest.raises(ValueError, match=r"batch size 6 .* divisible by num_microbatches=4"):
        pipe.forward(x)
    with pytest.raises(TypeError, match="floating-point activations"):
        pipe.forward(jnp.ones((4, 4, 8), jnp.int32))
    # a sequence split (io_spec) that does not divide T: named, not a raw reshard error
    mesh2 = jax.make_mesh((2, 2), ("pipeline", "model"), devices=jax.devices()[:4])
    stack2 = Stack(ResidualMLP, 4, mesh=mesh2, layer_axis="pipeline", rngs=nnx.Rngs(0))
    pipe2 = Pipeline(stack2, mesh=mesh2, num_microbatches=2, io_spec=jax.P(None, "model"))
    with pytest.raises(ValueError, match=r"sequence length x.shape\[1\]=5 must be divisible by"):
        pipe2.forward(jnp.ones((4, 5, 8)))
    with pytest.raises(ValueError, match=r"targets has shape \(4, 5\)"):
        pipe.loss(
            jnp.ones((4, 4, 8)),
            jnp.ones((4, 5), jnp.int32),
            head=nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
        )


def _program_outputs(jaxpr):
    """Output shapes of every `_train_program` call in a jaxpr (nested ones included)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == "_train_program":
            found.append([v.aval.shape for v in eqn.outvars])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _program_outputs(sub)
    return found


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_input_gradient_only_when_differentiated(schedule):
    # The pipeline keeps the gradient of its input (a buffer of the batch's size) only when
    # the caller differentiates the input: with it (argnums on x, as an embedding before the
    # pipeline would), without it, and undifferentiated, the loss and EVERY gradient leaf
    # equal the plain model's; NaN-poisoned buffers.
    mesh = jax.make_mesh((2,), ("pipeline",), devices=jax.devices()[:2])
    model = pipeline_models.MLPModel(mesh, schedule=schedule, m=4, v=1, layers=2)
    model.pipe.poison_buffers = True
    tokens, targets, weights = pipeline_models.mlp_batch(4)
    x = jnp.take(model.embed[...], tokens, axis=0)

    def pipelined(model, x):
        return model.pipe.loss(x, targets, head=model.head, weights=weights)

    def plain(model, x):
        s, w = pipeline_models.token_loss(model.head(model.pipe.stack(x)), targets, weights)
        return s / w

    rtol, atol = pipeline_models.RTOL, pipeline_models.ATOL
    for argnums in ((0,), (0, 1)):
        loss, grads = nnx.jit(nnx.value_and_grad(pipelined, argnums=argnums))(model, x)
        want_loss, want = nnx.jit(nnx.value_and_grad(plain, argnums=argnums))(model, x)
        np.testing.assert_allclose(loss, want_loss, rtol=rtol, atol=atol)
        pipeline_models.assert_trees_close(grads[0], want[0])
        step = nnx.value_and_grad(pipelined, argnums=argnums)
        (outputs,) = _program_outputs(jax.make_jaxpr(step)(model, x).jaxpr)
        assert (x.shape in outputs) == (argnums == (0, 1)), outputs
        if argnums == (0, 1):  # the input gradient, as the plain model's
            assert np.all(np.isfinite(grads[1]))
            np.testing.assert_allclose(grads[1], want[1], rtol=rtol, atol=atol)
    np.testing.assert_allclose(
        nnx.jit(pipelined)(model, x), nnx.jit(plain)(model, x), rtol=rtol, atol=atol
    )
    (outputs,) = _program_outputs(jax.make_jaxpr(pipelined)(model, x).jaxpr)
    assert x.shape not in outputs, outputs
    np.testing.assert_allclose(model.pipe.forward(x), model.pipe.stack(x), rtol=rtol, atol=atol)
