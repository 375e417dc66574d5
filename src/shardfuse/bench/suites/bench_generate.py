"""Generation benchmarks: prefill and one decode step of `sf.models.generate`'s program.

For each model (scaled to the run's scale, 2 layers) and sequence length S
(the prompt), the suite times, in the same run:

- `prefill`: the prompt `[B, S]` through the model, its keys and values
  written into a cache of `S + 32` rows (flash attention, causal);
- `decode`: one new token per row against that cache (decode attention),
  i.e. the per-token latency; tokens/s = B / time.

Each has two implementations: `shardfuse` (the platform's attention
preference) and `reference` (both steps with `implementation="reference"`,
the baseline). FLOPs are the model FLOPs of the tokens processed
(`shardfuse.flops`, forward only); bytes are the parameters plus the cache
read once.
"""

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from shardfuse import flops as model_flops
from shardfuse.bench.harness import BenchCase
from shardfuse.models import MODELS, Transformer
from shardfuse.models.generation import DecodeProgram

OP = "generate"
STEPS = ("prefill", "decode")
IMPLEMENTATIONS = ("reference", "shardfuse")
NEW_TOKENS = 32


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_generate":
        return
    scale = metafunc.config.bench_scale
    params, ids = [], []
    for model in scale.models:
        for seq_len in scale.seq_lens:
            for step in STEPS:
                for impl in IMPLEMENTATIONS:
                    params.append((model, seq_len, step, impl))
                    ids.append(f"{model}-S{seq_len}-{step}-{impl}")
    metafunc.parametrize("model_name, seq_len, step, implementation", params, ids=ids)


@functools.lru_cache(maxsize=1)  # the cases run model by model: one model held at a time
def _model(spec):
    """The model of `spec` on one device, initialised once for all of its cases (gemma2's
    vocabulary makes 0.9 GB of parameters: seconds to draw)."""
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    return Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))


def test_generate(measure, bench_scale, model_name, seq_len, step, implementation):
    spec = bench_scale.scaled(MODELS[model_name])
    spec = dataclasses.replace(spec, num_layers=2)
    B = 1
    model = _model(spec)
    impl = "reference" if implementation == "reference" else None
    program = DecodeProgram(model, batch=B, cache_size=seq_len + NEW_TOKENS, implementation=impl)
    prompt = jnp.zeros((B, seq_len), jnp.int32)
    tokens = B * (seq_len if step == "prefill" else 1)
    # forward FLOPs per token: the training figure over its 3x (forward + backward)
    per_token = model_flops.model_flops_per_token(spec, seq_len) / model_flops.TRAINING_OVER_FORWARD
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(program.params))
    cache_bytes = (
        2 * jnp.dtype(program.cache_dtype).itemsize * int(jnp.prod(jnp.array(program.cache_shape)))
    )
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode="fwd",
        shape={"B": B, "S": seq_len, "L": spec.num_layers, "F": spec.hidden},
        dtype=str(program.cache_dtype),
        flops=per_token * tokens,
        bytes=params_bytes + cache_bytes,
        baseline="reference",
        model=spec.name,
        variant=step,
        seq_len=seq_len,
    )

    # The parameters are arguments of the timed program: closed over, they became constants
    # of it, and XLA spent 30 s folding gemma2's 0.9 GB of them into each compilation.
    def with_params(params):
        traced = copy.copy(program)
        traced.params = params
        return traced

    if step == "prefill":
        fn = lambda params, tokens: with_params(params).prefill(tokens)[0]  # noqa: E731
        args = (program.params, prompt)
    else:
        _, cache = program.prefill(prompt)
        nxt = jnp.zeros((B, 1), jnp.int32)
        fn = lambda params, nxt, cache, start: with_params(params).step(nxt, cache, start)[0]  # noqa: E731
        args = (program.params, nxt, cache, jnp.int32(seq_len))
    measure(fn, args, case)
