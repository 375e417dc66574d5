"""Plan a small LM for the 8 CPU devices with `sf.plan`, then train it from the plan.

The planner picks the mesh (data, sequence, model, ...) and the options
(remat policy, gradient-accumulation microbatches) by predicted step time,
for the figures of an 8-GPU H100 node (CPUs have no entry in
`shardfuse.hardware`; the devices only change the ranking, not what runs).
The plan then builds the `jax.sharding.Mesh` over the CPU devices and hands
its keyword arguments to `sf.layers.ParallelTransformerBlock`; the blocks
run under `jax.lax.scan` with the plan's `jax.checkpoint` policy
(`shardfuse.layers.remat`), and the step accumulates gradients over the
plan's microbatches. The same model and step are what the planner's memory
test compiles (tests/planner/test_memory.py).

Usage: python examples/plan_and_train.py [--steps 20]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import hardware, models
from shardfuse.collectives.ring_attention import to_ring_layout
from shardfuse.layers import ColumnParallelLinear, Norm, ParallelTransformerBlock
from shardfuse.layers import remat as remat_lib
from shardfuse.parallel.zero import shard_spec
from shardfuse.planner import Assumptions, plan

# A Llama-style model small enough for CPU: GQA, SwiGLU, RMSNorm.
TINY = models.ModelSpec("tiny-lm", hidden=64, heads=8, kv_heads=4, head_dim=8, ffn_hidden=128,
                        num_layers=4, vocab_size=128)  # fmt: skip
# What the CPU run is: float32 weights, Adam, the input embedding replicated (it is
# a lookup), the step's outputs not donated (memory_analysis counts them apart).
CPU_ASSUMPTIONS = Assumptions.float32(embedding_sharded=False, donate=False)


def plan_for_cpu(model=TINY, *, global_batch=16, seq_len=128, **restrict):
    """`sf.plan` on one 8-device node, restricted to what this example runs.

    No pipeline and no ZeRO (the layers' `zero=` and `sf.parallel.Pipeline`
    take those), ring attention for the sequence axis.
    """
    options = dict(mesh={"pipeline": 1, "fsdp": 1}, zero=0, cp_strategy="ring") | restrict
    return plan(model, hardware.cluster("h100", devices_per_node=8), global_batch=global_batch,
                seq_len=seq_len, assumptions=CPU_ASSUMPTIONS, **options)  # fmt: skip


class LM(nnx.Module):
    """Embedding, the plan's `ParallelTransformerBlock`s, norm, vocabulary-parallel head."""

    def __init__(self, model: models.ModelShape, the_plan, mesh, *, rngs):
        init = nnx.initializers.normal(0.02)
        table = init(rngs.params(), (model.vocab_size, model.hidden))
        self.embed = nnx.Param(jax.device_put(table, NamedSharding(mesh, P())))
        kwargs = the_plan.layer_kwargs()
        self.blocks = nnx.List(
            [
                ParallelTransformerBlock(
                    model.hidden,
                    model.heads,
                    model.ffn_hidden,
                    mesh=mesh,
                    num_kv_heads=model.kv_heads,
                    head_dim=model.head_dim,
                    rngs=rngs,
                    **kwargs,
                )  # fmt: skip
                for _ in range(model.num_layers)
            ]
        )
        self.norm = Norm(model.hidden, mesh=mesh, rngs=rngs)
        self.head = ColumnParallelLinear(model.hidden, model.vocab_size, mesh=mesh,
                                         sequence_parallel=True, gather_output=False,
                                         use_bias=False, rngs=rngs)  # fmt: skip


