"""Pipelined loss and gradients equal the unpipelined model's, for every schedule.

The oracle runs the same parameters on the same batch without a pipeline
(the stack as one `lax.scan`; for the composed meshes on a 1-device mesh):
loss and every gradient leaf (stack, head, embedding) within rtol 1e-5 /
atol 4e-5 in float32. The default slice is small; the issue's full grid
(every schedule, p in {2, 4}, m in {p, 2p, 4p}, v in {1, 2}) runs under
`-m slow`.
"""

import itertools

import pytest

from tests.parallel.pipeline_models import check_lm_case, check_mlp_case

# The default slice: the split (zero-bubble) and the plain backward, both wrapping around the
# ring (interleaved), NaN-poisoned buffers and a tied embedding. 1F1B and GPipe run the same
# code path with other tables: in the slow grid.
DEFAULT = [("zb-h1", 2, 4, 1), ("interleaved", 2, 4, 2)]


def _grid():
    for schedule, p in itertools.product(("gpipe", "1f1b", "interleaved", "zb-h1"), (2, 4)):
        for m in (p, 2 * p, 4 * p):
            for v in (2,) if schedule == "interleaved" else (1,):
                if (schedule, p, m, v) not in DEFAULT:
                    yield schedule, p, m, v


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
    with pytest.raises(ValueError, match=r"targets has shape \(4, 5\)"):
        pipe.loss(
            jnp.ones((4, 4, 8)),
            jnp.ones((4, 5), jnp.int32),
            head=nnx.Linear(8, 4, rngs=nnx.Rngs(0)),
        )
