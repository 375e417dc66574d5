"""`Pipeline(residuals="stored")`: the backward from stored VJP residuals equals recompute.

For every schedule, the stored-residual backward gives the same loss and
EVERY gradient leaf (stack, head, embedding) as the default recompute
backward and as the unpipelined model (rtol 1e-5 / atol 4e-5, float32), with
NaN-poisoned buffers (stage inputs, gradients, residuals, unused transfers).
Stages with and without collectives run the same lockstep ticks (pipeline x
model: tensor parallel layers in the stage). A jaxpr count shows that the
stored backward does not rerun the stage forward.

The default slice is one poisoned zero-bubble case (split B/W from the same
residuals), one pipeline x model case, the structure count and bad input;
the grid (gpipe, 1f1b, interleaved v=2, zb-h1 x p in {2, 4} x m in {p, 2p} x Explicit
and Auto meshes: the rows covering every pair, `tests/pairwise.py`; the transformer LM
on pipeline x model) runs under `-m slow`.
The measured memory and step times, and why "recompute" is the default, are
in `tests/parallel/test_pipeline_memory.py`.
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import shardfuse as sf
from shardfuse.layers.stack import Stack
from shardfuse.parallel.pipeline import executor
from shardfuse.parallel.pipeline import residuals as residuals_module
from shardfuse.parallel.pipeline.api import Pipeline
from tests.pairwise import pairwise
from tests.parallel import pipeline_models as pm


def _with_residuals(pipe, residuals, poison):
    """The same stack and settings as `pipe`, with `residuals=`."""
    out = Pipeline(
        pipe.stack,
        mesh=pipe.mesh,
        schedule=pipe.schedule,
        num_microbatches=pipe.num_microbatches,
        virtual_stages=pipe.virtual_stages,
        pipeline_axis=pipe.pipeline_axis,
        io_spec=pipe.io_spec,
        residuals=residuals,
    )
    out.poison_buffers = poison
    return out


def _value_and_grad(loss_fn, model, *args):
    return nnx.jit(nnx.value_and_grad(loss_fn))(model, *args)


def _check_against(loss, grads, expected_loss, expected_grads):
    assert np.isfinite(loss) and np.isfinite(expected_loss)
    np.testing.assert_allclose(loss, expected_loss, rtol=pm.RTOL, atol=pm.ATOL)
    pm.assert_trees_close(grads, expected_grads)


def check_mlp_stored(schedule, p, m, v=1, *, poison=True, explicit=True, recompute=True):
    """Stored == unpipelined (and == recompute), residual-MLP stack on a pipeline mesh of size p.

    `recompute=False` leaves out the recompute run (the default slice: test_pipeline.py
    checks recompute against the same oracle).
    """
    types = None if explicit else (AxisType.Auto,)
    mesh = jax.make_mesh((p,), ("pipeline",), devices=jax.devices()[:p], axis_types=types)
    model = pm.MLPModel(mesh, schedule=schedule, m=m, v=v, layers=p * v)
    batch = pm.mlp_batch(m)
    expected = _value_and_grad(pm.plain_loss, model, *batch)
    model.pipe = _with_residuals(model.pipe, "stored", poison)
    stored = _value_and_grad(pm.pipelined_loss, model, *batch)
    _check_against(*stored, *expected)
    if recompute:
        model.pipe = _with_residuals(model.pipe, "recompute", poison)
        _check_against(*stored, *_value_and_grad(pm.pipelined_loss, model, *batch))


def _grid():
    """The rows covering every pair of schedule, p, m / p in {1, 2} and axis type
    (`tests/pairwise.py`; SHARDFUSE_FULL_MATRIX=1 gives all 32 cells)."""
    schedules = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))
    for (schedule, v), p, per_stage, explicit in pairwise(schedules, (2, 4), (1, 2), (True, False)):
        yield schedule, p, per_stage * p, v, explicit


def test_zero_bubble_stored_matches_unpipelined_nan_poisoned():
    # B (input gradient) and W (weight gradient) both from the same stored residuals.
    check_mlp_stored("zb-h1", 2, 4, explicit=False, recompute=False)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, p, m, v, explicit", list(_grid()))
def test_stored_grid_matches_recompute_and_unpipelined(schedule, p, m, v, explicit):
    check_mlp_stored(schedule, p, m, v, explicit=explicit)


class TensorParallelMLP(nnx.Module):
    """A residual MLP block, column- then row-parallel over "model" (a psum per layer)."""

    def __init__(self, mesh, rngs):
        self.mlp = sf.layers.ParallelMLP(pm.FEATURES, 16, mesh=mesh, rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(x)


@pytest.mark.parametrize(
    "modes", [("stored",), pytest.param(("stored", "recompute"), marks=pytest.mark.slow)]
)
def test_pipeline_by_model_stored_matches_unpipelined(modes):
    # The stage communicates (every device runs the same ops), NaN-poisoned.
    mesh = jax.make_mesh((2, 2), ("pipeline", "model"))
    stack = Stack(
        lambda rngs: TensorParallelMLP(mesh, rngs),
        2,
        mesh=mesh,
        layer_axis="pipeline",
        rngs=nnx.Rngs(0),
    )
    head = nnx.Linear(pm.FEATURES, pm.VOCAB, rngs=nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(0), (4, 4, pm.FEATURES))
    targets = jax.random.randint(jax.random.key(1), (4, 4), 0, pm.VOCAB)

    def plain(stack, head, x):
        total, count = pm.token_loss(head(stack(x)), targets, jnp.ones(targets.shape))
        return total / count

    def pipelined(pipe, head, x):
        return pipe.loss(x, targets, head=head)

    def value_and_grads(fn, module):
        return nnx.jit(nnx.value_and_grad(fn, argnums=(0, 1, 2)))(module, head, x)

    expected_loss, expected = value_and_grads(plain, stack)
    results = {}
    for residuals in modes:
        pipe = Pipeline(stack, mesh=mesh, schedule="1f1b", num_microbatches=2, residuals=residuals)
        pipe.poison_buffers = True
        loss, (d_pipe, d_head, d_x) = value_and_grads(pipelined, pipe)
        results[residuals] = loss, (d_pipe["stack"], d_head, d_x)
    for loss, (d_stack, d_head, d_x) in results.values():
        _check_against(loss, d_stack, expected_loss, expected[0])
        _check_against(loss, d_head, expected_loss, expected[1])
        assert np.all(np.isfinite(d_x))
        np.testing.assert_allclose(d_x, expected[2], rtol=pm.RTOL, atol=pm.ATOL)
    if "recompute" in results:
        stored, recomputed = results["stored"], results["recompute"]
        _check_against(stored[0], stored[1][0], recomputed[0], recomputed[1][0])
        _check_against(stored[0], stored[1][1], recomputed[0], recomputed[1][1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, names, explicit, schedule, m, v",
    [
        ((2, 2), ("pipeline", "model"), True, "1f1b", 2, 1),
        ((2, 2), ("pipeline", "model"), False, "zb-h1", 2, 1),
        ((2, 2, 2), ("pipeline", "sequence", "model"), True, "interleaved", 2, 2),
    ],
)
def test_transformer_lm_stored_matches_one_device(shape, names, explicit, schedule, m, v):
    types = None if explicit else (AxisType.Auto,) * len(shape)
    mesh = jax.make_mesh(shape, names, axis_types=types)
    kwargs = dict(schedule=schedule, m=m, v=v, layers=mesh.shape["pipeline"] * v)
    model = pm.LM(mesh, **kwargs)
    model.pipe = _with_residuals(model.pipe, "stored", True)
    tokens = jax.random.randint(jax.random.key(3), (m, 8), 0, pm.VOCAB * 2)
    targets = jax.random.randint(jax.random.key(4), (m, 8), 0, pm.VOCAB * 2)
    stored = _value_and_grad(pm.LM.loss, model, tokens, targets)
    expected = pm.one_device_value_and_grad(model, shape, names, tokens, targets, **kwargs)
    _check_against(*stored, *expected)


def _count(jaxpr, name):
    """Equations of primitive `name` in a jaxpr, sub-jaxprs (scan, switch branches) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    total += _count(sub, name)
    return total


