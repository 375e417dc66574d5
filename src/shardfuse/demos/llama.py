"""A Llama-style causal LM built from shardfuse layers, for the training examples.

    tokens -> embedding -> N x ParallelTransformerBlock (RMSNorm, RoPE, GQA,
    SwiGLU) -> RMSNorm -> unembedding -> token-weighted cross entropy

The model file knows nothing of how it is trained: the mesh and the layer
options (axes, ZeRO stage, remat policy) come in as keyword arguments. The
loss is `(sum of token losses, number of tokens)` so that microbatches and
shards combine into the exact large-batch mean.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import flops, models
from shardfuse.kernels.vma import to_varying
from shardfuse.layers import (
    ColumnParallelLinear,
    Norm,
    ParallelTransformerBlock,
    in_manual_region,
    place,
    sharded_param,
)
from shardfuse.layers.stack import Stack, check_head


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the model (defaults: a tiny one that trains on 8 CPU devices in seconds)."""

    vocab: int = 256
    features: int = 64
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 128
    layers: int = 4
    rope_theta: float = 10000.0

    def __post_init__(self):
        for name in ("vocab", "features", "heads", "kv_heads", "hidden", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be divisible by kv_heads={self.kv_heads}")
        if self.features % self.heads:
            raise ValueError(f"features={self.features} must be divisible by heads={self.heads}")

    def num_params(self) -> int:
        """Number of parameters (embedding and unembedding counted separately)."""
        head_dim = self.features // self.heads
        attention = self.features * head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.features * self.hidden
        return self.layers * (attention + mlp + 2 * self.features) + self.features * (
            2 * self.vocab + 1
        )

    def spec(self) -> models.ModelSpec:
        """This model as an `sf.models.ModelSpec` (name "train_lm"), what the planner reads."""
        return models.ModelSpec(
            "train_lm",
            hidden=self.features,
            heads=self.heads,
            kv_heads=self.kv_heads,
            head_dim=self.features // self.heads,
            ffn_hidden=self.hidden,
            num_layers=self.layers,
            vocab_size=self.vocab,
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training model FLOPs per token: `sf.flops.model_flops_per_token` (no causal halving)."""
        return flops.model_flops_per_token(self.spec(), seq_len)


class LMHead(nnx.Module):
    """Final RMSNorm and column-parallel unembedding: `[B, T, F]` -> logits `[B, T, vocab]`."""

    def __init__(self, features: int, vocab: int, *, mesh, layer_kwargs, rngs: nnx.Rngs):
        self.features = features  # the width it takes (what `check_head` reads)
        self.norm = Norm(features, mesh=mesh, rngs=rngs)
        self.unembed = ColumnParallelLinear(
            features,
            vocab,
            mesh=mesh,
            sequence_parallel=True,
            gather_output=True,
            use_bias=False,
            **layer_kwargs,
            rngs=rngs,
        )

    def __call__(self, x):
        return self.unembed(self.norm(x))


class LlamaLM(nnx.Module):
    """Embedding, a `Stack` of `ParallelTransformerBlock`s, final RMSNorm, unembedding.

    Runs on any mesh over `pipeline, data, fsdp, sequence, model` (absent
    axes are size 1): batch over `(data, fsdp)`, ring attention over
    `sequence` (tokens in the zigzag ring layout), tensor and sequence
    parallelism over `model`, ZeRO stage `zero` over `fsdp` (zero=3: the
    embedding's vocabulary dimension too), the stacked layers over
    `pipeline` when `pipelined` (run them with `sf.parallel.pipeline`). Works
    normally and per shard (inside `sf.parallel.accumulate`'s region).

    Args:
      config: a `LlamaConfig`.
      mesh: the mesh.
      zero: ZeRO stage 0..3 of the layers.
      remat: activation checkpointing policy of each layer (`shardfuse.layers.remat`).
      pipelined: stack the layers over the `pipeline` axis.
      rngs: `nnx.Rngs`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from shardfuse.demos.llama import LlamaConfig, LlamaLM
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> model = LlamaLM(LlamaConfig(layers=2), mesh=mesh, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        mesh,
        zero: int = 0,
        remat: str = "none",
        pipelined: bool = False,
        rngs: nnx.Rngs,
    ):
        self.config, self.mesh = config, mesh
        axes = set(mesh.axis_names)
        fsdp = "fsdp" if zero == 3 and "fsdp" in axes else None
        self.embed = sharded_param(
            nnx.initializers.normal(0.02),
            rngs.params(),
            (config.vocab, config.features),
            jnp.float32,
            mesh,
            P(fsdp, None),
        )
        layer_kwargs = dict(
            model_axis="model" if "model" in axes else None,
            sequence_axis="sequence" if "sequence" in axes else None,
            data_axis="data" if "data" in axes else None,
            zero=zero,
        )

        def block(rngs):
            return ParallelTransformerBlock(
                config.features,
                config.heads,
                config.hidden,
                num_kv_heads=config.kv_heads,
                rope_theta=config.rope_theta,
                activation="swiglu",
                mesh=mesh,
                **layer_kwargs,
                rngs=rngs,
            )

        self.blocks = Stack(
            block,
            config.layers,
            mesh=mesh,
            layer_axis="pipeline" if pipelined else None,
            remat=remat,
            rngs=rngs,
        )
        self.head = LMHead(
            config.features, config.vocab, mesh=mesh, layer_kwargs=layer_kwargs, rngs=rngs
        )

    def embed_tokens(self, tokens):
        """tokens int `[B, T]` -> `[B, T, F]` (per shard: this device's sequence part)."""
        if in_manual_region(self.mesh):
            x = jnp.take(self.embed[...], tokens, axis=0)
            x = _model_shard_of_sequence(x, self.mesh)
            # Typed as the blocks' shard_map would type their input (the gradient of the
            # embedding is then summed over the model axis where the sequence is split).
            return to_varying(x, frozenset(self.mesh.axis_names) - {"pipeline"})
        x = embed_lookup(self.embed[...], tokens, self.mesh)
        return place(x, self.mesh, self.blocks.blocks.io_spec())  # the blocks' layout

    def check_widths(self):
        """ValueError unless the embedding and the head have the block stack's width F.

        (A head built for another width would otherwise fail deep inside its traced matmul.)
        """
        features = self.blocks.features
        if features is not None and self.embed.shape[-1] != features:
            raise ValueError(
                f"the embedding has width {self.embed.shape[-1]} (shape {self.embed.shape}) but "
                f"the block stack takes {features} features"
            )
        check_head(self.head, features, source="the block stack")

    def __call__(self, tokens):
        """tokens int `[B, T]` (ring layout order over `sequence`) -> logits `[B, T, vocab]`.

        Raises:
          ValueError: the embedding or the head not of the stack's width (`check_widths`).
        """
        self.check_widths()
        return self.head(self.blocks(self.embed_tokens(tokens)))


def _model_shard_of_sequence(x, mesh):
    """Per shard, sequence parallelism: this model shard's part of `x` `[b, t, F]` along t."""
    if "model" not in mesh.axis_names or mesh.shape["model"] == 1:
        return x
    part = x.shape[1] // mesh.shape["model"]
    start = jax.lax.axis_index("model") * part
    return jax.lax.dynamic_slice_in_dim(x, start, part, axis=1)


def embed_lookup(table, tokens, mesh):
    """Rows of `table` `[V, F]` for `tokens` `[B, T]` -> `[B, T, F]`, sharded like the tokens."""
    spec = tuple(jax.typeof(tokens).sharding.spec)
    if any(spec):  # Explicit axes: the gather's output sharding must be stated
        out = NamedSharding(mesh, P(*spec, *(None,) * (tokens.ndim - len(spec)), None))
        return table.at[tokens].get(out_sharding=out)
    return jnp.take(table, tokens, axis=0)


def token_loss(logits, targets, mask=None):
    """`(sum of cross-entropy over the tokens where mask, number of those tokens)`, float32."""
    sharding = jax.typeof(logits).sharding
    if any(sharding.spec):  # Explicit axes: targets (and mask) sharded like the logits' tokens
        tokens = sharding.update(spec=P(*tuple(sharding.spec)[: targets.ndim]))
        targets = jax.sharding.reshard(targets, tokens)
        mask = None if mask is None else jax.sharding.reshard(mask, tokens)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        mask = jnp.ones(targets.shape, jnp.float32)
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)
