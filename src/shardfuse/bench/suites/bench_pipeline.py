"""Pipeline benchmarks: a training step through `Pipeline.loss`, schedules x m at fixed p.

Each group (one number of microbatches m) times, in the same run, the loss
and every gradient (stack, head, input) of the blocks and head of an
`sf.models.Transformer` (the scale's Llama 3 8B, widths and heads / 8 on CPU,
8 layers, vocabulary 256), batch = 2 m, by:

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
bubble, peak in-flight microbatches of the executor's lockstep table) and
`lockstep_over_ideal`: the IR's lockstep work (`lockstep.lockstep_work`,
what every device executes: every stage one F and one B per tick, the head
in the last stage's F ticks) over the busiest stage's work without a bubble,
from the layers' and the head's FLOPs (`sf.flops`), next to the compiled
memory the harness records.

`test_pipeline_by_model_step` times the same kind of step on a tensor
parallel stack (`sf.layers.ParallelMLP` blocks, a psum per layer inside the
stage) pipelined over pipeline 4 x model 2 (1F1B) against the same model on
model 2 alone, side by side in one group (`model2.unpipelined` the
baseline). On CPU the stages share the host's cores, so times show the
pipelined program's overhead, not the speedup of p accelerators.
"""

import jax
import jax.numpy as jnp
from flax import nnx

import shardfuse as sf
from shardfuse import flops
from shardfuse.bench.harness import BenchCase
from shardfuse.layers.loss import token_loss
from shardfuse.layers.stack import Stack
from shardfuse.models import MODELS
from shardfuse.parallel.pipeline.api import Pipeline
from shardfuse.parallel.pipeline.lockstep import lockstep_table
from shardfuse.parallel.pipeline.schedule import HEAD, B, F, schedule_table

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
QUICK_SEQ = 32  # --quick: half the tokens per microbatch


def seq_len(scale) -> int:
    """Tokens per sequence at this scale."""
    return QUICK_SEQ if "quick" in scale.name else SEQ


def _measure_unpipelined(measure, stack, head, x, targets, case):
    """Times forward + backward of `head(stack(x))`'s mean token loss, no pipeline.

    `measure` is the suite's fixture; `targets` the token ids the loss compares with.
    """

    def step(stack, head, x):
        def loss(stack, head, x):
            s, w = token_loss(head(stack(x)), targets, jnp.ones(targets.shape))
            return s / w

        return nnx.value_and_grad(loss, argnums=(0, 1, 2))(stack, head, x)

    measure(nnx.jit(step), (stack, head, x), case)


# --quick: m = p only, every schedule with recomputed residuals: each case is a training
# step of seconds on CPU, compiled for seconds more (stored residuals: twice that); m = 2p,
# 4p and the stored residuals are the full scale's.
QUICK_IMPLEMENTATIONS = tuple(i for i in IMPLEMENTATIONS if not i.endswith(".stored"))


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ not in ("test_pipeline_step", "test_pipeline_by_model_step"):
        return
    quick = "quick" in metafunc.config.bench_scale.name
    counts = (STAGES,) if quick else (STAGES, 2 * STAGES, 4 * STAGES)
    implementations = QUICK_IMPLEMENTATIONS if quick else IMPLEMENTATIONS
    params = [(m, impl) for m in counts for impl in implementations]
    if metafunc.function.__name__ == "test_pipeline_by_model_step":
        params = [(m, impl) for m in counts for impl in BY_MODEL]
    metafunc.parametrize("m, implementation", params, ids=[f"m{m}-{i}" for m, i in params])


def test_pipeline_step(measure, bench_scale, benchmark, m, implementation):
    spec = bench_scale.scaled(MODELS[MODEL]).replace(num_layers=LAYERS, vocab_size=VOCAB)
    features = spec.hidden
    devices = jax.devices()[:STAGES] if implementation != BASELINE else jax.devices()[:1]
    mesh = jax.make_mesh((len(devices),), ("pipeline",), devices=devices)
    lm = sf.models.Transformer(spec, mesh=mesh, pipelined=True, rngs=nnx.Rngs(0))
    stack, head = lm.blocks, lm.head
    batch = MICROBATCH * m
    seq = seq_len(bench_scale)
    x = jax.random.normal(jax.random.key(0), (batch, seq, features))
    targets = jax.random.randint(jax.random.key(1), (batch, seq), 0, VOCAB)
    tokens = batch * seq
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=flops.FWD_BWD,
        shape={"p": STAGES, "m": m, "B": batch, "T": seq, "F": features, "L": LAYERS},
        dtype="float32",
        flops=flops.model_flops(spec, seq_len=seq, batch=batch),
        bytes=4 * tokens * features * 4,
        baseline=BASELINE,
        model=spec.name,
        variant="transformer stack",
    )
    if implementation == BASELINE:
        _measure_unpipelined(measure, stack, head, x, targets, case)
        return
    schedule, *stored = implementation.removeprefix("shardfuse.pipeline.").split(".")
    v = 2 if schedule == "interleaved" else 1
    pipe = Pipeline(
        stack,
        mesh=mesh,
        schedule=schedule,
        num_microbatches=m,
        virtual_stages=v,
        residuals="stored" if stored else "recompute",
    )

    def step(pipe, head, x):
        loss = lambda pipe, head, x: pipe.loss(x, targets, head=head)  # noqa: E731
        return nnx.value_and_grad(loss, argnums=(0, 1, 2))(pipe, head, x)

    measure(nnx.jit(step), (pipe, head, x), case)
    layer = flops.layer_matmul_flops(spec) + flops.layer_attention_flops(spec, seq)
    figures = schedule_figures(
        schedule, m, v, pipe.residuals, layer, flops.logits_flops(spec), seq=seq
    )
    benchmark.extra_info.update(figures)


