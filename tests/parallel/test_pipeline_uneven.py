"""Uneven pipeline stages (`Stack(stage_layers=...)`) and the stage balancer.

Oracle of the pipeline: the same layers (layer l from key l, so the same
values) in a plain `Stack` with `layer_axis=None`, run as one scan on the
whole batch; the loss and every gradient leaf must match, the padding rows'
gradients must be zero. Oracle of `balance_stages`: brute force over every
contiguous split of small random cases.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import token_loss
from shardfuse.layers.stack import Stack, _layer_rows
from shardfuse.parallel.pipeline.api import Pipeline
from shardfuse.parallel.pipeline.balance import balance_stages, stage_costs
from tests.parallel.pipeline_models import ATOL, FEATURES, RTOL, VOCAB, ResidualMLP, mlp_batch


class UnevenModel(nnx.Module):
    def __init__(self, mesh, stage_layers, *, schedule, m, layer_axis="pipeline"):
        self.embed = nnx.Param(jax.random.normal(jax.random.key(5), (VOCAB, FEATURES)))
        self.stack = Stack(
            ResidualMLP,
            sum(stage_layers),
            mesh=mesh,
            layer_axis=layer_axis,
            stage_layers=stage_layers if layer_axis else None,
            rngs=nnx.Rngs(0),
        )
        if layer_axis:
            self.pipe = Pipeline(
                self.stack, mesh=mesh, schedule=schedule, num_microbatches=m, io_spec=P()
            )
        self.head = nnx.Linear(FEATURES, VOCAB, rngs=nnx.Rngs(1))

    def pipelined_loss(self, tokens, targets, weights):
        x = jnp.take(self.embed[...], tokens, axis=0)
        return self.pipe.loss(x, targets, head=self.head, weights=weights)

    def plain_loss(self, tokens, targets, weights):
        x = jnp.take(self.embed[...], tokens, axis=0)
        s, w = token_loss(self.head(self.stack(x)), targets, weights)
        return s / w


def _flat(state):
    """Leaves by path (the stack's under one name, whether reached through the pipeline)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    return {jax.tree_util.keystr(k).replace("['pipe']", ""): np.asarray(v) for k, v in leaves}


@pytest.mark.parametrize(
    "stage_layers, schedule, m",
    [
        ((3, 3, 2, 2), "1f1b", 4),
        pytest.param((3, 3, 3, 1), "gpipe", 4, marks=pytest.mark.slow),
        pytest.param((1, 4, 2, 3), "zb-h1", 8, marks=pytest.mark.slow),
    ],
)
def test_uneven_stages_equal_the_unpipelined_model(stage_layers, schedule, m):
    p = len(stage_layers)
    mesh = jax.make_mesh((p,), ("pipeline",), devices=jax.devices()[:p])
    model = UnevenModel(mesh, stage_layers, schedule=schedule, m=m)
    plain = UnevenModel(mesh, stage_layers, schedule=schedule, m=m, layer_axis=None)
    rows = np.asarray(_layer_rows(sum(stage_layers), stage_layers))
    real = np.flatnonzero(rows >= 0)
    for (path, got), (_, want) in zip(
        _flat(nnx.state(model.stack)).items(), _flat(nnx.state(plain.stack)).items(), strict=True
    ):  # the same layers (layer l from key l), zero padding
        assert got.shape[0] == p * max(stage_layers), path
        np.testing.assert_array_equal(got[real], want, err_msg=path)
        assert not np.any(got[rows < 0]), path
    tokens, targets, weights = mlp_batch(m)
    loss, grads = nnx.jit(nnx.value_and_grad(UnevenModel.pipelined_loss))(
        model, tokens, targets, weights
    )
    want_loss, want = nnx.jit(nnx.value_and_grad(UnevenModel.plain_loss))(
        plain, tokens, targets, weights
    )
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    got, want = _flat(grads), _flat(want)
    assert got.keys() == want.keys() and got
    for path in want:
        g = got[path][real] if "stack" in path else got[path]
        assert np.all(np.isfinite(got[path])), path
        np.testing.assert_allclose(g, want[path], rtol=RTOL, atol=ATOL, err_msg=path)
        if "stack" in path:
            assert not np.any(got[path][rows < 0]), path  # padding rows: zero gradient
    x = jnp.take(model.embed[...], tokens, axis=0)
    np.testing.assert_allclose(model.pipe.forward(x), plain.stack(x), rtol=RTOL, atol=ATOL)


def _tensor_parallel_case(stage_layers):
    """pipeline 2 x model 2: transformer blocks in a stack of `stage_layers`, a vocabulary-
    parallel head and a batch. Returns `(mesh, block, stack, head, x, targets, pipelined)`,
    `pipelined(stack, head)` the 1F1B loss built from the stack it is given (the one being
    differentiated)."""
    mesh = jax.make_mesh((2, 2), ("pipeline", "model"))

    def block(rngs):
        return sf.layers.ParallelTransformerBlock(16, 4, 32, mesh=mesh, layout="contiguous",
                                                  sequence_axis=None, rngs=rngs)  # fmt: skip

    stack = Stack(block, sum(stage_layers), mesh=mesh, layer_axis="pipeline",
                  stage_layers=stage_layers, rngs=nnx.Rngs(0))  # fmt: skip
    head = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, sequence_parallel=True,
                                          gather_output=True, rngs=nnx.Rngs(1))  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    targets = jax.random.randint(jax.random.key(1), (4, 8), 0, 32)

    def pipelined(stack, head):
        pipe = Pipeline(stack, mesh=mesh, schedule="1f1b", num_microbatches=2)
        return pipe.loss(x, targets, head=head, targets_spec=P())

    return mesh, block, stack, head, x, targets, pipelined


