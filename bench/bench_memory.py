"""Memory suite: ZeRO stage x remat policy, per-device bytes and step time on 8 CPU devices.

Two groups:

- `remat`: the forward and backward of a stack of `ParallelTransformerBlock`s
  applied by `nnx.scan` (what `sf.layers.Stack` does), one case per policy
  ("none" is the baseline). `extra_info["memory"]["temp_bytes"]` is the
  compiled program's temporary memory per device: the activations the
  backward keeps plus workspace; the note's table reads it.
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

from shardfuse.bench.harness import BenchCase
from shardfuse.demos.tiny_lm import TinyLM, token_loss
from shardfuse.layers import ParallelTransformerBlock, remat
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.zero import ZeroOptimizer

POLICIES = remat.POLICIES
STAGES = (0, 1, 2, 3)


def pytest_generate_tests(metafunc):
    name = metafunc.function.__name__
    quick = "quick" in metafunc.config.bench_scale.name
    if name == "test_remat_policy":
        metafunc.parametrize("policy", POLICIES)
    elif name == "test_zero_step":
        policies = ("none", "selective") if quick else POLICIES
        cases = [(z, p) for z in STAGES for p in policies]
        metafunc.parametrize("zero, policy", cases, ids=[f"zero{z}-{p}" for z, p in cases])


def stacked_blocks(policy, mesh, *, layers, features, heads, kv_heads, hidden):
    """`(graphdef, state)`: `layers` blocks with parameters stacked on a leading axis."""
    blocks = [
        ParallelTransformerBlock(
            features,
            heads,
            hidden,
            num_kv_heads=kv_heads,
            mesh=mesh,
            remat=policy,
            rngs=nnx.Rngs(i),
        )
        for i in range(layers)
    ]
    graphdef = nnx.graphdef(blocks[0])
    return graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])


def scan_step(graphdef):
    """Gradients of a loss on the stack applied by `nnx.scan`."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def layer(x, state):
        return nnx.merge(graphdef, state)(x), None

    def loss(state, x):
        y, _ = layer(x, state)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return jax.grad(loss, argnums=(0, 1))


BLOCK = dict(layers=4, features=256, heads=8, kv_heads=4, hidden=1024)


def test_remat_policy(measure, bench_scale, policy):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    B, T = 2, 256 if "quick" in bench_scale.name else 512
    graphdef, state = stacked_blocks(policy, mesh, **BLOCK)
    x = jax.random.normal(jax.random.key(0), (B, T, BLOCK["features"]))
    case = BenchCase(
        op="remat_stack",
        implementation=f"remat.{policy}",
        mode="fwd+bwd",
        shape={"L": BLOCK["layers"], "B": B, "T": T, "F": BLOCK["features"], "mesh": "1"},
        dtype="float32",
        flops=0.0,
        bytes=0.0,
        baseline="remat.none",
        variant="causal gqa swiglu, nnx.scan over blocks",
    )
    measure(scan_step(graphdef), (state, x), case)


def _per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_zero_step(measure, zero, policy):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    model = TinyLM(
        vocab=512,
        features=128,
        heads=4,
        kv_heads=2,
        hidden=512,
        layers=2,
        mesh=mesh,
        rngs=nnx.Rngs(0),
        zero=zero,
        remat=policy,
    )
    optimizer = ZeroOptimizer(model, optax.adamw(1e-3), mesh=mesh, zero=zero)
    grad_fn = accumulate(token_loss, 4, mesh=mesh, zero=zero)
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

    grads = jax.jit(lambda s, b: step(s, b)[2])(state, batch)
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
    info = measure(step, (state, batch), case)
    info["state_bytes"] = {
        "parameters": _per_device(nnx.state(model, nnx.Param)),
        "gradients": _per_device(grads),
        "optimizer_state": _per_device(nnx.state(optimizer, nnx.OptState)),
    }
