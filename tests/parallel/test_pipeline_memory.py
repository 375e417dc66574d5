"""Compiled memory, compile time and collectives of the pipelined training step.

Per device, from `jit(...).lower(...).compile()`: 1F1B's temp memory is flat
in the number of microbatches m at fixed microbatch size (ring buffers of p
slots), GPipe's grows (m slots); the program is a `lax.scan` over ticks, so
compile time is flat in m too; activations move between stages by
collective-permute only, and the stack is never all-gathered.

Measured (p=4, 4 residual-MLP layers F=16 H=1024, T=16, microbatch 2,
2026-11-23, 2-core CPU): temp bytes per device; "activations" leaves out the
`[m, b, T, F]` buffer of the input gradient (the size of the pipeline's
input, which grows with m by definition: 49,152 bytes from m=8 to 32)

| schedule | m=8 | m=32 | growth | activations growth |
|---|---|---|---|---|
| 1f1b | 579,664 | 634,960 | +9.5% | +1.1% |
| gpipe | 596,048 | 749,648 | +25.8% | +17.5% |

compile time 1f1b: 4.0 s (m=8), 3.2 s (m=32) (loaded machine: noisy).
"""

import functools
import time

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse.layers.stack import Stack
from shardfuse.parallel.pipeline.api import Pipeline
from shardfuse.parallel.pipeline.schedule import schedule_table
from tests.parallel import hlo_collectives

FEATURES, HIDDEN, SEQ, MICROBATCH, STAGES = 16, 1024, 16, 2, 4


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, FEATURES, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(x)))


@functools.cache
def _mesh():
    return jax.make_mesh((STAGES,), ("pipeline",), devices=jax.devices()[:STAGES])


@functools.cache
def _compiled(schedule, m, residuals="recompute"):
    """(compiled training step, compile seconds) for `schedule` with m microbatches."""
    mesh = _mesh()
    stack = Stack(Wide, STAGES, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
    head = nnx.Linear(FEATURES, 8, rngs=nnx.Rngs(1))
    pipe = Pipeline(
        stack, mesh=mesh, schedule=schedule, num_microbatches=m, io_spec=P(), residuals=residuals
    )
    x = jax.ShapeDtypeStruct((MICROBATCH * m, SEQ, FEATURES), jnp.float32)
    targets = jax.ShapeDtypeStruct((MICROBATCH * m, SEQ), jnp.int32)

    def step(pipe, head, x, targets):
        loss = lambda pipe, head, x: pipe.loss(x, targets, head=head)  # noqa: E731
        return nnx.value_and_grad(loss, argnums=(0, 1, 2))(pipe, head, x)

    lowered = nnx.jit(step).lower(pipe, head, x, targets)
    start = time.perf_counter()
    compiled = lowered.compile()
    return compiled, time.perf_counter() - start


def _temp(schedule, m, residuals="recompute"):
    return _compiled(schedule, m, residuals)[0].memory_analysis().temp_size_in_bytes


def _input_gradient_growth(m_small, m_large):
    return (m_large - m_small) * MICROBATCH * SEQ * FEATURES * 4


@pytest.mark.slow
def test_1f1b_memory_and_compile_time_flat_in_m():
    small, large = _temp("1f1b", 8), _temp("1f1b", 32)
    assert large < 1.10 * small, (small, large)
    assert large - _input_gradient_growth(8, 32) < 1.03 * small, (small, large)
    seconds_small, seconds_large = _compiled("1f1b", 8)[1], _compiled("1f1b", 32)[1]
    assert seconds_large < 1.5 * seconds_small, (seconds_small, seconds_large)


@pytest.mark.slow
def test_gpipe_memory_grows_with_m():
    small, large = _temp("gpipe", 8), _temp("gpipe", 32)
    assert large - _input_gradient_growth(8, 32) > 1.15 * small, (small, large)
    assert _temp("gpipe", 32) > 1.15 * _temp("1f1b", 32)


def test_activations_move_by_collective_permute_only():
    m = 8
    counts = hlo_collectives.count(_compiled("1f1b", m)[0].as_text(), _mesh())
    ticks = schedule_table("1f1b", STAGES, m).num_ticks
    permutes = sum(n for (kind, _), n in counts.items() if kind == "collective-permute")
    # one transfer forward and one backward per tick, over the pipeline axis
    assert counts[("collective-permute", ("pipeline",))] == 2 * ticks == permutes
    # no all-gather (the stack is never gathered) and no all-to-all
    assert not any(kind in ("all-gather", "all-to-all") for kind, _ in counts)
    # all-reduces only at the end (loss, token count, head gradients, input gradient): not per tick
    reduces = sum(n for (kind, _), n in counts.items() if kind == "all-reduce")
    assert reduces < ticks


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_stored_residuals_flat_in_m_and_above_recompute(schedule):
    # residuals="stored" keeps p microbatches' stage residuals (here the two layers'
    # inputs, pre-activations and tanh outputs, HIDDEN wide) instead of p stage inputs:
    # flat in m too, and several times the recompute default's temp memory.
    small, large = _temp(schedule, 8, "stored"), _temp(schedule, 32, "stored")
    assert large < 1.10 * small, (small, large)
    assert large - _input_gradient_growth(8, 32) < 1.03 * small, (small, large)
    assert small > 2 * _temp(schedule, 8), (small, _temp(schedule, 8))
