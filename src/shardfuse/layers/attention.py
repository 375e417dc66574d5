"""Tensor- and context-parallel self-attention with RoPE.

Heads are split over the tensor-parallel axis (Megatron-LM); the query, key
and value projections run as one column-parallel matmul per shard (one
overlapped all-gather under sequence parallelism). With grouped-query
attention the kv heads are split too when `K % tp == 0`; when `tp % K == 0`
(fewer kv heads than shards) the kv kernel is replicated and each shard uses
the one kv head its query heads read. Rotary embeddings (RoFormer, Su et al.
2021) use absolute positions, so tokens may be in any order, e.g. the
load-balanced ring layouts of context parallelism. Attention itself is ring
attention over `sequence_axis` (Liu et al. 2023), or flash attention when the
sequence is not split. The output projection is row-parallel
(reduce-scatter along the sequence, or all-reduce).

Inputs `[B, T, F]` are laid out along the sequence in the ring `layout`
order when `sequence_axis` is set (see `sf.to_ring_layout`): convert once at the
model input and back at the output; every per-token layer is indifferent
to the order.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from shardfuse._keywords import renamed_keywords
from shardfuse.collectives.ring_attention import ring_attention, ring_positions
from shardfuse.collectives.ring_attention.layouts import check_layout
from shardfuse.kernels.attention import api as attention_api
from shardfuse.layers import _sharding, fsdp
from shardfuse.layers import options as options_lib
from shardfuse.layers.linear import default_bias_init, default_kernel_init
from shardfuse.layers.parallel_matmul import column_matmul, row_matmul
from shardfuse.model_spec import rope_scaling_parameters


def rope_frequencies(head_dim: int, theta: float, scaling=None):
    """float32 `[head_dim / 2]` inverse frequencies of RoPE, optionally Llama-3 or YaRN scaled.

    `scaling`: a `ModelSpec.rope_scaling` (`sf.models.model_spec.rope_scaling_parameters`):

    - Llama 3.1's `(factor, low_freq_factor, high_freq_factor, original_max_positions)`
      (`rope_type="llama3"`): wavelengths longer than `original / low_freq_factor` are
      divided by `factor`, shorter than `original / high_freq_factor` kept, and those
      between interpolated.
    - YaRN's `("yarn", factor, beta_fast, beta_slow, original_max_positions, truncate,
      attention_factor)` (Peng et al. 2023, "YaRN: Efficient Context Window Extension",
      as transformers' `_compute_yarn_parameters`): dimensions `d` (pairs) below
      `low = D log(original / (2 pi beta_fast)) / (2 log theta)` keep their frequency,
      above `high` (the same with `beta_slow`) are divided by `factor`, a linear ramp
      between (`truncate`: low floored, high ceiled); `attention_factor` scales cos and
      sin (`rope`), not the frequencies.

    Example:
      >>> from shardfuse.layers.attention import rope_frequencies
      >>> rope_frequencies(4, 10000.0).tolist()
      [1.0, 0.009999999776482582]
    """
    if scaling is not None and rope_scaling_parameters(scaling)[0] == "yarn":
        return _yarn_frequencies(head_dim, theta, rope_scaling_parameters(scaling)[1])
    inv_freq = theta ** (-jnp.arange(head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = rope_scaling_parameters(scaling)[1].values()
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, smoothed, scaled)


def _yarn_frequencies(head_dim: int, theta: float, p: dict):
    """YaRN's inverse frequencies (`rope_frequencies`), in transformers' order of operations."""
    dim = head_dim

    def correction_dim(rotations):  # the dimension that turns `rotations` times in `original`
        return (
            dim
            * math.log(p["original_max_positions"] / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (p["factor"] * pos_freqs)
    keep = 1 - ramp  # 1: the frequency kept (extrapolated), 0: divided by factor
    return interpolation * (1 - keep) + extrapolation * keep


def rope(x, positions, theta: float | None, scaling=None):
    """Rotary embedding (rotate-half form) of `x` `[B, T, N, D]` at int `positions` `[T]`.

    `theta` None: no rotary embedding (`x` unchanged), for models with learned or no
    position embeddings. `scaling`: Llama-3 or YaRN frequency scaling, as in
    `rope_frequencies`; YaRN's `attention_factor` multiplies cos and sin.
    """
    if theta is None:
        return x
    half = x.shape[-1] // 2
    inv_freq = rope_frequencies(x.shape[-1], theta, scaling)  # [D/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    sin, cos = jnp.sin(angles)[:, None, :], jnp.cos(angles)[:, None, :]  # [T, 1, D/2]
    if scaling is not None:
        factor = rope_scaling_parameters(scaling)[1].get("attention_factor", 1.0)
        if factor != 1.0:
            sin, cos = sin * factor, cos * factor
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


QK_NORMS = (None, "head", "flat")


def apply_sinks(out, lse, sinks):
    """Attention `out` `[B, T, H, D]` with a sink logit per head joining each softmax.

    A sink (gpt-oss; Xiao et al. 2023, "Efficient Streaming Language Models with
    Attention Sinks") is a logit `sinks[h]` in the denominator of every softmax of
    head h, with no value. From the attention without it, whose float32 `lse`
    `[B, H, T]` is `log sum_j exp(s_j)`:

        out_sink = out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)

    exactly, so any attention kernel that returns `lse` (and differentiates through
    it) computes it. A row with no visible key (lse = -inf) stays 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.layers.attention import apply_sinks
      >>> out, lse = jnp.ones((1, 1, 1, 2)), jnp.zeros((1, 1, 1))  # one key of logit 0
      >>> apply_sinks(out, lse, jnp.zeros((1,))).tolist()  # the sink takes half
      [[[[0.5, 0.5]]]]
    """
    scale = jax.nn.sigmoid(lse.astype(jnp.float32) - sinks.astype(jnp.float32)[:, None])
    scale = jnp.swapaxes(scale, 1, 2)[..., None]  # [B, T, H, 1]
    return (out.astype(jnp.float32) * scale).astype(out.dtype)


def _rms(x, scale, eps, axis_name=None, width=None):
    """RMSNorm of `x` over its last axis in float32 (`axis_name`: the last axis is split over
    that mesh axis, `width` wide in all: the sum of squares is summed over it)."""
    x32 = x.astype(jnp.float32)
    if axis_name is None:
        mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    else:
        mean = lax.psum(jnp.sum(x32 * x32, axis=-1, keepdims=True), axis_name) / width
    return (x32 * lax.rsqrt(mean + eps) * scale.astype(jnp.float32)).astype(x.dtype)


def qk_transform(q, k, v, q_norm, k_norm, *, kind, eps, clip, axis_name=None, widths=None,
                 k_whole=False):  # fmt: skip
    """q `[b, t, h, D]`, k and v `[b, t, k, D]` after their optional norms and clamp.

    `kind` None: no norm; "head": RMSNorm over D with `q_norm`, `k_norm` `[D]` (Qwen3);
    "flat": over all heads (`[h * D]` weights of this shard's heads; `axis_name` the mesh
    axis the heads are split over, `widths` the full `(H * D, K * D)`: OLMoE; `k_whole`:
    k holds every kv head, its norm needs no reduction). Then `clip`: q, k and v clamped
    to `[-clip, clip]` (OLMoE's `clip_qkv`). Before RoPE.
    """
    if kind == "head":
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    elif kind == "flat":
        (b, t, h, D), kh = q.shape, k.shape[2]
        q = _rms(q.reshape(b, t, h * D), q_norm, eps, axis_name, widths[0]).reshape(q.shape)
        k_axis = None if k_whole else axis_name
        k = _rms(k.reshape(b, t, kh * D), k_norm, eps, k_axis, widths[1]).reshape(k.shape)
    if clip is not None:
        q, k, v = (jnp.clip(a, -clip, clip) for a in (q, k, v))
    return q, k, v


class ParallelSelfAttention(nnx.Module):
    """Multi-head (GQA) self-attention split over heads (`model_axis`) and sequence.

    Parameters (2-D kernels, initialised like `nnx.Linear` kernels):
    `q_kernel` `[F, H * D]` `P(None, tp)`; `kv_kernel` `[F, K * 2 * D]`
    (per kv head: its key columns, then its value columns) `P(None, tp)` when
    `K % tp == 0`, else replicated `P()`; `o_kernel` `[H * D, F]`
    `P(tp, None)`; with `use_bias`, `q_bias` `[H * D]` `P(tp)`, `kv_bias`
    `[K * 2 * D]` (like `kv_kernel`) and `o_bias` `[F]` `P()`; with `qk_norm="head"`
    `q_norm`, `k_norm` `[D]` `P()`, with "flat" `q_norm` `[H * D]` `P(tp)` and `k_norm`
    `[K * D]` like the kv kernel (`P(tp)`, or `P()` where it is replicated).

    Masks (causal, window) apply to token positions in natural order (the
    ring layout's positions when `sequence_axis` is set); `positions` given to
    `__call__` only feed RoPE (e.g. positions that restart per packed
    sequence, with `segment_ids`).

    Input and output `[B, T, F]`: `P(data, (sequence, model), None)` with
    `sequence_parallel=True` (Megatron sequence parallelism), else
    `P(data, sequence, None)` (see `io_spec()`). Integer or bool `x` raises
    TypeError; an empty batch gives an empty output.

    Args:
      features: model width F.
      num_heads: query heads H, divisible by the size of `model_axis`.
      num_kv_heads: kv heads K (default H); `H % K == 0`, and K divisible by or
        dividing the tp size.
      head_dim: D (default F // H); even with RoPE.
      options: the `LayerOptions` shared by the layers of a model (mesh, axes,
        ZeRO, dtypes, precision, implementation); None: the defaults. Each
        option keyword below overrides its field (not given: the field
        stands; `shardfuse.layers.options` has the rule).
      mesh: the mesh.
      model_axis: tensor-parallel axis (heads); deprecated spelling `tp_axis`.
      sequence_axis: context-parallel axis: the sequence is sharded over it
        and ring attention runs over it (the same axis `sequence_axis` names
        in the linear layers), or None; deprecated spelling `cp_axis`.
      data_axis: batch axis. The defaults of `data_axis` and `sequence_axis`
        are ignored when the mesh lacks them.
      sequence_parallel: Megatron sequence parallelism: activations
        sequence-sharded over `model_axis` too. Default False, as in the
        linear layers and `ParallelMLP`.
      causal: causal mask on absolute positions.
      layout: ring layout of the sequence over `sequence_axis`: "contiguous",
        "zigzag" or "striped".
      rope_theta: RoPE base; None: no rotary embedding (positions then feed
        nothing but the masks; for learned or no position embeddings).
      rope_scaling: Llama 3.1's RoPE frequency scaling `(factor, low_freq_factor,
        high_freq_factor, original_max_positions)` (`rope_frequencies`), or None.
      window, logit_softcap: as in `sf.flash_attention`.
      use_bias: biases on the projections; default False (Llama-style
        attention, unlike the `nnx.Linear`-compatible linear layers).
      qkv_bias: biases on the q, k and v projections only (Qwen2), not on the
        output projection; implied by `use_bias`. Default False.
      qk_norm: None; "head": RMSNorms (weights `[D]`) over each query and key head
        before RoPE (Qwen3); "flat": over the whole q projection `[H * D]` and the whole k
        projection `[K * D]` (OLMoE; sums of squares reduced over the model axis; where the
        kv heads are not split over it, each shard projects all of them for the norm).
      qk_norm_eps: the q/k norms' epsilon.
      clip_qkv: None, or clamp q, k and v to `[-clip_qkv, clip_qkv]` after the norms,
        before RoPE (OLMoE).
      sinks: a learned logit per query head in every softmax's denominator (gpt-oss):
        parameter `sinks` `[H]` `P(tp)` (zeros at init), applied by `apply_sinks` to
        the attention's output and lse.
      dtype, param_dtype, precision, kernel_init, bias_init, implementation,
        rngs: as in `nnx.Linear` / `ColumnParallelLinear` (`precision`
        applies to the projections).
      zero, fsdp_axis, reshard_after_forward, reduce_dtype: ZeRO options, as in
        `ColumnParallelLinear`; zero=3 shards the F dimension of the three
        kernels over `fsdp_axis` (`features` divisible by its size).
      attention_implementation: the attention kernel's implementation (flash
        or ring attention); None: `implementation`, which the projections use.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2, 2), ("sequence", "model"))
      >>> attn = sf.layers.ParallelSelfAttention(32, 4, num_kv_heads=2, mesh=mesh, rngs=nnx.Rngs(0))
      >>> y = attn(jnp.ones((2, 16, 32)))
      >>> y.shape, y.sharding.spec
      ((2, 16, 32), P(None, 'sequence', None))
    """

    @renamed_keywords(tp_axis="model_axis", cp_axis="sequence_axis")
    @options_lib.option_keywords
    def __init__(
        self,
        features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        options: options_lib.LayerOptions | None = None,
        causal: bool = True,
        layout: str = "zigzag",
        rope_theta: float | None = 10000.0,
        rope_scaling: tuple | None = None,
        window=None,
        logit_softcap: float | None = None,
        use_bias: bool = False,
        qkv_bias: bool = False,
        qk_norm: str | None = None,
        qk_norm_eps: float = 1e-6,
        clip_qkv: float | None = None,
        sinks: bool = False,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        rngs: nnx.Rngs,
    ):
        options = options_lib.configure(self, options)
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r} must be one of {QK_NORMS}")
        if clip_qkv is not None and not clip_qkv > 0:
            raise ValueError(f"clip_qkv={clip_qkv!r} must be None or > 0")
        mesh = self.mesh
        tp = _sharding.axis_size(mesh, self.model_axis)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads}"
            )
        _sharding.check_divisible("num_heads", num_heads, mesh, self.model_axis)
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} must divide or be divisible by the size {tp} of "
                f"model_axis {self.model_axis!r}"
            )
        if head_dim is None:
            if features % num_heads:
                raise ValueError(
                    f"features={features} not divisible by num_heads={num_heads}; pass head_dim"
                )
            head_dim = features // num_heads
        if head_dim % 2 and rope_theta is not None:
            raise ValueError(
                f"head_dim={head_dim} must be even for rotary embeddings (or rope_theta=None)"
            )
        check_layout(layout)
        self.features, self.num_heads, self.num_kv_heads, self.head_dim = (
            features,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.causal, self.layout = bool(causal), layout
        self.rope_theta = None if rope_theta is None else float(rope_theta)
        self.rope_scaling = None if rope_scaling is None else tuple(rope_scaling)
        # a tuple: the layer configuration is a (hashable) cache key of `call_compiled`
        self.window = None if window is None else tuple(window)
        self.logit_softcap = logit_softcap
        self.attention_implementation = options.attention_kernel_implementation()
        self.kv_sharded = num_kv_heads % tp == 0
        self.qk_norm, self.qk_norm_eps = qk_norm, float(qk_norm_eps)
        self.clip_qkv = None if clip_qkv is None else float(clip_qkv)
        H, K, D, F = num_heads, num_kv_heads, head_dim, features
        fsdp.check_kernel("features", F, mesh, self.zero)
        specs = self._param_specs()
        make = _sharding.param_maker(rngs, self.param_dtype, mesh)
        self.q_kernel = make(kernel_init, (F, H * D), specs["q_kernel"])
        self.kv_kernel = make(kernel_init, (F, K * 2 * D), specs["kv_kernel"])
        self.o_kernel = make(kernel_init, (H * D, F), specs["o_kernel"])
        self.use_bias, self.qkv_bias = use_bias, bool(use_bias or qkv_bias)
        self.q_bias = make(bias_init, (H * D,), specs["q_bias"]) if self.qkv_bias else None
        self.kv_bias = make(bias_init, (K * 2 * D,), specs["kv_bias"]) if self.qkv_bias else None
        self.o_bias = make(bias_init, (F,), specs["o_bias"]) if use_bias else None
        ones = nnx.initializers.ones_init()
        widths = {"head": (D, D), "flat": (H * D, K * D)}.get(qk_norm)
        self.q_norm = make(ones, (widths[0],), specs["q_norm"]) if widths else None
        self.k_norm = make(ones, (widths[1],), specs["k_norm"]) if widths else None
        zeros = nnx.initializers.zeros_init()
        self.sinks = make(zeros, (H,), specs["sinks"]) if sinks else None

    def _param_specs(self):
        """PartitionSpec of each parameter (kv replicated when `K % tp != 0`)."""
        kv = P(None, self.model_axis) if self.kv_sharded else P()
        zero = self.zero  # zero=3: the F dimension of every kernel sharded over fsdp
        return dict(
            q_kernel=fsdp.kernel_spec(P(None, self.model_axis), zero, 0),
            kv_kernel=fsdp.kernel_spec(kv, zero, 0),
            o_kernel=fsdp.kernel_spec(P(self.model_axis, None), zero, 1),
            q_bias=P(self.model_axis),
            kv_bias=P(*kv[1:]),
            o_bias=P(),
            q_norm=P(self.model_axis) if self.qk_norm == "flat" else P(),
            k_norm=P(self.model_axis) if self.qk_norm == "flat" and self.kv_sharded else P(),
            sinks=P(self.model_axis),
        )

    def local_params(self, dtype):
        """Parameter values and their specs, in `local`'s order; biases cast to `dtype`.

        Kernels stay in `param_dtype`: `local` casts them (and gathers them over
        fsdp under zero=3), so that their gradients are reduced before the cast back.
        """
        specs = self._param_specs()
        names = ("q_kernel", "kv_kernel", "o_kernel", "q_bias", "kv_bias", "o_bias", "q_norm",
                 "k_norm", "sinks")  # fmt: skip
        values = [None if getattr(self, n) is None else getattr(self, n)[...] for n in names]
        values[3:6] = [None if b is None else b.astype(dtype) for b in values[3:6]]
        return values, [specs[n] for n in names]

    def default_positions(self, seq_len: int):
        """int32 `[T]`: natural positions of the tokens in layout order."""
        if self.sequence_axis is None:
            return jnp.arange(seq_len, dtype=jnp.int32)
        ring = _sharding.axis_size(self.mesh, self.sequence_axis)
        return ring_positions(seq_len, ring, self.layout).reshape(-1)

    def local(self, x, positions, segment_ids, q_w, kv_w, o_w, q_b, kv_b, o_b, q_n=None,
              k_n=None, sinks=None):  # fmt: skip
        """Per-shard attention (inside `jax.shard_map`).

        x `[b, t, F]` (t = T / cp, or T / (cp * tp) with sequence parallelism),
        positions int `[T / cp]`, segment_ids int `[b, T / cp]` or None.
        """
        heads = self.num_heads // _sharding.axis_size(self.mesh, self.model_axis)  # local heads
        D = self.head_dim
        group = self.num_heads // self.num_kv_heads
        # a flat k norm over a replicated kv kernel: every kv head projected (for the norm)
        k_whole = self.qk_norm == "flat" and not self.kv_sharded
        if not self.kv_sharded and not k_whole:  # replicated: keep the one head this shard reads
            head = lax.axis_index(self.model_axis) * heads // group
            kv_w = lax.dynamic_slice_in_dim(kv_w, head * 2 * D, 2 * D, axis=1)
            kv_b = None if kv_b is None else lax.dynamic_slice_in_dim(kv_b, head * 2 * D, 2 * D)
        # one fused QKV matmul per shard
        # one fused QKV kernel, gathered over fsdp (zero=3) once, right before its matmul
        qkv_w = fsdp.gather(self.zero, jnp.concatenate([q_w, kv_w], axis=1), 0, x.dtype, x)
        y = column_matmul(self, x, qkv_w)
        if q_b is not None:
            y = y + jnp.concatenate([q_b, kv_b])
        b, t = y.shape[:2]
        q = checkpoint_name(y[..., : heads * D], "attention_q").reshape(b, t, heads, D)
        kv = checkpoint_name(y[..., heads * D :], "attention_kv").reshape(b, t, -1, 2, D)
        q, k, v = qk_transform(
            q, kv[..., 0, :], kv[..., 1, :], q_n, k_n, kind=self.qk_norm, eps=self.qk_norm_eps,
            clip=self.clip_qkv, axis_name=self.model_axis,
            widths=(self.num_heads * D, self.num_kv_heads * D), k_whole=k_whole,
        )  # fmt: skip
        if k_whole:  # then the one kv head this shard's query heads read
            head = lax.axis_index(self.model_axis) * heads // group
            k, v = (lax.dynamic_slice_in_dim(a, head, 1, axis=2) for a in (k, v))
        q = rope(q, positions, self.rope_theta, self.rope_scaling)
        k = rope(k, positions, self.rope_theta, self.rope_scaling)
        masks = dict(
            causal=self.causal,
            q_segment_ids=segment_ids,
            kv_segment_ids=segment_ids,
            window=self.window,
            logit_softcap=self.logit_softcap,
            implementation=self.attention_implementation,
        )
        masks["return_lse"] = sinks is not None
        if self.sequence_axis is not None:
            o = ring_attention(q, k, v, self.sequence_axis, layout=self.layout, **masks)
        else:
            o = attention_api.flash_attention(q, k, v, **masks)
        if sinks is not None:
            o = apply_sinks(*o, sinks)
        o = checkpoint_name(o, "attention_core")
        out = row_matmul(
            self, o.reshape(b, t, heads * D), fsdp.gather(self.zero, o_w, 1, x.dtype, x)
        )
        return checkpoint_name(out if o_b is None else out + o_b, "attention_out")

    def io_spec(self):
        """PartitionSpec of the `[B, T, F]` input and output."""
        sequence = _sharding.sequence_spec(
            self.sequence_axis, self.model_axis, self.sequence_parallel
        )
        return P(self.batch_axes, sequence, None)

    def check_input(self, x, positions, segment_ids):
        """Validates a `__call__`'s arguments; returns positions (defaulted)."""
        _sharding.check_activations(x)
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, features={self.features}]")
        B, T = x.shape[:2]
        cp = _sharding.axis_size(self.mesh, self.sequence_axis)
        tp = _sharding.axis_size(self.mesh, self.model_axis) if self.sequence_parallel else 1
        if _sharding.in_manual_region(self.mesh):
            return self._check_local_input(x, positions, segment_ids, cp, tp)
        shards = cp * tp * (2 if self.layout == "zigzag" and cp > 1 else 1)
        if T % shards:
            parts = [f"{self.sequence_axis} size {cp}"] if cp > 1 else []
            parts += [f"{self.model_axis} size {tp} (sequence parallel)"] if tp > 1 else []
            parts += ["2 for the zigzag layout"] if shards != cp * tp else []
            raise ValueError(
                f"sequence length T={T} must be divisible by {shards} ({' x '.join(parts)})"
            )
        _sharding.check_divisible("batch size B", B, self.mesh, self.batch_axes)
        if positions is None:
            positions = self.default_positions(T) if T else jnp.zeros((0,), jnp.int32)
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"positions has dtype {positions.dtype}; expected an integer dtype")
        if tuple(positions.shape) != (T,):
            raise ValueError(
                f"positions must be int [T] = ({T},); got {positions.dtype}{tuple(positions.shape)}"
            )
        if segment_ids is not None and (
            tuple(segment_ids.shape) != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
        ):
            raise ValueError(
                f"segment_ids must be int [B, T] = ({B}, {T}); "
                f"got {segment_ids.dtype}{tuple(segment_ids.shape)}"
            )
        return positions.astype(jnp.int32)

    def _check_local_input(self, x, positions, segment_ids, cp: int, tp: int):
        """`check_input` in a manual region: `x` is this device's shard `[b, t, F]`.

        positions and segment_ids are this sequence shard's, int `[t * tp]` and
        `[b, t * tp]` (t * tp = T / cp); default positions are those of the
        global sequence of length `t * tp * cp` in the ring layout.
        """
        b, t = x.shape[:2]
        local_len = t * tp  # tokens of this sequence shard (before sequence parallelism)
        if positions is None:
            positions = self.default_positions(local_len * cp)
            if cp > 1:
                start = lax.axis_index(self.sequence_axis) * local_len
                positions = lax.dynamic_slice_in_dim(positions, start, local_len)
        if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.shape != (local_len,):
            raise ValueError(
                f"positions must be int [T / {cp}] = ({local_len},) in a manual region; "
                f"got {positions.dtype}{tuple(positions.shape)}"
            )
        if segment_ids is not None and (
            tuple(segment_ids.shape) != (b, local_len)
            or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
        ):
            raise ValueError(
                f"segment_ids must be int [b, T / {cp}] = ({b}, {local_len}) in a manual region; "
                f"got {segment_ids.dtype}{tuple(segment_ids.shape)}"
            )
        return positions.astype(jnp.int32)

    def __call__(self, x, *, positions=None, segment_ids=None):
        """Self-attention of `x` `[B, T, F]` -> `[B, T, F]` (sharding: `io_spec()`).

        Raises TypeError for a non-floating `x` (or non-integer positions or
        segment ids), ValueError for wrong shapes or indivisible lengths.

        Args:
          x: activations in ring-layout order along T when `sequence_axis` is set.
          positions: int `[T]` RoPE positions (default: the tokens' natural positions).
          segment_ids: int `[B, T]` packed-sequence ids; tokens attend within a segment.
        """
        positions = self.check_input(x, positions, segment_ids)
        return _sharding.call_compiled(self, "forward", x, positions, segment_ids)

    def forward(self, x, positions, segment_ids):
        """`__call__` on checked arguments (traced by `call_compiled`)."""
        dtype = _sharding.compute_dtype(self.dtype, x, self.q_kernel[...])
        spec = self.io_spec()
        if x.size == 0:  # empty batch or sequence
            return _sharding.empty_output(x.astype(dtype), x.shape, self.mesh, spec)
        values, specs = self.local_params(dtype)
        return _sharding.shard_map_call(
            fsdp.reshard_after_forward(self.local, self.zero),
            self.mesh,
            [x.astype(dtype), positions, segment_ids, *values],
            [*self.token_specs(), *specs],
            spec,
        )

    def token_specs(self):
        """PartitionSpecs of `x` `[B, T, F]`, `positions` `[T]` and `segment_ids` `[B, T]`."""
        return self.io_spec(), P(self.sequence_axis), P(self.batch_axes, self.sequence_axis)
