"""Pipeline benchmarks: a training step through `Pipeline.loss`, schedules x m at fixed p.

Each group (one number of microbatches m) times, in the same run, the loss
and every gradient (stack, head, input) of a small LM stack of residual-MLP
blocks (width from the scale's model / 8 on CPU), batch = 2 m, by:

- `shardfuse.pipeline.<schedule>` for gpipe, 1f1b, interleaved (v=2) and
  zb-h1 on a pipeline mesh of p=4 of the CPU devices: one jitted program, a
  `lax.scan` over the schedule's ticks, ppermute between stages; the
  backward recomputes the stage forward (`residuals="recompute"`, the
  default);
- `shardfuse.pipeline.<schedule>.stored` for 1f1b and zb-h1: the same with
  `residuals="stored"` (the stage VJP's residuals kept from F to B/W, no
  second forward; more memory per microbatch in flight);
- `unpipelined.1device`, the baseline: the same stack as one `lax.scan` and
  the same head on one device.

`extra_info` adds the schedule's IR figures (`ticks`, `bubble`, closed-form
bubble, peak in-flight microbatches) next to the compiled memory the
harness records. On CPU the stages share the host's cores, so times show the
pipelined program's overhead (every tick runs one stage forward and
backward on every device; see `shardfuse.parallel.pipeline.executor`), not
the speedup of p accelerators.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse import flops
from shardfuse.bench.harness import BenchCase
from shardfuse.layers.stack import Stack
from shardfuse.models import MODELS
from shardfuse.parallel.pipeline.api import Pipeline, cross_entropy
from shardfuse.parallel.pipeline.schedule import schedule_table

OP = "pipeline_step"
BASELINE = "unpipelined.1device"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
STORED = ("1f1b", "zb-h1")  # schedules also timed with residuals="stored"
IMPLEMENTATIONS = (
    tuple(f"shardfuse.pipeline.{s}" for s in SCHEDULES)
    + tuple(f"shardfuse.pipeline.{s}.stored" for s in STORED)
    + (BASELINE,)
)
MODEL = "llama3-8b"
STAGES, LAYERS, SEQ, MICROBATCH, VOCAB = 4, 8, 64, 2, 256


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_pipeline_step":
        return
    quick = "quick" in metafunc.config.bench_scale.name
    counts = (STAGES, 4 * STAGES) if quick else (STAGES, 2 * STAGES, 4 * STAGES)
    params = [(m, impl) for m in counts for impl in IMPLEMENTATIONS]
    metafunc.parametrize("m, implementation", params, ids=[f"m{m}-{i}" for m, i in params])


class Block(nnx.Module):
    def __init__(self, features, hidden, rngs):
        self.up = nnx.Linear(features, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, features, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def test_pipeline_step(measure, bench_scale, benchmark, m, implementation):
    model = bench_scale.scaled(MODELS[MODEL])
    features, hidden = model.hidden, model.ffn_hidden
    devices = jax.devices()[:STAGES] if implementation != BASELINE else jax.devices()[:1]
    mesh = jax.make_mesh((len(devices),), ("pipeline",), devices=devices)
    stack = Stack(
        lambda rngs: Block(features, hidden, rngs),
        LAYERS,
        mesh=mesh,
        layer_axis="pipeline",
        rngs=nnx.Rngs(0),
    )
    head = nnx.Linear(features, VOCAB, rngs=nnx.Rngs(1))
    batch = MICROBATCH * m
    x = jax.random.normal(jax.random.key(0), (batch, SEQ, features))
    targets = jax.random.randint(jax.random.key(1), (batch, SEQ), 0, VOCAB)
    tokens = batch * SEQ
    matmuls = LAYERS * 2 * flops.matmul_flops(tokens, hidden, features)
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=flops.FWD_BWD,
        shape={"p": STAGES, "m": m, "B": batch, "T": SEQ, "F": features, "L": LAYERS},
        dtype="float32",
        flops=flops.TRAINING_OVER_FORWARD * (matmuls + flops.matmul_flops(tokens, VOCAB, features)),
        bytes=4 * tokens * features * 4,
        baseline=BASELINE,
        model=model.name,
        variant="residual MLP stack",
    )
    if implementation == BASELINE:

        def step(stack, head, x):
            def loss(stack, head, x):
                s, w = cross_entropy(head(stack(x)), targets, jnp.ones(targets.shape))
                return s / w

            return nnx.value_and_grad(loss, argnums=(0, 1, 2))(stack, head, x)

        measure(nnx.jit(step), (stack, head, x), case)
        return
    schedule, *stored = implementation.removeprefix("shardfuse.pipeline.").split(".")
    v = 2 if schedule == "interleaved" else 1
    pipe = Pipeline(
        stack,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=m,
        virtual_stages=v,
        io_spec=P(),
        residuals="stored" if stored else "recompute",
    )

    def step(pipe, head, x):
        loss = lambda pipe, head, x: pipe.loss(x, targets, head=head)  # noqa: E731
        return nnx.value_and_grad(loss, argnums=(0, 1, 2))(pipe, head, x)

    measure(nnx.jit(step), (pipe, head, x), case)
    figures = schedule_table(schedule, STAGES, m, v).to_dict()
    benchmark.extra_info.update(
        {k: figures[k] for k in ("ticks", "bubble", "closed_form_bubble", "peak_in_flight")}
    )
    benchmark.extra_info["residuals"] = pipe.residuals
