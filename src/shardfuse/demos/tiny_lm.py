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
from shardfuse.layers import (
    ColumnParallelLinear,
    Norm,
    ParallelTransformerBlock,
    in_manual_region,
    place_on_mesh,
    sharded_param,
)
from shardfuse.layers.fsdp import DEFAULT_FSDP_AXIS
from shardfuse.layers.stack import check_head


class TinyLM(nnx.Module):
    """Embedding, `ParallelTransformerBlock`s, final norm, column-parallel vocabulary head.

    `zero`, `remat` (and the other `ParallelTransformerBlock` keywords in
    `block_kwargs`) go to the blocks and the head; with zero=3 the embedding
    `[vocab, features]` is sharded over the fsdp axis on its vocabulary
    dimension too (`shardfuse.parallel.accumulate` gathers it per
    microbatch). Runs normally or per shard (inside the full-manual region of
    `sf.parallel.accumulate`, with tokens sharded `P((data, fsdp), sequence)`).
    """

    def __init__(
        self,
        *,
        vocab,
        features,
        heads,
        kv_heads,
        hidden,
        layers,
        mesh,
        rngs,
        zero=0,
        remat="none",
        **block_kwargs,
    ):
        self.mesh = mesh
        init = nnx.initializers.normal(0.02)
        fsdp = DEFAULT_FSDP_AXIS if zero == 3 and DEFAULT_FSDP_AXIS in mesh.axis_names else None
        embed_spec = jax.sharding.PartitionSpec(fsdp, None)
        self.embed = sharded_param(
            init, rngs.params(), (vocab, features), jnp.float32, mesh, embed_spec
        )
        layer_kwargs = dict(mesh=mesh, zero=zero, rngs=rngs)
        self.blocks = nnx.List(
            [
                ParallelTransformerBlock(
                    features,
                    heads,
                    hidden,
                    num_kv_heads=kv_heads,
                    layout="zigzag",
                    remat=remat,
                    **block_kwargs,
                    **layer_kwargs,
                )
                for _ in range(layers)
            ]
        )
        self.norm = Norm(features, mesh=mesh, rngs=rngs)
        self.head = ColumnParallelLinear(
            features,
            vocab,
            sequence_parallel=True,
            gather_output=True,
            use_bias=False,
            **layer_kwargs,
        )

    def check_widths(self):
        """ValueError unless the embedding, final norm and head have the blocks' width F.

        (A head built for another width would otherwise fail deep inside its traced matmul.)
        """
        if not len(self.blocks):
            return
        features = self.blocks[0].features
        if self.embed.shape[-1] != features:
            raise ValueError(
                f"the embedding has width {self.embed.shape[-1]} (shape {self.embed.shape}) but "
                f"the blocks take {features} features"
            )
        check_head(self.norm, features, source="the blocks")
        check_head(self.head, features, source="the blocks")

    def __call__(self, tokens):
        """tokens int `[B, T]` in ring (zigzag) order -> logits `[B, T, vocab]`.

        Raises:
          ValueError: the embedding or the head not of the blocks' width (`check_widths`).
        """
        self.check_widths()
        x = jnp.take(self.embed[...], tokens, axis=0)
        attention = self.blocks[0].attention if len(self.blocks) else None
        if attention is not None and in_manual_region(self.mesh):
            x = _sequence_shard(x, attention)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _sequence_shard(x, attention):
    """Per shard: this model shard's part of the sequence `[b, t, F]` under sequence parallelism."""
    if not attention.sequence_parallel or attention.model_axis is None:
        return x
    part = x.shape[1] // jax.lax.axis_size(attention.model_axis)
    start = jax.lax.axis_index(attention.model_axis) * part
    return jax.lax.dynamic_slice_in_dim(x, start, part, axis=1)


def token_loss(model, batch):
    """`(sum_loss, num_tokens)`: cross entropy summed over the tokens `batch["mask"]` keeps.

    `batch`: dict of int `tokens` and `targets` `[B, T]` and a 0/1 `mask`
    `[B, T]` (padding 0). The loss `sf.parallel.accumulate` expects; run
    plainly, `sum_loss / num_tokens` is the token-weighted mean.
    """
    logits = model(batch["tokens"]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["mask"].astype(jnp.float32)
    # where, not a product: a padded position's loss (any target) must not reach the sum
    return jnp.sum(jnp.where(mask > 0, losses, 0.0)), jnp.sum(mask)


def make_batch(rng, batch, seq_len, vocab):
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
    # place_on_mesh: the optimizer's step counters start on one device; a jitted step
    # returns them on the mesh, which would make the second step compile again.
    optimizer = place_on_mesh(nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param), mesh)
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
