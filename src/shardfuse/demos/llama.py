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

from shardfuse.layers import ColumnParallelLinear, Norm, ParallelTransformerBlock


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

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x parameters + the attention term (causal: halved)."""
        matmul = self.num_params() - self.vocab * self.features  # the lookup is no matmul
        attention = 6 * self.layers * self.features * seq_len  # 12 L F T, halved by causality
        return 6.0 * matmul + attention


class LlamaLM(nnx.Module):
    """Embedding, `ParallelTransformerBlock`s, final RMSNorm, column-parallel unembedding.

    Args:
      config: a `LlamaConfig`.
      mesh: the mesh; its axes among `data, sequence, model` are used by the
        layers (absent axes are size 1).
      block_kwargs: extra keyword arguments of every `ParallelTransformerBlock`.
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

    def __init__(self, config: LlamaConfig, *, mesh, block_kwargs=None, rngs: nnx.Rngs):
        self.config, self.mesh = config, mesh
        axes = set(mesh.axis_names)
        self.model_axis = "model" if "model" in axes else None
        common = dict(
            mesh=mesh,
            model_axis=self.model_axis,
            sequence_axis="sequence" if "sequence" in axes else None,
            data_axis="data" if "data" in axes else None,
        )
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(
            jax.jit(
                lambda key: init(key, (config.vocab, config.features)),
                out_shardings=NamedSharding(mesh, P()),
            )(rngs.params())
        )
        self.blocks = nnx.List(
            [
                ParallelTransformerBlock(
                    config.features,
                    config.heads,
                    config.hidden,
                    num_kv_heads=config.kv_heads,
                    rope_theta=config.rope_theta,
                    activation="swiglu",
                    **common,
                    **(block_kwargs or {}),
                    rngs=rngs,
                )
                for _ in range(config.layers)
            ]
        )
        self.norm = Norm(config.features, mesh=mesh, rngs=rngs)
        self.head = ColumnParallelLinear(
            config.features,
            config.vocab,
            **common,
            sequence_parallel=True,
            gather_output=True,
            use_bias=False,
            rngs=rngs,
        )

    def __call__(self, tokens):
        """tokens int `[B, T]` (ring layout order over `sequence`) -> logits `[B, T, vocab]`."""
        x = embed_lookup(self.embed[...], tokens, self.mesh)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


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
