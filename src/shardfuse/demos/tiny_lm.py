"""Train a tiny causal language model on a 2x2x2 CPU mesh (data, sequence, model).

Every parallelism of shardfuse at once: batch over `data`, ring attention
(zigzag layout) over `sequence`, tensor parallelism with Megatron sequence
parallelism over `model`. The data are synthetic arithmetic sequences
(`token[t + 1] = (token[t] + step) % vocab`, random start and step per
sequence), so the loss must fall within a few dozen steps.

Run it with `python examples/tiny_lm.py` or as part of `shardfuse demo`.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import shardfuse as sf
from shardfuse.layers import _sharding


class TinyLM(nnx.Module):
    """Embedding, `ParallelTransformerBlock`s, final norm, column-parallel vocabulary head."""

    def __init__(self, *, vocab, features, heads, kv_heads, hidden, layers, mesh, rngs):
        self.mesh = mesh
        init = nnx.initializers.normal(0.02)
        self.embed = _sharding.replicated_param(
            init, rngs.params(), (vocab, features), jnp.float32, mesh
        )
        self.blocks = nnx.List(
            [
                sf.layers.ParallelTransformerBlock(
                    features,
                    heads,
                    hidden,
                    num_kv_heads=kv_heads,
                    mesh=mesh,
                    layout="zigzag",
                    rngs=rngs,
                )
                for _ in range(layers)
            ]
        )
        self.norm = sf.layers.Norm(features, mesh=mesh, rngs=rngs)
        self.head = sf.layers.ColumnParallelLinear(
            features,
            vocab,
            mesh=mesh,
            sequence_parallel=True,
            gather_output=True,
            use_bias=False,
            rngs=rngs,
        )

    def __call__(self, tokens):
        """tokens int `[B, T]` in ring (zigzag) order -> logits `[B, T, vocab]`."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_batch(rng, batch, seq_len, vocab):
    start = rng.integers(0, vocab, (batch, 1))
    step = rng.integers(1, 5, (batch, 1))
    seq = (start + step * np.arange(seq_len + 1)[None, :]) % vocab
    return jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32)


def train(steps=30, layers=2, seq_len=64, batch=4, vocab=64, features=64, log=print):
    """Trains the tiny LM; returns the list of losses."""
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "sequence", "model")
    )
    model = TinyLM(
        vocab=vocab,
        features=features,
        heads=4,
        kv_heads=2,
        hidden=2 * features,
        layers=layers,
        mesh=mesh,
        rngs=nnx.Rngs(0),
    )
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    # Scalars (step counts) are created on one device; replicate them over the mesh
    # now, or the second step recompiles when they come back mesh-sharded.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = nnx.state(optimizer)
    nnx.update(
        optimizer,
        jax.tree.map(
            lambda x: (
                x
                if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)
                else jax.device_put(x, replicated)
            ),
            state,
        ),
    )
    ring = mesh.shape["sequence"]

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        def loss_fn(model):
            logits = model(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        tokens, targets = make_batch(rng, batch, seq_len, vocab)
        # Ring (zigzag) order once at the input; the loss does not care about order.
        tokens = sf.to_ring_layout(tokens, ring, "zigzag")
        targets = sf.to_ring_layout(targets, ring, "zigzag")
        loss = float(train_step(model, optimizer, tokens, targets))
        losses.append(loss)
        if step == 0 or (step + 1) % 5 == 0 or step == steps - 1:
            log(
                f"step {step + 1:3d}/{steps}  loss {loss:.4f}  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    return losses


def rows(seq_len: int = 512):
    """Demo section: trains the tiny LM (its own sizes; `seq_len` is unused) and reports."""
    del seq_len
    start = time.perf_counter()
    losses = train(log=lambda line: print(f"  tiny LM {line}", flush=True))
    return [
        dict(
            op="tiny causal LM training",
            implementation="layers on 2x2x2",
            case=f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps",
            shape="B4 T64 F64 H4 K2, 2 blocks",
            error=None,
            seconds=time.perf_counter() - start,
        )
    ]