@pytest.mark.slow
def test_uneven_stages_with_tensor_parallel_blocks():
    """pipeline 2 x model 2, transformer blocks, 5 layers as (3, 2): equal to the same
    layers unpipelined."""
    mesh, block, stack, head, x, targets, pipelined = _tensor_parallel_case((3, 2))
    plain = Stack(block, 5, mesh=mesh, rngs=nnx.Rngs(0))

    def unpipelined(stack, head):
        s, w = token_loss(head(stack(x)), targets, jnp.ones(targets.shape))
        return s / w

    loss, grads = nnx.jit(nnx.value_and_grad(pipelined))(stack, head)
    want_loss, want = nnx.jit(nnx.value_and_grad(unpipelined))(plain, head)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL, atol=ATOL)
    real = np.flatnonzero(np.asarray(_layer_rows(5, (3, 2))) >= 0)
    got, want = _flat(grads), _flat(want)
    for path in want:
        np.testing.assert_allclose(got[path][real], want[path], rtol=RTOL, atol=ATOL, err_msg=path)


_CALLS = []  # (what, stage) of every layer and head application that ran


def _record(what, stage):
    _CALLS.append((what, int(stage)))


class CountingMLP(ResidualMLP):
    """A `ResidualMLP` that records each application with the stage it ran on."""

    def __call__(self, x):
        jax.debug.callback(_record, "layer", jax.lax.axis_index("pipeline"))
        return super().__call__(x)


class CountingHead(nnx.Module):
    def __init__(self):
        self.linear = nnx.Linear(FEATURES, VOCAB, rngs=nnx.Rngs(1))

    def __call__(self, y):
        jax.debug.callback(_record, "head", jax.lax.axis_index("pipeline"))
        return self.linear(y)


@pytest.mark.parametrize("stage_layers", [(3, 2, 2, 1), (2, 2, 2, 2)])
def test_each_stage_runs_only_its_layers_and_only_the_last_the_head(stage_layers):
    """Counted at run time (a debug callback in each layer and in the head), pipeline 4,
    1F1B: stage s applies a layer `stage_layers[s]` times per F or B slot of a tick (its
    padding rows are skipped by `lax.cond`, not computed and discarded), and only the
    last stage runs the head, once per microbatch. So the balancer's split for a head as
    heavy as two layers, (3, 2, 2, 1), executes at most 3 layers' work on any stage in a
    tick where the even split's last stage runs 2 layers and the head (4)."""
    p, m = 4, 4
    mesh = jax.make_mesh((p,), ("pipeline",), devices=jax.devices()[:p])
    stack = Stack(CountingMLP, sum(stage_layers), mesh=mesh, layer_axis="pipeline",
                  stage_layers=stage_layers, rngs=nnx.Rngs(0))  # fmt: skip
    pipe = Pipeline(stack, mesh=mesh, schedule="1f1b", num_microbatches=m, io_spec=P())
    head = CountingHead()
    x = jax.random.normal(jax.random.key(0), (2 * m, 4, FEATURES))
    targets = jax.random.randint(jax.random.key(1), (2 * m, 4), 0, VOCAB)
    step = nnx.jit(nnx.value_and_grad(lambda pipe, head: pipe.loss(x, targets, head=head)))
    _CALLS.clear()
    jax.block_until_ready(step(pipe, head))
    jax.effects_barrier()
    layers = [sum(1 for w, s in _CALLS if w == "layer" and s == stage) for stage in range(p)]
    heads = [sum(1 for w, s in _CALLS if w == "head" and s == stage) for stage in range(p)]
    slots = layers[0] // stage_layers[0]  # F and B slots run per stage (the same on all)
    assert slots >= 2 * m and layers == [slots * n for n in stage_layers], layers
    assert heads == [0] * (p - 1) + [m], heads


