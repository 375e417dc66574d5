"""A pre-norm transformer block with tensor, sequence and context parallelism.

    h   = x + attention(norm_1(x))
    out = h + mlp(norm_2(h))

Norms (RMSNorm, Zhang & Sennrich 2019; or LayerNorm) are per token, so they
run on the sequence-sharded activations without communication (Megatron
sequence parallelism, Korthikanti et al. 2022). The whole block is one
`jax.shard_map`: attention and MLP reuse the per-shard code of
`ParallelSelfAttention` and `ParallelMLP`.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse._keywords import passes_keywords, renamed_keywords
from shardfuse.layers import _sharding, fsdp
from shardfuse.layers import options as options_lib
from shardfuse.layers import remat as remat_lib
from shardfuse.layers.attention import ParallelSelfAttention
from shardfuse.layers.linear import default_bias_init, default_kernel_init
from shardfuse.layers.mlp import ParallelMLP
from shardfuse.layers.moe import EXPERT_ACTIVATIONS, ParallelMoE
from shardfuse.model_spec import SWIGLU_ALPHA, SWIGLU_LIMIT

NORMS = ("rmsnorm", "layernorm")


def normalize(kind: str, x, scale, bias, eps: float):
    """RMSNorm or LayerNorm of `x` `[..., F]` in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    if kind == "layernorm":
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _fsdp_axis_alone_shards(init):
    """`Norm(fsdp_axis=...)` without `zero=`: a name shards the parameters (zero=3), None not."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        if "fsdp_axis" in kwargs and "zero" not in kwargs:
            kwargs["zero"] = 0 if kwargs["fsdp_axis"] is None else 3
        return init(self, *args, **kwargs)

    return wrapper


class Norm(nnx.Module):
    """RMSNorm (`scale` `[F]`) or LayerNorm (`scale` and `bias` `[F]`), replicated `P()`.

    Under ZeRO-3 (`zero=3`, or `fsdp_axis=` alone) the parameters are sharded `P(fsdp_axis)` and
    gathered where used: per shard (inside a block's `jax.shard_map` or a
    manual region) by an all-gather, outside one by a reshard to `P()` (on
    Explicit axes as on Auto ones); either way the gradient comes back
    sharded like the parameter.

    Per token: `x` `[..., F]` keeps its sharding (no communication). Integer or
    bool `x` raises TypeError; empty inputs give empty outputs.

    Args:
      features: F.
      kind: "rmsnorm" or "layernorm".
      eps: added to the mean square.
      options: the `LayerOptions` (a block hands its own); the norm reads
        `mesh`, `param_dtype`, `zero` and `fsdp_axis`: under zero=3 the
        parameters are sharded over the fsdp axis, else replicated. Option
        keywords override its fields, as in every layer.
      mesh: the mesh the parameters live on.
      param_dtype: storage dtype of `scale` (and `bias`).
      fsdp_axis: given without `zero=`, its single-layer meaning: None
        (replicated), or the mesh axis to shard them over (zero=3; F divisible
        by its size).
      rngs: `nnx.Rngs`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2,), ("model",))
      >>> sf.layers.Norm(8, kind="rmsnorm", mesh=mesh, rngs=nnx.Rngs(0))(jnp.ones((2, 8))).shape
      (2, 8)
    """

    @_fsdp_axis_alone_shards
    @options_lib.option_keywords
    def __init__(
        self,
        features: int,
        *,
        kind: str = "rmsnorm",
        eps: float = 1e-6,
        options: options_lib.LayerOptions | None = None,
        rngs: nnx.Rngs,
    ):
        if kind not in NORMS:
            raise ValueError(f"kind={kind!r} must be one of {NORMS}")
        mesh = options_lib.require_mesh(options, "Norm")
        self.options = options
        self.kind, self.eps, self.mesh, self.features = kind, float(eps), mesh, features
        stage = 3 if options.zero == 3 else 0  # stages 1 and 2 leave parameters replicated
        # (norm parameters are small: their gradients are reduced in their own dtype)
        self.zero = fsdp.zero_options(
            mesh,
            zero=stage,
            fsdp_axis=options.fsdp_axis,
            reshard_after_forward=True,
            reduce_dtype=None,
        )
        fsdp.check_kernel("features", features, mesh, self.zero)
        self.spec = P(self.zero.param_axis)
        make = _sharding.param_maker(rngs, options.param_dtype, mesh)
        self.scale = make(nnx.initializers.ones_init(), (features,), self.spec)
        layernorm = kind == "layernorm"
        self.bias = (
            make(nnx.initializers.zeros_init(), (features,), self.spec) if layernorm else None
        )

    def params(self):
        """`[scale, bias]` (bias None for RMSNorm), as stored (this device's shards per shard)."""
        return [self.scale[...], None if self.bias is None else self.bias[...]]

    def gathered(self, scale, bias, like=None):
        """Per shard: `scale` and `bias` whole (all-gathered over `fsdp_axis` when sharded).

        `like`: the activations they scale (`fsdp.gather`'s `like`).
        """
        gather = lambda v: None if v is None else fsdp.gather(self.zero, v, 0, v.dtype, like)  # noqa: E731
        return gather(scale), gather(bias)

    def __call__(self, x):
        """Normalizes `x` `[..., F]` over its last axis; same shape, dtype and sharding.

        Raises:
          TypeError: `x` is not floating point.
          ValueError: `x`'s last dimension is not `features`.
        """
        _sharding.check_activations(x)
        if x.ndim < 1 or x.shape[-1] != self.features:
            raise ValueError(f"x has shape {x.shape}; Norm expects [..., features={self.features}]")
        scale, bias = self.params()
        if _sharding.in_manual_region(self.mesh):
            scale, bias = self.gathered(scale, bias, x)
        elif self.zero.param_axis is not None:
            # ZeRO-3 outside any shard_map: gather the fsdp shards (a reshard on Explicit axes,
            # whose type rules refuse `x * scale` with F sharded on one side and the batch over
            # the same axis on the other); the gradient is reduce-scattered back.
            whole = lambda v: None if v is None else _sharding.place(v, self.mesh, P())  # noqa: E731
            scale, bias = whole(scale), whole(bias)
        return normalize(self.kind, x, scale, bias, self.eps)


# What a block hands, unread, to its `ParallelSelfAttention`, with that layer's defaults.
ATTENTION_KEYWORDS = (
    "num_kv_heads",
    "head_dim",
    "causal",
    "layout",
    "rope_theta",
    "rope_scaling",
    "window",
    "logit_softcap",
    "qkv_bias",
    "qk_norm",
    "qk_norm_eps",
    "clip_qkv",
    "sinks",
)


class ParallelTransformerBlock(nnx.Module):
    """Pre-norm transformer block: `ParallelSelfAttention` and `ParallelMLP` with residuals.

    Input and output `[B, T, features]`, sharded `P(data, (sequence, model),
    None)` with `sequence_parallel=True` (the default here), else
    `P(data, sequence, None)` (see `io_spec()`); along T in the ring `layout`
    order when `sequence_axis` is set (`sf.to_ring_layout` once at the model
    input). Integer or bool `x` raises TypeError (token ids go through an
    embedding first); an empty batch gives an empty output.

    Args:
      features: model width.
      num_heads: query heads, divisible by the size of `model_axis`.
      hidden_features: MLP width, divisible by the size of `model_axis`.
      options: the `LayerOptions` shared by the layers of a model (mesh, axes,
        ZeRO, remat, dtypes, precision, implementation), handed to the
        attention, the MLP and the norms; None: the defaults. Each
        option keyword below overrides its field (not given: the field
        stands; `shardfuse.layers.options` has the rule).
      mesh: the mesh (Explicit or Auto axes; `jax.set_mesh` is not needed).
      num_kv_heads, head_dim, causal, layout, rope_theta, rope_scaling, window,
        logit_softcap, qk_norm, qk_norm_eps, clip_qkv, sinks: attention options, as in
        `ParallelSelfAttention`.
      norm: "rmsnorm" or "layernorm".
      norm_eps: epsilon of the norms.
      activation: MLP activation, "gelu", "swiglu" or "swiglu_clamped" (gpt-oss;
        `sf.layers.mlp.activate`, with `swiglu_limit` and `swiglu_alpha`).
      moe: None (a dense `ParallelMLP`), or a dict of `ParallelMoE` keywords
        (`num_experts`, `top_k`, `routing`, `shared_experts`, `capacity_factor`,
        `expert_bias`, ...): the block's MLP is then a mixture of gated experts
        (`activation` "swiglu" or "swiglu_clamped"), each `hidden_features` wide, and
        the block writes its `MoEStats` on every call (`sf.layers.moe_stats(model)`; a
        `Stack` of such blocks writes each layer's).
      model_axis: tensor-parallel axis of attention heads and MLP hidden
        units (deprecated spelling: `tp_axis`).
      sequence_axis: context-parallel axis (ring attention); None: the
        sequence is not split over a context axis (deprecated: `cp_axis`).
      data_axis: batch axis.
      sequence_parallel: Megatron sequence parallelism over `model_axis`.
        Default (None in the options) True, unlike the single layers:
        activations stay sharded from block to block, which is what a stack of
        blocks wants.
      use_bias: default False, Llama-style (the linear layers default to
        True for `nnx.Linear` compatibility).
      attention_bias: biases on attention's q, k, v and o projections only, none in the
        MLP (gpt-oss); implied by `use_bias`.
      qkv_bias: biases on attention's q, k and v projections only (Qwen2).
      dtype, param_dtype, precision, kernel_init, bias_init, implementation:
        as in `ColumnParallelLinear`, for attention and MLP alike.
      remat: activation checkpointing of the block: "none" (default),
        "full", "selective", "dots" or "offload" (`shardfuse.layers.remat`).
      zero, fsdp_axis, reshard_after_forward, reduce_dtype: ZeRO options of
        attention and MLP, as in `ColumnParallelLinear`; under zero=3 the norm
        parameters are sharded over `fsdp_axis` too.
      attention_implementation: the attention kernel's implementation (None:
        `implementation`).
      rngs: `nnx.Rngs`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2, 2), ("sequence", "model"))
      >>> block = sf.layers.ParallelTransformerBlock(32, 4, 64, num_kv_heads=2, mesh=mesh,
      ...                                            rngs=nnx.Rngs(0))
      >>> y = block(jnp.ones((2, 16, 32)))
      >>> y.shape, y.sharding.spec
      ((2, 16, 32), P(None, ('sequence', 'model'), None))
    """

    @renamed_keywords(tp_axis="model_axis", cp_axis="sequence_axis")
    @options_lib.option_keywords
    @passes_keywords(ParallelSelfAttention.__init__, ATTENTION_KEYWORDS, after="options")
    def __init__(
        self,
        features: int,
        num_heads: int,
        hidden_features: int,
        *,
        options: options_lib.LayerOptions | None = None,
        norm: str = "rmsnorm",
        norm_eps: float = 1e-6,
        activation: str = "swiglu",
        swiglu_limit: float = SWIGLU_LIMIT,
        swiglu_alpha: float = SWIGLU_ALPHA,
        moe: dict | None = None,
        use_bias: bool = False,
        attention_bias: bool = False,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        rngs: nnx.Rngs,
        **attention,
    ):
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r} must be one of {NORMS}")
        # a stack of blocks keeps its activations sequence-sharded: True unless the options say
        options = options_lib.with_default_sequence_parallel(options, True)
        options_lib.require_mesh(options, "ParallelTransformerBlock")
        self.options = options
        self.remat = options.remat
        inits = dict(use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
        self.attention = ParallelSelfAttention(
            features, num_heads, options=options, **attention,
            **{**inits, "use_bias": use_bias or attention_bias},
        )  # fmt: skip
        act = dict(activation=activation, swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
        if moe is not None:  # a mixture of experts in place of the MLP
            if activation not in EXPERT_ACTIVATIONS or use_bias:
                raise ValueError(
                    f"moe= makes gated experts {EXPERT_ACTIVATIONS} without use_bias (their "
                    f"biases: moe=dict(expert_bias=True)); got activation={activation!r}, "
                    f"use_bias={use_bias!r}"
                )
            if not isinstance(moe, dict):
                raise ValueError(f"moe={moe!r} must be a dict of ParallelMoE keywords or None")
            self.mlp = ParallelMoE(
                features, hidden_features, options=options, kernel_init=kernel_init, rngs=rngs,
                **act, **moe,
            )  # fmt: skip
        else:
            self.mlp = ParallelMLP(features, hidden_features, options=options, **act, **inits)
        # zero=3: the norm parameters are sharded over the fsdp axis too
        self.norm_1 = Norm(features, kind=norm, eps=norm_eps, options=options, rngs=rngs)
        self.norm_2 = Norm(features, kind=norm, eps=norm_eps, options=options, rngs=rngs)
        self.features = features

    def local(self, x, positions, segment_ids, norm_params, attention_params, mlp_params):
        """Per-shard block (inside `jax.shard_map`)."""
        (s1, b1), (s2, b2) = (self.norm_1.gathered(*p, x) for p in norm_params)
        h = normalize(self.norm_1.kind, x, s1, b1, self.norm_1.eps)
        h = x + self.attention.local(h, positions, segment_ids, *attention_params)
        y = normalize(self.norm_2.kind, h, s2, b2, self.norm_2.eps)
        if isinstance(self.mlp, ParallelMoE):
            out, stats = self.mlp.local(y, *mlp_params)
            return h + out, stats
        return h + self.mlp.local(y, *mlp_params)

    def io_spec(self):
        """PartitionSpec of the `[B, T, features]` input and output."""
        return self.attention.io_spec()

    def __call__(self, x, *, positions=None, segment_ids=None):
        """`x` `[B, T, features]` -> `[B, T, features]`; arguments as `ParallelSelfAttention`.

        Raises TypeError for a non-floating `x`, ValueError for wrong shapes or
        indivisible lengths (as `ParallelSelfAttention`).
        """
        positions = self.attention.check_input(x, positions, segment_ids)
        y = _sharding.call_compiled(self, "forward", x, positions, segment_ids)
        if isinstance(self.mlp, ParallelMoE):  # the experts' statistics, to the MoEStats
            y, stats = y
            self.mlp.set_stats(stats)
        return y

    def forward(self, x, positions, segment_ids):
        """`__call__` on checked arguments (traced by `call_compiled`)."""
        attention = self.attention
        mesh = attention.mesh
        dtype = _sharding.compute_dtype(attention.dtype, x, attention.q_kernel[...])
        spec = attention.io_spec()
        if x.size == 0:  # empty batch or sequence
            if isinstance(self.mlp, ParallelMoE):
                raise ValueError(f"x has shape {x.shape}: a MoE block needs at least one token")
            return _sharding.empty_output(x.astype(dtype), x.shape, mesh, spec)
        attention_values, attention_specs = attention.local_params(dtype)
        mlp_values, mlp_specs = self.mlp.local_params(dtype)
        norm_values = [self.norm_1.params(), self.norm_2.params()]
        norm_specs = [[self.norm_1.spec] * 2, [self.norm_2.spec] * 2]
        local = remat_lib.checkpoint(self.local, self.remat, zero=attention.zero)
        return _sharding.shard_map_call(
            local,
            mesh,
            [x.astype(dtype), positions, segment_ids, norm_values, attention_values, mlp_values],
            [*attention.token_specs(), norm_specs, attention_specs, mlp_specs],
            (spec, self.mlp.stats_specs()) if isinstance(self.mlp, ParallelMoE) else spec,
        )
