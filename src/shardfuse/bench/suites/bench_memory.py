"""Memory suite: ZeRO stage x remat policy, per-device bytes and step time on 8 CPU devices.

Two groups:

- `remat`: the forward and backward of a `sf.layers.Stack` of
  `ParallelTransformerBlock`s (one `lax.scan` over the layers), one case per
  policy ("none" is the baseline). `extra_info["memory"]["temp_bytes"]` is
  the compiled program's temporary memory per device (the activations the
  backward keeps plus one layer's backward working set),
  `extra_info["temp_bytes_per_layer"]` what one more layer adds to it, and
  `extra_info["saved_activations"]` the bytes of the residuals the policy
  keeps (device and host); the README's table reads them.
- `zero`: a tiny-LM training step (`sf.parallel.accumulate` over 4
  microbatches + `ZeroOptimizer` AdamW update) on a (data 2, fsdp 4) mesh, one
  case per ZeRO stage and per remat policy ("zero0-none" is the baseline).
  `extra_info["state_bytes"]` holds the per-device bytes of parameters,
  gradients and optimizer state (`addressable_shards`).

On CPU the 8 devices share the host's cores: times show the overhead of
each option, not accelerator speed; the memory figures are the compiled
program's own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from shardfuse.bench.harness import BenchCase
from shardfuse.flops import REMAT_POLICIES
from shardfuse.layers import ParallelTransformerBlock, Stack
from shardfuse.layers.fsdp import ZERO_STAGES
from shardfuse.models import ModelSpec, Transformer
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.zero import ZeroOptimizer

POLICIES = REMAT_POLICIES
STAGES = ZERO_STAGES


def pytest_generate_tests(metafunc):
    name = metafunc.function.__name__
    quick = "quick" in metafunc.config.bench_scale.name
    # --quick: the baseline and the extremes (each case compiles a training step, seconds)
    if name == "test_remat_policy":
        metafunc.parametrize("policy", ("none", "full", "selective") if quick else POLICIES)
    elif name == "test_zero_step":
        stages, policies = ((0, 3), ("none",)) if quick else (STAGES, POLICIES)
        cases = [(z, p) for z in stages for p in policies]
        metafunc.parametrize("zero, policy", cases, ids=[f"zero{z}-{p}" for z, p in cases])


def block_stack(policy, mesh, *, layers, features, heads, kv_heads, hidden, abstract=False):
    """A `sf.layers.Stack` of `layers` SwiGLU blocks (`lax.scan` over the layer axis).

    `abstract`: shapes only (`nnx.eval_shape`), for programs that are compiled, not run.
    """

    def make():
        return Stack(
            lambda rngs: ParallelTransformerBlock(
                features, heads, hidden, num_kv_heads=kv_heads, mesh=mesh, rngs=rngs
            ),
            layers,
            mesh=mesh,
            remat=policy,
            rngs=nnx.Rngs(0),
        )

    return nnx.eval_shape(make) if abstract else make()


def stack_loss(graphdef):
    """`loss(state, x)`: mean square of the stack's output (the step differentiates it)."""

    def loss(state, x):
        y = nnx.merge(graphdef, state)(x)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return loss


def stack_step(graphdef):
    """Gradients of `stack_loss` with respect to the stacked parameters and the input."""
    return jax.grad(stack_loss(graphdef), argnums=(0, 1))


def saved_activations(graphdef, state, x) -> dict:
    """Bytes of the activations the backward keeps (`[L, B, T, ...]` residuals), per memory.

    What `jax.ad_checkpoint.print_saved_residuals` lists, traced (nothing compiled):
    `{"device": bytes, "host": bytes}` (host: what "offload" moves to `pinned_host`).
    """
    layers, (B, T) = jax.tree.leaves(state)[0].shape[0], x.shape[:2]
    out = {"device": 0, "host": 0}
    for aval, _ in saved_residuals(stack_loss(graphdef), state, x):
        if aval.shape[:3] == (layers, B, T):
            space = str(getattr(aval, "memory_space", "device")).lower()
            out["host" if "host" in space else "device"] += aval.size * aval.dtype.itemsize
    return out


