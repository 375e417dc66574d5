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

Backward from recomputed forward (`residuals="recompute"`, the default) vs
stored VJP residuals (`residuals="stored"`), p=4, microbatch 2, temp bytes
per device and step time (median of 9 after 2 warm-ups, the two modes timed
alternately in one process; 2-core CPU shared, load average 2-4,
2026-11-23). Stages: Wide (above: switch tick); TF = 8
`ParallelTransformerBlock`s (F=64, 4 heads, MLP 256, T=32; 2 layers per
stage) with remat "none" or "full", on `pipeline` 4 (model_axis None: switch
tick) or `pipeline` 4 x `model` 2 ("x2": tensor parallel, uniform tick).
"act." is the growth without the input-gradient buffer, as above.

| stage | schedule | residuals | temp m=8 | temp m=32 | growth | act. | step m=8 | m=32 |
|---|---|---|---|---|---|---|---|---|
| Wide | 1f1b | recompute | 579,664 | 634,960 | +9.5% | +1.1% | 23 ms | 50 ms |
| Wide | 1f1b | stored | 2,101,480 | 2,156,776 | +2.6% | +0.3% | 29 ms | 62 ms |
| Wide | zb-h1 | recompute | 579,664 | 634,960 | +9.5% | +1.1% | 18 ms | 67 ms |
| Wide | zb-h1 | stored | 2,101,480 | 2,156,776 | +2.6% | +0.3% | 23 ms | 82 ms |
| TF none | 1f1b | recompute | 2,886,400 | 3,291,904 | +14.0% | +0.4% | 99 ms | 295 ms |
| TF none | 1f1b | stored | 10,439,272 | 10,844,776 | +3.9% | +0.1% | 134 ms | 405 ms |
| TF none | zb-h1 | recompute | 2,886,272 | 3,291,776 | +14.0% | +0.4% | 139 ms | 594 ms |
| TF none | zb-h1 | stored | 10,439,464 | 10,844,968 | +3.9% | +0.1% | 165 ms | 722 ms |
| TF full | 1f1b | recompute | 1,866,240 | 2,271,744 | +21.7% | +0.7% | 94 ms | 357 ms |
| TF full | 1f1b | stored | 2,062,024 | 2,467,528 | +19.7% | +0.6% | 84 ms | 318 ms |
| TF full | zb-h1 | recompute | 1,866,176 | 2,271,680 | +21.7% | +0.7% | 136 ms | 444 ms |
| TF full | zb-h1 | stored | 2,061,960 | 2,467,464 | +19.7% | +0.6% | 116 ms | 367 ms |
| TF none x2 | 1f1b | recompute | 1,532,440 | 1,741,336 | +13.6% | +0.8% | 287 ms | 1105 ms |
| TF none x2 | 1f1b | stored | 6,951,432 | 7,160,328 | +3.0% | +0.2% | 328 ms | 1230 ms |
| TF none x2 | zb-h1 | recompute | 1,532,440 | 1,741,336 | +13.6% | +0.8% | 361 ms | 1329 ms |
| TF none x2 | zb-h1 | stored | 6,951,432 | 7,160,328 | +3.0% | +0.2% | 397 ms | 1449 ms |
| TF full x2 | 1f1b | recompute | 1,028,528 | 1,237,424 | +20.3% | +1.2% | 398 ms | 1223 ms |
| TF full x2 | 1f1b | stored | 1,195,584 | 1,404,480 | +17.5% | +1.0% | 337 ms | 1033 ms |
| TF full x2 | zb-h1 | recompute | 1,028,528 | 1,237,424 | +20.3% | +1.2% | 340 ms | 1230 ms |
| TF full x2 | zb-h1 | stored | 1,195,584 | 1,404,480 | +17.5% | +1.0% | 286 ms | 1036 ms |

Both are flat in m (ring buffers of p slots); only the input-gradient buffer
grows (the same bytes in both modes; it is most of the growth of the small TF
stages). Default "recompute": it holds one stage input per microbatch in
flight, the memory bound that is the point of 1F1B, where "stored" holds the
stage's whole VJP residuals (3.3-4.5x the temp memory with remat "none",
weight-shaped leaves the layer scan saves included) and was not faster here
(1.1-1.4x the step time: on CPU at these widths, moving the residuals costs
more than the forward it saves). With remat "full", "stored" keeps one input
per layer (+10-16%) and was faster (0.83-0.90x): on the switch tick a B then
runs the layers' forward once instead of twice; on the uniform tick both
modes run the same FLOPs (every tick a forward and a backward), so that gain
is XLA's scheduling, not saved compute. At the bench's wider stage
(`bench/bench_pipeline.py --bench-quick`: 8 residual-MLP layers F=512,
hidden 1792, T=64, m=16, 3 rounds) "stored" was 0.92x (1f1b) and 0.94x
(zb-h1) the step time for 2.5x the temp memory (114.1 MB vs 44.9 MB): the
saved forward pays once compute dominates. "stored" is the option for
remat-"full" stacks, or wide stages with memory to spare.
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
