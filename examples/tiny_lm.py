"""Train a tiny causal language model on a 2x2x2 CPU mesh (data, sequence, model).

Every parallelism of shardfuse at once: batch over `data`, ring attention
(zigzag layout) over `sequence`, tensor parallelism with Megatron sequence
parallelism over `model`. The data are synthetic arithmetic sequences
(`token[t + 1] = (token[t] + step) % vocab`, random start and step per
sequence), so the loss must fall within a few dozen steps.

Usage: python examples/tiny_lm.py [--steps 30] [--layers 2]
"""

import argparse
import time

import jax

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import shardfuse as sf  # noqa: E402
from shardfuse.layers import _sharding  # noqa: E402


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    losses = train(steps=args.steps, layers=args.layers)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