# Llama-like proportions (hidden = 2.75 F, 2:1 GQA, head dim 64), float32 (CPU's native type:
# XLA:CPU keeps bfloat16 residual stacks in float32), forward + backward.
BLOCK = dict(layers=4, features=512, heads=8, kv_heads=4, hidden=1408)
QUICK_BLOCK = dict(layers=4, features=256, heads=4, kv_heads=2, hidden=704)


def test_remat_policy(measure, benchmark, bench_scale, policy):
    """One policy: compiled temp, temp per layer (L vs L/2), saved activations, step time.

    `extra_info["memory"]["temp_bytes"]` is the step's temporary memory;
    `extra_info["temp_bytes_per_layer"]` what one more layer adds to it
    (`(temp(L) - temp(L/2)) / (L/2)`: the memory that grows with depth, which a
    policy is about; the rest is one layer's backward working set);
    `extra_info["saved_activations"]` the residual bytes (device and host).
    """
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    quick = "quick" in bench_scale.name
    block = QUICK_BLOCK if quick else BLOCK
    B, T = 1, 512 if quick else 1024
    x = jax.random.normal(jax.random.key(0), (B, T, block["features"]))
    graphdef, state = nnx.split(block_stack(policy, mesh, **block))
    case = BenchCase(
        op="remat_stack",
        implementation=f"remat.{policy}",
        mode="fwd+bwd",
        shape={"L": block["layers"], "B": B, "T": T, "F": block["features"], "mesh": "1"},
        dtype="float32",
        flops=0.0,
        bytes=0.0,
        baseline="remat.none",
        variant="causal gqa swiglu, sf.layers.Stack (lax.scan over blocks)",
    )
    info = measure(stack_step(graphdef), (state, x), case)
    half = dict(block, layers=block["layers"] // 2)
    half_graphdef, half_state = nnx.split(block_stack(policy, mesh, **half, abstract=True))
    compiled = jax.jit(stack_step(half_graphdef)).lower(half_state, x).compile()
    half_temp = compiled.memory_analysis().temp_size_in_bytes
    per_layer = (info["memory"]["temp_bytes"] - half_temp) / (block["layers"] - half["layers"])
    # the JSON keeps benchmark.extra_info (measure's returned dict is a copy)
    benchmark.extra_info.update(
        temp_bytes_per_layer=per_layer,
        saved_activations=saved_activations(graphdef, state, x),
    )


def _per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_zero_step(measure, benchmark, zero, policy):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    spec = ModelSpec.tiny(vocab_size=512, hidden=128, ffn_hidden=512, num_layers=2)
    model = Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0), zero=zero, remat=policy)
    optimizer = ZeroOptimizer(model, optax.adamw(1e-3), mesh=mesh, zero=zero)
    grad_fn = accumulate(Transformer.loss, 4, mesh=mesh, zero=zero)
    B, T = 32, 64
    rng = np.random.default_rng(0)
    batch = dict(
        tokens=jnp.asarray(rng.integers(0, 512, (B, T)), jnp.int32),
        targets=jnp.asarray(rng.integers(0, 512, (B, T)), jnp.int32),
        mask=jnp.ones((B, T), jnp.float32),
    )
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer)), grads

    case = BenchCase(
        op="zero_training_step",
        implementation=f"zero{zero}-{policy}",
        mode="fwd+bwd+update",
        shape={"L": 2, "B": B, "T": T, "F": 128, "microbatches": 4, "mesh": "data2xfsdp4"},
        dtype="float32",
        flops=0.0,
        bytes=0.0,
        baseline="zero0-none",
        variant="tiny LM, AdamW",
    )
    # The gradients' per-device bytes from the measured step's own outputs (a second
    # compilation of the step just for them doubled the suite's compile time).
    measure(step, (state, batch), case, inspect=lambda out: {"gradient_bytes": _per_device(out[2])})
    benchmark.extra_info["state_bytes"] = {
        "parameters": _per_device(nnx.state(model, nnx.Param)),
        "gradients": benchmark.extra_info.pop("gradient_bytes"),
        "optimizer_state": _per_device(nnx.state(optimizer, nnx.OptState)),
    }
