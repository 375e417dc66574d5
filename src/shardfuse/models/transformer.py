"""`Transformer`: the one decoder-only language model, built from `sf.layers` by a `ModelSpec`.

    tokens -> embedding (+ learned positions) -> Stack of ParallelTransformerBlock
           -> final norm -> unembedding (its own, or the embedding tied) -> logits

One class for every architecture a `ModelSpec` describes: Llama-style
(RoPE, GQA, SwiGLU, RMSNorm; Mistral's window, Qwen2's q/k/v bias, Gemma 2's
softcap) and GPT-style (GELU, LayerNorm, biases, learned or no positions,
tied embeddings). The model knows the architecture; how it is laid out
comes in as one `sf.layers.LayerOptions` (the mesh, axes, ZeRO stage, remat
policy, dtypes, ...), handed to every layer, and whether the stacked layers
are split over the pipeline axis. It runs on any mesh
over `pipeline, data, fsdp, sequence, model` (absent axes are size 1),
plainly, per shard (inside `sf.parallel.accumulate`'s full-manual region) or
pipelined (`sf.parallel.Pipeline(model.blocks, ...)` with `model.embed_tokens`
and `model.head`, what the trainer does).

Its loss is `sf.layers.token_loss`: `(sum of token losses, number of tokens)`,
so that microbatches and shards combine into the exact large-batch mean.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.ring_attention import ring_positions
from shardfuse.collectives.sharding import axes_size, entry_axes
from shardfuse.kernels.vma import to_varying
from shardfuse.layers import (
    ColumnParallelLinear,
    Norm,
    ParallelTransformerBlock,
    in_manual_region,
    place,
    sharded_param,
)
from shardfuse.layers import options as options_lib
from shardfuse.layers.loss import token_loss
from shardfuse.layers.moe import moe_aux_loss
from shardfuse.layers.stack import Stack, check_head
from shardfuse.model_spec import ModelSpec
from shardfuse.models.block_runs import BlockRuns, block_runs, moe_keywords


class TiedUnembed(nnx.Module):
    """Logits from the input embedding table `[V, F]`: `x @ embed.T` (tied embeddings).

    Holds the same `nnx.Param` as the model's embedding (one parameter; its
    gradient sums both uses). Input `[B, T, F]` as the blocks return it
    (sequence-sharded over `model_axis` with `sequence_parallel`), output
    `[B, T, V]` sharded like an untied `ColumnParallelLinear(...,
    gather_output=True)`'s: the whole vocabulary, the sequence gathered over
    `model_axis`. When `model_axis` divides the vocabulary, each model shard
    computes the logits of its slice of the table's rows and the logits are
    gathered, as in the untied layer (the table is replicated over `model_axis`,
    so the slice is local). Outside a manual region the shardings say so;
    inside one (a pipeline stage, the training step's shard_map) the sequence
    is all-gathered over `model_axis` (and a ZeRO-3 table over `fsdp_axis`),
    the rows sliced by the shard's index, the logits all-gathered over
    `model_axis`.
    """

    def __init__(self, embed: nnx.Param, *, mesh, model_axis, fsdp_axis, sequence_parallel,
                 out_spec):  # fmt: skip
        self.embed = embed
        self.mesh, self.model_axis, self.fsdp_axis = mesh, model_axis, fsdp_axis
        self.sequence_parallel, self.out_spec = sequence_parallel, out_spec
        self.in_features, self.out_features = embed.shape[1], embed.shape[0]

    def __call__(self, x):
        table = self.embed[...]
        tp = self.mesh.shape[self.model_axis] if self.model_axis else 1
        split = tp > 1 and self.out_features % tp == 0  # each model shard: V / tp rows
        manual = in_manual_region(self.mesh)
        if manual:
            if self.sequence_parallel and self.model_axis is not None:
                x = jax.lax.all_gather(x, self.model_axis, axis=1, tiled=True)
            if table.shape[0] != self.out_features:  # a ZeRO-3 shard of the vocabulary
                table = jax.lax.all_gather(table, self.fsdp_axis, axis=0, tiled=True)
            if split:
                rows = self.out_features // tp
                start = jax.lax.axis_index(self.model_axis) * rows
                table = jax.lax.dynamic_slice_in_dim(table, start, rows, axis=0)
        else:
            table = place(table, self.mesh, P(self.model_axis if split else None, None))
            x = place(x, self.mesh, self.out_spec)
        precision = "highest" if x.dtype == jnp.float32 else None
        logits = jnp.einsum("BTF,VF->BTV", x, table.astype(x.dtype), precision=precision)
        if manual:
            if split:
                logits = jax.lax.all_gather(logits, self.model_axis, axis=2, tiled=True)
            return logits
        return place(logits, self.mesh, self.out_spec)


class LMHead(nnx.Module):
    """Final norm and unembedding: `[B, T, F]` -> logits `[B, T, vocab]`.

    Args:
      spec: the `ModelSpec` (norm kind and epsilon, widths, tied or not).
      options: the model's `sf.layers.LayerOptions` (its `sequence_parallel`:
        the blocks', whose sequence the head gathers over the model axis;
        None there: True, as the blocks). Option keywords (`mesh=`, ...)
        override its fields, as in every layer.
      embed: the embedding `nnx.Param` to tie to (`spec.tied_embeddings`), else None.
      rngs: `nnx.Rngs`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from shardfuse.models import LMHead, ModelSpec
      >>> mesh = jax.make_mesh((2,), ("model",))
      >>> head = LMHead(ModelSpec.tiny(), mesh=mesh, sequence_parallel=False, rngs=nnx.Rngs(0))
      >>> head(jnp.ones((2, 8, 64))).shape
      (2, 8, 256)
    """

    @options_lib.option_keywords
    def __init__(self, spec: ModelSpec, *, options: options_lib.LayerOptions | None = None,
                 embed: nnx.Param | None = None, rngs: nnx.Rngs):  # fmt: skip
        options = options_lib.with_default_sequence_parallel(options, True)
        mesh = options_lib.require_mesh(options, "LMHead")
        self.features = spec.hidden  # the width it takes (what `check_head` reads)
        # the final norm's parameters stay replicated, whatever the ZeRO stage
        self.norm = Norm(spec.hidden, kind=spec.norm, eps=spec.norm_eps, options=options, zero=0,
                         rngs=rngs)  # fmt: skip
        if spec.tied_embeddings:
            if embed is None:
                raise ValueError("spec.tied_embeddings=True: pass the embedding table as embed=")
            names = options.mesh_axes()
            batch = (
                tuple(
                    a for a in (names["data_axis"], names["fsdp_axis"], names["expert_axis"]) if a
                )
                or None
            )
            self.unembed = TiedUnembed(
                embed,
                mesh=mesh,
                model_axis=names["model_axis"],
                fsdp_axis=names["fsdp_axis"],
                sequence_parallel=options.sequence_parallel,
                out_spec=P(batch, names["sequence_axis"], None),
            )
        else:
            self.unembed = ColumnParallelLinear(
                spec.hidden,
                spec.vocab_size,
                options=options,
                gather_output=True,
                use_bias=False,
                rngs=rngs,
            )

    def __call__(self, x):
        return self.unembed(self.norm(x))


class Transformer(nnx.Module):
    """A decoder-only LM of `spec`: embedding, `Stack` of blocks, final norm, unembedding.

    Runs on any mesh over `pipeline, data, fsdp, expert, sequence, model` (absent axes
    are size 1): batch over `(data, fsdp, expert)`, ring attention over `sequence`
    (tokens in the ring `layout` order, `sf.to_ring_layout`), tensor and
    sequence parallelism over `model`, ZeRO stage `zero` over `fsdp` (zero=3:
    the embedding's vocabulary dimension too), the stacked layers over
    `pipeline` when `pipelined` (run them with `sf.parallel.Pipeline`). Works
    normally and per shard (inside `sf.parallel.accumulate`'s region).

    Parameters: `embed` `[V, F]`; `pos_embed` `[max_positions, F]` (learned
    positions only); `blocks` (a `Stack`, each parameter `[L, ...]`); `head`
    (`norm`, and `unembed`: a `ColumnParallelLinear` `[F, V]`, or the
    embedding itself when tied). Embeddings are initialised N(0, 0.02).

    Args:
      spec: the `sf.models.ModelSpec` (e.g. `ModelSpec.tiny()`, `sf.models.get(...)`).
      options: the `sf.layers.LayerOptions` of every layer (mesh, axes, ZeRO
        stage, remat policy of each layer, dtypes, precision, implementations;
        `sequence_parallel` None: True). Each field is also a keyword
        (`mesh=`, `zero=`, `remat=`, `dtype=`, ...) overriding it.
      pipelined: stack the layers over the `pipeline` axis (MoE blocks too, when every
        block is one: `sf.parallel.Pipeline.loss` adds their aux losses per microbatch).
      stage_layers: layers per pipeline stage when uneven (`sf.parallel.balance_stages`),
        else None (`Stack`'s `stage_layers`).
      layout: ring layout of the sequence over the `sequence` axis
        ("zigzag", "contiguous" or "striped").
      capacity_factor: the MoE blocks' (`ParallelMoE`): None dropless, else each
        expert's capacity per device (`RunOptions.capacity_factor`).
      dispatch_chunks: the MoE blocks' (`ParallelMoE`), `RunOptions.dispatch_chunks`.
      rngs: `nnx.Rngs`.

    Mixture of experts (`spec.experts > 0`): the blocks `spec.is_moe_layer` marks hold
    a `ParallelMoE` (SwiGLU experts of `spec.expert_ffn_hidden`, experts sharded over
    the `expert` axis, tokens split over it like a data axis); the others the dense
    MLP. One kind of block: `blocks` is one `Stack`; mixed kinds: a `BlockRuns`, a
    `Stack` per run of one kind (`shardfuse.models.block_runs`). Each call writes the
    layers' `MoEStats` (`sf.layers.moe_stats(model)`; `token_loss_and_aux` adds the
    aux losses to the loss).

    Raises:
      TypeError: `spec` is not a `ModelSpec`.
      ValueError: sizes the mesh does not divide (from the layers); an expert axis of
        size > 1 with no MoE block in the spec; `spec.experts` not divisible by it;
        `pipelined=True` with blocks of mixed kinds (dense and MoE: a `Pipeline`
        runs one `Stack`).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> spec = sf.models.ModelSpec.tiny(num_layers=2)
      >>> model = sf.models.Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)

    A mixture of experts, 8 experts over an expert axis of 4, the first block dense::

      >>> mesh = jax.make_mesh((4, 2), ("expert", "data"))
      >>> spec = sf.models.ModelSpec.tiny(num_layers=3, experts=8, top_k=2, moe_first_dense=1)
      >>> model = sf.models.Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))
      >>> [run.num_layers for run in model.blocks.runs]
      [1, 2]
      >>> model(jnp.zeros((8, 16), jnp.int32)).shape
      (8, 16, 256)
      >>> [int(c.sum()) for c in sf.layers.moe_stats(model)["tokens_per_expert"]]
      [256, 256]
    """

    @options_lib.option_keywords
    def __init__(
        self,
        spec: ModelSpec,
        *,
        options: options_lib.LayerOptions | None = None,
        pipelined: bool = False,
        stage_layers=None,
        layout: str = "zigzag",
        capacity_factor: float | None = None,
        dispatch_chunks: int = 1,
        rngs: nnx.Rngs,
    ):
        if not isinstance(spec, ModelSpec):
            raise TypeError(
                f"spec={spec!r} must be an sf.models.ModelSpec (e.g. ModelSpec.tiny(...) or "
                "sf.models.get(name))"
            )
        # Megatron sequence parallelism by default: activations stay sharded from block to block
        options = options_lib.with_default_sequence_parallel(options, True)
        mesh = options_lib.require_mesh(options, "Transformer")
        self.spec, self.mesh, self.options = spec, mesh, options
        self.layout, self.sequence_parallel = layout, options.sequence_parallel
        names = options.mesh_axes()
        self.model_axis, self.sequence_axis = names["model_axis"], names["sequence_axis"]
        _check_experts(spec, mesh, names["expert_axis"], pipelined)
        self.capacity_factor = capacity_factor
        fsdp = options.zero_options().param_axis  # zero=3: the vocabulary sharded too
        init = nnx.initializers.normal(0.02)
        F = spec.hidden
        self.embed = sharded_param(
            init, rngs.params(), (spec.vocab_size, F), jnp.float32, mesh, P(fsdp, None)
        )
        self.pos_embed = (
            sharded_param(init, rngs.params(), (spec.max_positions, F), jnp.float32, mesh, P())
            if spec.positions == "learned"
            else None
        )
        rope_theta = spec.rope_theta if spec.positions == "rope" else None
        # the Stack applies the remat policy per layer; the blocks themselves apply none
        block_options = options.replace(remat="none")

        def make_block(moe, windowed):
            def block(rngs):
                return ParallelTransformerBlock(
                    F,
                    spec.heads,
                    spec.expert_ffn_hidden if moe else spec.ffn_hidden,
                    num_kv_heads=spec.kv_heads,
                    head_dim=spec.head_dim,
                    rope_theta=rope_theta,
                    rope_scaling=spec.rope_scaling,
                    window=spec.causal_mask[0] if windowed else None,
                    sinks=spec.attention_sinks,
                    logit_softcap=spec.logit_softcap,
                    norm=spec.norm,
                    norm_eps=spec.norm_eps,
                    activation=spec.activation,
                    swiglu_limit=spec.swiglu_limit,
                    swiglu_alpha=spec.swiglu_alpha,
                    moe=moe_keywords(spec, capacity_factor, dispatch_chunks) if moe else None,
                    use_bias=spec.use_bias,
                    attention_bias=spec.attention_bias,
                    qkv_bias=spec.qkv_bias,
                    qk_norm=spec.qk_norm,
                    qk_norm_eps=spec.norm_eps,
                    clip_qkv=spec.clip_qkv,
                    layout=layout,
                    options=block_options,
                    rngs=rngs,
                )

            return block

        runs = [
            Stack(
                make_block(run.is_moe, run.windowed),
                run.count,
                options=options,
                layer_axis=axes.PIPELINE if pipelined else None,
                stage_layers=stage_layers,
                rngs=rngs,
            )
            for run in block_runs(spec)
        ]
        # one kind of block: one Stack (one layer scan); mixed kinds: a Stack per run
        self.blocks = runs[0] if len(runs) == 1 else BlockRuns(runs)
        self.head = LMHead(
            spec,
            options=options,
            embed=self.embed if spec.tied_embeddings else None,
            rngs=rngs,
        )

    def io_spec(self):
        """PartitionSpec of the blocks' `[B, T, F]` activations."""
        if isinstance(self.blocks, BlockRuns):
            return self.blocks.io_spec()
        return self.blocks.blocks.io_spec()

    def positions(self, seq_len: int):
        """int32 `[T]`: the natural position of each token slot in the ring layout order."""
        ring = self.mesh.shape[self.sequence_axis] if self.sequence_axis else 1
        if ring == 1:
            return jnp.arange(seq_len, dtype=jnp.int32)
        return ring_positions(seq_len, ring, self.layout).reshape(-1)

    def _check_sizes(self, seq_len: int, batch: int | None = None):
        if self.pos_embed is not None and seq_len > self.spec.max_positions:
            raise ValueError(
                f"sequence length {seq_len} exceeds spec.max_positions={self.spec.max_positions} "
                "(the learned position table's rows)"
            )
        # the mesh axes the batch and the sequence are split over
        batch_split, split = map(entry_axes, self.io_spec()[:2])
        shards = axes_size(self.mesh, split)
        if seq_len % shards:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {shards}, the size of the mesh "
                f"axes {split} the sequence is split over (sequence_parallel=True splits it "
                "over model; sequence_parallel=False does not)"
            )
        batch_shards = axes_size(self.mesh, batch_split)
        if batch is not None and batch % batch_shards:
            raise ValueError(
                f"batch size {batch} is not divisible by {batch_shards}, the size of the mesh "
                f"axes {batch_split} the batch is split over"
            )

    def embed_tokens(self, tokens):
        """tokens int `[B, T]` -> `[B, T, F]` (per shard: this device's sequence part).

        Adds the learned position embeddings of the tokens' natural positions.

        Raises:
          ValueError: with learned positions, T beyond `spec.max_positions`; outside a
            manual region, T or B not divisible by the mesh axes that split them.
        """
        if in_manual_region(self.mesh):
            x = jnp.take(self.embed[...], tokens, axis=0)
            if self.pos_embed is not None:
                x = x + self._local_position_rows(tokens.shape[1])
            x = self._model_shard_of_sequence(x)
            # Typed as the blocks' shard_map would type their input (the gradient of the
            # embedding is then summed over the model axis where the sequence is split).
            return to_varying(x, frozenset(self.mesh.axis_names) - {axes.PIPELINE})
        self._check_sizes(tokens.shape[1], batch=tokens.shape[0])
        x = embed_lookup(self.embed[...], tokens, self.mesh)
        if self.pos_embed is not None:
            table = place(self.pos_embed[...], self.mesh, P())
            rows = jnp.take(table, self.positions(x.shape[1]), axis=0)
            x = x + rows.astype(x.dtype)
        return place(x, self.mesh, self.io_spec())  # the blocks' layout

    def _local_position_rows(self, local_len: int):
        """Per shard: position embedding rows `[t, F]` of this sequence shard's tokens."""
        ring = self.mesh.shape[self.sequence_axis] if self.sequence_axis else 1
        self._check_sizes(local_len * ring)
        positions = self.positions(local_len * ring)
        if ring > 1:
            start = jax.lax.axis_index(self.sequence_axis) * local_len
            positions = jax.lax.dynamic_slice_in_dim(positions, start, local_len)
        return jnp.take(self.pos_embed[...], positions, axis=0)

    def _model_shard_of_sequence(self, x):
        """Per shard, sequence parallelism: this model shard's part of `x` `[b, t, F]` along t."""
        if not self.sequence_parallel or self.model_axis is None:
            return x
        size = self.mesh.shape[self.model_axis]
        if size == 1:
            return x
        part = x.shape[1] // size
        start = jax.lax.axis_index(self.model_axis) * part
        return jax.lax.dynamic_slice_in_dim(x, start, part, axis=1)

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
          ValueError: the embedding or the head not of the stack's width (`check_widths`);
            with learned positions, T beyond `spec.max_positions`.
        """
        self.check_widths()
        return self.head(self.blocks(self.embed_tokens(tokens)))

    def loss(self, batch, *, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0):
        """`(sum of token losses, number of tokens)` of `batch` (`sf.layers.token_loss`).

        A mixture of experts: with `aux_loss_coef` / `z_loss_coef` (`RunOptions`'), the
        sum holds `count x sf.layers.moe_aux_loss(model, ...)`, so that `sum / count` is
        the mean token loss plus the weighted load-balancing and router z-losses.

        `batch`: a dict of int `tokens` and `targets` `[B, T]` and an optional 0/1
        (or weight) `mask` `[B, T]`. `Transformer.loss` is a `loss_fn(model, batch)`
        as `sf.parallel.accumulate` takes; run plainly, `sum / count` is the
        token-weighted mean.

        Example usage::

          >>> import jax, jax.numpy as jnp
          >>> from flax import nnx
          >>> import shardfuse as sf
          >>> mesh = jax.make_mesh((8,), ("data",))
          >>> model = sf.models.Transformer(sf.models.ModelSpec.tiny(num_layers=1), mesh=mesh,
          ...                               rngs=nnx.Rngs(0))
          >>> tokens = jnp.zeros((8, 16), jnp.int32)
          >>> with jax.set_mesh(mesh):  # Explicit axes: the loss's gathers need the mesh
          ...     total, count = model.loss({"tokens": tokens, "targets": tokens})
          >>> float(count)
          128.0
        """
        total, count = token_loss(self(batch["tokens"]), batch["targets"], batch.get("mask"))
        if aux_loss_coef or z_loss_coef:  # (sum + count x aux) / count = mean + aux
            total = total + count * moe_aux_loss(self, aux_loss_coef, z_loss_coef)
        return total, count


def _check_experts(spec, mesh, expert_axis, pipelined):
    """ValueError for an expert axis the spec cannot use, or blocks of mixed kinds pipelined."""
    ep = mesh.shape[expert_axis] if expert_axis in mesh.axis_names else 1
    if ep > 1 and not spec.is_moe:
        raise ValueError(
            f"the mesh's expert axis {expert_axis!r} has size {ep} but spec.experts=0: no "
            "block is a mixture of experts (give the spec experts= and top_k=, or a mesh "
            "without the expert axis)"
        )
    if spec.is_moe and spec.experts % ep:
        raise ValueError(
            f"spec.experts={spec.experts} must be divisible by the size {ep} of the expert "
            f"axis {expert_axis!r}"
        )
    runs = block_runs(spec)
    if pipelined and len(runs) > 1:
        raise ValueError(
            f"pipelined=True with blocks of mixed kinds (runs: {runs}, from "
            f"moe_first_dense={spec.moe_first_dense}, moe_every={spec.moe_every}, "
            f"dense_layers={spec.dense_layers}, window_layers={spec.window_layers}): a "
            "Pipeline runs one Stack of one kind of block; pipeline a spec whose every block "
            "is a mixture of experts (moe_first_dense=0, moe_every=1, dense_layers=()), or "
            "none, with one attention mask (window_layers=None)"
        )


def embed_lookup(table, tokens, mesh):
    """Rows of `table` `[V, F]` for `tokens` `[B, T]` -> `[B, T, F]`, sharded like the tokens."""
    spec = tuple(jax.typeof(tokens).sharding.spec)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    if any(spec) or (explicit and any(jax.typeof(table).sharding.spec)):
        # Explicit axes: the gather's output sharding must be stated (also for replicated
        # tokens when the table is sharded, e.g. its vocabulary over fsdp under ZeRO-3)
        out = NamedSharding(mesh, P(*spec, *(None,) * (tokens.ndim - len(spec)), None))
        return table.at[tokens].get(out_sharding=out)
    return jnp.take(table, tokens, axis=0)


__all__ = ["LMHead", "TiedUnembed", "Transformer", "embed_lookup", "token_loss"]
