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

from shardfuse.collectives.ring_attention import to_ring_layout
from shardfuse.layers import place_on_mesh
from shardfuse.layers.loss import token_loss
from shardfuse.model_spec import ModelSpec
from shardfuse.models.transformer import Transformer


def make_batch(rng, batch, seq_len, vocab):
    """Synthetic arithmetic sequences: int32 `(tokens, targets)` `[batch, seq_len]`."""
    start = rng.integers(0, vocab, (batch, 1))
    step = rng.integers(1, 5, (batch, 1))
    seq = (start + step * np.arange(seq_len + 1)[None, :]) % vocab
    return jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32)


def train(steps=30, layers=2, seq_len=64, batch=4, vocab=64, features=64, log=print, times=None):
    """Trains the tiny LM; returns the list of losses.

    `times`, a list, receives the wall time of each step (the first one
    includes compilation; the others must not recompile).
    """
    mesh = jax.make_mesh((2, 2, 2), ("data", "sequence", "model"))  # Explicit axes
    spec = ModelSpec.tiny(
        "tiny_lm", vocab_size=vocab, hidden=features, ffn_hidden=2 * features, num_layers=layers
    )
    model = Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))
    # place_on_mesh: the optimizer's step counters start on one device; a jitted step
    # returns them on the mesh, which would make the second step compile again.
    optimizer = place_on_mesh(nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param), mesh)
    ring = mesh.shape["sequence"]

    @nnx.jit
    def train_step(model, optimizer, tokens, targets):
        def loss_fn(model):
            total, count = token_loss(model(tokens), targets)
            return total / count

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(0)
    losses = []
    times = [] if times is None else times
    start = time.perf_counter()
    for step in range(steps):
        step_start = time.perf_counter()
        tokens, targets = make_batch(rng, batch, seq_len, vocab)
        # Ring (zigzag) order once at the input; the loss does not care about order.
        tokens = to_ring_layout(tokens, ring, "zigzag")
        targets = to_ring_layout(targets, ring, "zigzag")
        # Traced under the mesh, as JAX asks for Explicit axes: the loss's gradient (the
        # transpose of optax's label gather) builds its zeros on the context mesh; newer JAX
        # cannot shard them without one (ShardingTypeError on the scatter).
        with jax.set_mesh(mesh):
            loss = float(train_step(model, optimizer, tokens, targets))
        times.append(time.perf_counter() - step_start)
        losses.append(loss)
        if step == 0 or (step + 1) % 5 == 0 or step == steps - 1:
            log(
                f"step {step + 1:3d}/{steps}  loss {loss:.4f}  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    return losses


def rows(seq_len: int = 512):
    """Demo section: trains the tiny LM (its own sizes; `seq_len` is unused) and reports.

    `seconds` is the median step time after the first step; `compile_seconds`
    the first step (compilation included).
    """
    del seq_len
    times = []
    losses = train(log=lambda line: print(f"  tiny LM {line}", flush=True), times=times)
    return [
        dict(
            op="tiny causal LM training",
            implementation="layers on 2x2x2",
            case=f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps",
            shape="B4 T64 F64 H4 K2, 2 blocks",
            error=None,
            seconds=float(np.median(times[1:])),
            compile_seconds=times[0],
        )
    ]