def test_per_stage_branches_with_collectives_lower_for_tpu(monkeypatch):
    """Where a branch may hold collectives (GPU and TPU runtimes meet per group), pipeline 2
    x model 2 with uneven stages puts each layer and the head in a `lax.cond` with their
    tensor parallel all-reduces inside: the training step lowers for TPU. (On XLA:CPU,
    whose collectives meet all devices of an op, the same mesh computes and discards the
    padding rows instead: test_uneven_stages_with_tensor_parallel_blocks.)"""
    mesh, _, stack, head, _, _, pipelined = _tensor_parallel_case((2, 1))
    graphdef, state = nnx.split((stack, head))

    def step(state):
        return jax.value_and_grad(lambda state: pipelined(*nnx.merge(graphdef, state)))(state)

    # JAX's trace caches do not key on the backend: a stage function an earlier test traced
    # on CPU (picking native_cpu attention) would be reused here, and this test's TPU traces
    # (picking pallas_tpu) by later CPU tests. Clear them on both sides of the fake backend.
    jax.clear_caches()
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    try:
        with jax.set_mesh(mesh):
            text = jax.export.export(jax.jit(step), platforms=["tpu"])(state).mlir_module()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    bodies = dict(
        re.findall(r"func\.func \w+ @([\w.$-]+)\((.*?)(?=\n  func\.func |\Z)", text, re.S)
    )

    def reaches_all_reduce(code, seen=()):
        if "stablehlo.all_reduce" in code:
            return True
        return any(
            name not in seen and reaches_all_reduce(bodies.get(name, ""), (*seen, name))
            for name in re.findall(r"func\.call @([\w.$-]+)", code)
        )

    cases = [part.split(") : (tensor<i32>)")[0] for part in text.split('"stablehlo.case"')[1:]]
    assert len(cases) >= 2, "no per-stage branch in the lowered step"
    assert any(map(reaches_all_reduce, cases)), "no collective inside a per-stage branch"


def _brute_force(costs, p, first, last):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        counts = tuple(b - a for a, b in itertools.pairwise(bounds))
        slowest = max(stage_costs(costs, counts, first_extra=first, last_extra=last))
        best = slowest if best is None else min(best, slowest)
    return best


def test_balance_stages_is_optimal_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 11))
        p = int(rng.integers(1, n + 1))
        costs = rng.uniform(0, 5, n).round(2).tolist()
        first, last = (float(rng.choice([0.0, rng.uniform(0, 8)])) for _ in range(2))
        counts = balance_stages(costs, p, first_extra=first, last_extra=last)
        assert len(counts) == p and sum(counts) == n and min(counts) >= 1
        got = max(stage_costs(costs, counts, first_extra=first, last_extra=last))
        assert got == pytest.approx(_brute_force(costs, p, first, last), abs=1e-9), (costs, p)


def test_balance_stages_beats_the_even_split_with_a_heavy_head():
    """16 layers on 4 stages, the head (unembedding + loss over a large vocabulary) as
    heavy as 3 layers and the embedding as 1: the even split's slowest stage is the last
    (4 + 3 = 7); the balancer's is 5."""
    costs = [1.0] * 16
    even = (4, 4, 4, 4)
    counts = balance_stages(costs, 4, first_extra=1.0, last_extra=3.0)
    slowest = max(stage_costs(costs, counts, first_extra=1.0, last_extra=3.0))
    assert counts == (4, 5, 5, 2)
    assert slowest == 5.0 < max(stage_costs(costs, even, first_extra=1.0, last_extra=3.0)) == 7.0
    assert balance_stages([1.0] * 126, 16)[:2] == (8, 8)  # Llama-3 405B: 8 x 14 + 7 x 2
    assert sorted(balance_stages([1.0] * 126, 16)) == [7, 7] + [8] * 14


def test_bad_input():
    mesh = jax.make_mesh((4,), ("pipeline",), devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"stage_layers=\(3, 3, 2\) has 3 stages"):
        Stack(ResidualMLP, 8, mesh=mesh, layer_axis="pipeline", stage_layers=(3, 3, 2),
              rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"sums to 9; it must sum to num_layers=10"):
        Stack(ResidualMLP, 10, mesh=mesh, layer_axis="pipeline", stage_layers=(3, 2, 2, 2),
              rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"must be positive ints"):
        Stack(ResidualMLP, 10, mesh=mesh, layer_axis="pipeline", stage_layers=(4, 4, 2, 0),
              rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"needs a layer_axis"):
        Stack(ResidualMLP, 10, mesh=mesh, stage_layers=(3, 3, 2, 2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_layers=10 must be divisible by the size 4"):
        Stack(ResidualMLP, 10, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
    stack = Stack(ResidualMLP, 10, mesh=mesh, layer_axis="pipeline", stage_layers=(3, 3, 2, 2),
                  rngs=nnx.Rngs(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"runs with virtual_stages=1"):
        Pipeline(stack, mesh=mesh, schedule="interleaved", num_microbatches=4, virtual_stages=2)
    with pytest.raises(ValueError, match=r"stages=5 must be an int from 1 to the 4 layers"):
        balance_stages([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match=r"layer_costs must be finite and >= 0"):
        balance_stages([1, -1], 1)
    with pytest.raises(ValueError, match=r"last_extra=-1 must be finite and >= 0"):
        balance_stages([1, 1], 2, last_extra=-1)
    with pytest.raises(ValueError, match=r"layer_costs is empty"):
        balance_stages([], 1)