def make_step(lm: LM, the_plan, tx):
    """`(params, opt_state, step)`; `step(params, opt_state, tokens, targets)` is one update.

    The blocks run in a `lax.scan` under the plan's remat policy; the batch is
    split into the plan's microbatches and the gradients summed (accumulation).
    ZeRO-1/2 over the plan's fsdp axis (ZeRO-3 is the layers' own `zero=3`):
    the optimizer state lives on fsdp shards (`shard_spec`), the update runs
    on them and the new parameters are gathered back; ZeRO-2 reduce-scatters
    the gradients, ZeRO-1 keeps them whole (all-reduced) and slices them.
    """
    block_def = nnx.split(lm.blocks[0], nnx.Param)[0]
    # The blocks' parameters stacked on a leading layer axis, once (as `sf.layers.Stack`
    # keeps them): the scan reads them in place.
    stacked = jax.tree.map(
        lambda *layers: jnp.stack(layers), *[nnx.split(b, nnx.Param)[1] for b in lm.blocks]
    )
    head_def, head_params = nnx.split((lm.embed, lm.norm, lm.head), nnx.Param)
    params = (head_params, stacked)
    io_spec = lm.blocks[0].io_spec()
    policy, micro = the_plan.layout.remat, the_plan.layout.num_microbatches

    def loss_fn(params, tokens, targets):  # tokens, targets: int [B, T]
        embed, norm, head = nnx.merge(head_def, params[0])
        x = embed[...].at[tokens].get(out_sharding=io_spec)  # [B, T, F]

        def body(x, block_params):
            return nnx.merge(block_def, block_params)(x), None

        x, _ = jax.lax.scan(remat_lib.checkpoint(body, policy), x, params[1])
        logits = head(norm(x))  # [B, T, V], the vocabulary sharded over model
        onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
        onehot = jax.sharding.reshard(onehot, jax.typeof(logits).sharding.spec)
        nll = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * onehot, axis=-1)
        return nll.mean()

    mesh = lm.embed[...].sharding.mesh
    zero, fsdp = the_plan.layout.zero, "fsdp" if the_plan.layout.fsdp > 1 else None
    sharded = zero in (1, 2) and fsdp is not None

    def on_shards(tree):  # ZeRO-1/2: each array on its fsdp shards
        def one(a):
            return jax.sharding.reshard(
                a, shard_spec(jax.typeof(a).sharding.spec, a.shape, mesh, fsdp)
            )

        return jax.tree.map(one, tree)

    def step(params, opt_state, tokens, targets):
        if micro == 1:
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        else:

            def split(a):  # [B, T] -> [micro, B / micro, T]: microbatch i = rows j * micro + i
                batch, length = a.shape  # (strided, so every device keeps its own rows)
                rows = P(io_spec[0], None, "sequence")
                a = a.reshape(batch // micro, micro, length, out_sharding=rows)
                return jnp.swapaxes(a, 0, 1)

            def accumulate(carry, batch):
                loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zeros, (split(tokens), split(targets)))
            loss, grads = loss / micro, jax.tree.map(lambda g: g / micro, grads)
        if not sharded:
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        if zero == 1:  # the whole gradients first (all-reduced), then this device's shard
            grads = jax.lax.optimization_barrier(grads)
        grads, shards = on_shards(grads), on_shards(params)
        updates, opt_state = tx.update(grads, opt_state, shards)
        new = optax.apply_updates(shards, updates)
        specs = jax.tree.map(lambda a: jax.typeof(a).sharding.spec, params)
        return jax.tree.map(jax.sharding.reshard, new, specs), opt_state, loss

    with jax.set_mesh(mesh):
        opt_state = jax.jit(lambda p: tx.init(on_shards(p) if sharded else p))(params)
    return params, opt_state, jax.jit(step)


def make_batch(rng, batch, seq_len, vocab, mesh, batch_spec):
    """Arithmetic sequences (`token[t + 1] = (token[t] + step) % vocab`), ring (zigzag) order."""
    start = rng.integers(0, vocab, (batch, 1))
    step = rng.integers(1, 5, (batch, 1))
    seq = (start + step * np.arange(seq_len + 1)[None, :]) % vocab
    ring = mesh.shape["sequence"]
    sharding = NamedSharding(mesh, P(batch_spec, "sequence"))
    tokens, targets = (jnp.asarray(a, jnp.int32) for a in (seq[:, :-1], seq[:, 1:]))
    if ring > 1:
        tokens, targets = (to_ring_layout(a, ring, "zigzag") for a in (tokens, targets))
    return jax.device_put(tokens, sharding), jax.device_put(targets, sharding)


def train(the_plan, *, steps=20, model=TINY, log=print):
    """Trains `model` with `the_plan` on the first 8 devices; returns the losses."""
    mesh = the_plan.mesh(jax.devices()[: the_plan.layout.num_devices])
    lm = LM(model, the_plan, mesh, rngs=nnx.Rngs(0))
    params, opt_state, step = make_step(lm, the_plan, optax.adam(3e-3))
    rng, losses, start = np.random.default_rng(0), [], time.perf_counter()
    with jax.set_mesh(mesh):
        for i in range(steps):
            batch = make_batch(rng, the_plan.global_batch, the_plan.seq_len, model.vocab_size,
                               mesh, lm.blocks[0].io_spec()[0])  # fmt: skip
            params, opt_state, loss = step(params, opt_state, *batch)
            losses.append(float(loss))
            if i == 0 or (i + 1) % 5 == 0:
                log(f"step {i + 1:3d}/{steps}  loss {losses[-1]:.4f}  "
                    f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts
    plans = plan_for_cpu()
    for rank, p in enumerate(plans[:3], 1):
        print(f"plan {rank}: {p.summary()}")
    print(plans[0].explain())
    losses = train(plans[0], steps=args.steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