def schedule_figures(schedule, m, v, residuals, layer_flops, head_flops, *, seq=SEQ):
    """The IR's figures of one case: ticks, bubbles, in flight, lockstep work / ideal.

    `layer_flops` and `head_flops`: forward FLOPs per token of one layer and of the head;
    `seq`: tokens per sequence.
    """
    figures = schedule_table(schedule, STAGES, m, v).to_dict()
    table = lockstep_table(schedule, STAGES, m, v)
    tokens = MICROBATCH * seq
    forward = LAYERS // (STAGES * v) * tokens * layer_flops
    backward = 2 * forward + (forward if residuals == "recompute" else 0)
    cost = {F: forward, B: backward, HEAD: 3 * tokens * head_flops}
    return dict(
        ticks=table.num_ticks,
        bubble=figures["bubble"],
        closed_form_bubble=figures["closed_form_bubble"],
        peak_in_flight=[int(n) for n in table.in_flight()],
        lockstep_over_ideal=round(table.work(cost) / table.ideal(cost), 4),
        residuals=residuals,
    )


BY_MODEL = ("shardfuse.pipeline.1f1b.pipeline4xmodel2", "model2.unpipelined")


class TensorParallelBlock(nnx.Module):
    def __init__(self, features, hidden, mesh, rngs):
        self.mlp = sf.layers.ParallelMLP(features, hidden, mesh=mesh, rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(x)


def test_pipeline_by_model_step(measure, bench_scale, benchmark, m, implementation):
    model = bench_scale.scaled(MODELS[MODEL])
    features, hidden = model.hidden, model.ffn_hidden
    pipelined = implementation != BY_MODEL[1]
    shape = (STAGES, 2) if pipelined else (1, 2)
    devices = jax.devices()[: shape[0] * shape[1]]
    mesh = jax.make_mesh(shape, ("pipeline", "model"), devices=devices)
    stack = Stack(
        lambda rngs: TensorParallelBlock(features, hidden, mesh, rngs),
        LAYERS,
        mesh=mesh,
        layer_axis="pipeline",
        rngs=nnx.Rngs(0),
    )
    head = nnx.Linear(features, VOCAB, rngs=nnx.Rngs(1))
    batch = MICROBATCH * m
    seq = seq_len(bench_scale)
    x = jax.random.normal(jax.random.key(0), (batch, seq, features))
    targets = jax.random.randint(jax.random.key(1), (batch, seq), 0, VOCAB)
    tokens = batch * seq
    matmuls = LAYERS * 2 * flops.matmul_flops(tokens, hidden, features)
    case = BenchCase(
        op="pipeline_by_model_step",
        implementation=implementation,
        mode=flops.FWD_BWD,
        shape={"p": STAGES, "T_axis": 2, "m": m, "B": batch, "T": seq, "F": features},
        dtype="float32",
        flops=flops.TRAINING_OVER_FORWARD * (matmuls + flops.matmul_flops(tokens, VOCAB, features)),
        bytes=4 * tokens * features * 4,
        baseline=BY_MODEL[1],
        model=model.name,
        variant="tensor parallel residual MLP stack",
    )
    if not pipelined:
        _measure_unpipelined(measure, stack, head, x, targets, case)
        return
    pipe = Pipeline(stack, mesh=mesh, schedule="1f1b", num_microbatches=m)

    def step(pipe, head, x):
        loss = lambda pipe, head, x: pipe.loss(x, targets, head=head)  # noqa: E731
        return nnx.value_and_grad(loss, argnums=(0, 1, 2))(pipe, head, x)

    measure(nnx.jit(step), (pipe, head, x), case)
    layer, head_flops = (
        2 * flops.matmul_flops(1, hidden, features),
        flops.matmul_flops(1, VOCAB, features),
    )
    figures = schedule_figures("1f1b", m, 1, pipe.residuals, layer, head_flops, seq=seq)
    benchmark.extra_info.update(figures)