def test_stored_backward_does_not_rerun_the_forward():
    # Each tanh in the program's jaxpr is one traced stage forward (the residual MLP's
    # nonlinearity; each scan body, one per set of slots a run of ticks uses, traces what
    # it runs). Recompute traces it in every F and every B slot; stored only in the F slots
    # (B applies the VJP to the residuals).
    mesh = jax.make_mesh((2,), ("pipeline",), devices=jax.devices()[:2])
    model = pm.MLPModel(mesh, schedule="zb-h1", m=2, v=1, layers=2)
    batch = pm.mlp_batch(2)
    counts = {}
    for residuals in ("recompute", "stored"):
        model.pipe = _with_residuals(model.pipe, residuals, False)
        graphdef, state = nnx.split(model)

        def grads(state, *batch):
            return nnx.grad(pm.pipelined_loss)(nnx.merge(graphdef, state), *batch)  # noqa: B023

        counts[residuals] = _count(jax.make_jaxpr(grads)(state, *batch), "tanh")
    bodies = {mask for item in executor.segments(model.pipe.lockstep().active())
              for mask in executor._masks(item)}  # fmt: skip
    with_f = sum(1 for do_f, _, _ in bodies if do_f)
    with_b = sum(1 for _, _, do_b in bodies if do_b)
    assert (with_f, with_b) == (2, 2), bodies  # F; F, head and B; B
    assert counts == {"recompute": with_f + with_b, "stored": with_f}, counts


def test_bad_residuals_named_before_tracing():
    mesh = jax.make_mesh((2,), ("pipeline",), devices=jax.devices()[:2])
    stack = Stack(pm.ResidualMLP, 2, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
    for residuals in ("saved", None, "Stored", 1):
        match = rf"residuals={residuals!r} must be one of \('recompute', 'stored'\)"
        with pytest.raises(ValueError, match=match):
            Pipeline(stack, mesh=mesh, num_microbatches=2, residuals=residuals)
    assert Pipeline(stack, mesh=mesh, num_microbatches=2).residuals == "recompute"


def test_residuals_module_examples():
    result = doctest.testmod(residuals_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
