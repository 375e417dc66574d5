"""The model's shape (`ModelSpec`) and the shapes of published models.

One home for model sizes and architecture options, a data module at the
bottom of the package beside `axes`, `hardware` and `flops`: it imports
nothing from shardfuse, and everything else may import it (`shardfuse.flops`
reads its parameter counts: `flops.model_flops_per_token(spec, seq_len)`; the
collective-matmul and ring-attention cost models its sizes; the planner its
whole shape). `shardfuse.models.Transformer` builds the model a spec
describes; `shardfuse.models` re-exports these names (`sf.models.ModelSpec`,
`sf.models.get`). Published training runs, the planner's data, live in
`shardfuse.planner.published`.

Every figure is the published checkpoint's `config.json` on the Hugging Face Hub:

  llama3-8b    meta-llama/Meta-Llama-3-8B      hidden_size 4096, num_attention_heads 32,
               num_key_value_heads 8, intermediate_size 14336, num_hidden_layers 32,
               vocab_size 128256 (head dim = 4096 / 32 = 128)
  llama3-70b   meta-llama/Meta-Llama-3-70B     8192, 64, 8, 28672, 80 layers, vocab 128256
  llama3-405b  meta-llama/Llama-3.1-405B       16384, 128, 8, 53248, 126 layers, vocab 128256
  mistral-7b   mistralai/Mistral-7B-v0.1       4096, 32, 8, 14336, 32 layers, vocab 32000,
               sliding_window 4096
  gemma-7b     google/gemma-7b                 3072, 16, 16, head_dim 256, 24576, 28 layers,
               vocab 256000
  gemma2-9b    google/gemma-2-9b               3584, 16, 8, head_dim 256, 14336, 42 layers,
               vocab 256000, sliding_window 4096 (its local layers),
               attn_logit_softcapping 50.0
  gpt3-175b    Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1:
               d_model 12288, 96 layers, 96 heads of 128, d_ff = 4 d_model, context 2048;
               the GPT-2 BPE vocabulary of 50257 tokens; GELU MLP, tied embeddings

Mixtures of experts (`experts` routed experts of `expert_hidden`, `top_k` per token;
the counts `num_params()` / `active_params()` give are the published totals):

  mixtral-8x7b      mistralai/Mixtral-8x7B-v0.1   4096, 32, 8, 14336, 32 layers, vocab 32000,
                    num_local_experts 8, num_experts_per_tok 2 (renormalised softmax),
                    rope_theta 1e6, rms_norm_eps 1e-5; 46.7B total, 12.9B active
  qwen1.5-moe-a2.7b Qwen/Qwen1.5-MoE-A2.7B        2048, 16, 16, intermediate 5632, 24 layers,
                    vocab 151936, num_experts 60, num_experts_per_tok 4,
                    moe_intermediate_size 1408, shared_expert_intermediate_size 5632 (one
                    sigmoid-gated shared expert), norm_topk_prob false, qkv bias; 14.3B / 2.7B
  qwen2-57b-a14b    Qwen/Qwen2-57B-A14B           3584, 28, 4, 18944, 28 layers, vocab 151936,
                    64 experts, top 8, moe_intermediate_size 2560,
                    shared_expert_intermediate_size 20480 (gated), norm_topk_prob false,
                    qkv bias; 57.4B / 14.2B
  qwen3-30b-a3b     Qwen/Qwen3-30B-A3B            2048, 32, 4, head_dim 128, 6144, 48 layers,
                    vocab 151936, 128 experts, top 8, moe_intermediate_size 768,
                    norm_topk_prob true; 30.5B / 3.3B
  qwen3-235b-a22b   Qwen/Qwen3-235B-A22B          4096, 64, 4, head_dim 128, 12288, 94 layers,
                    vocab 151936, 128 experts, top 8, moe_intermediate_size 1536,
                    norm_topk_prob true; 235B / 22B

The `ffn_hidden` of a model whose every block is a mixture of experts is its
`intermediate_size`, which no block reads. Qwen3's per-head q/k RMSNorms (2 x 128
weights a block) are `qk_norm="head"` (counted in `num_params`). Transformers'
`MixtralConfig`, `Qwen2MoeConfig` and `Qwen3MoeConfig` defaults are the Mixtral,
Qwen1.5-MoE and Qwen3-30B figures (the last with 24 layers). DeepSeek-V3 is not in
the table: its multi-head latent attention (low-rank q and kv projections,
`kv_lora_rank` 512, a decoupled RoPE key of 64 dims) has no honest `ModelSpec` form
(heads x head_dim would miscount its attention weights and FLOPs); its MoE part
alone (256 routed experts of 2048, one shared, top 8 of 8 groups limited to 4,
sigmoid routing, routed scaling 2.5, the first 3 blocks dense) is what the fields
`expert_groups`, `topk_groups`, `routing="sigmoid"`, `routed_scaling` and
`moe_first_dense` express.

The GPT configurations of Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473),
Table 1: "gpt-1.7b" ... "gpt-1t", with the heads, hidden size and layers of the
table, head dim = hidden / heads, MLP 4 x hidden (GELU), vocabulary 51200 and
sequence length 2048 (the paper's section 5.1), tied input/output embeddings
(the table's runs: `shardfuse.planner.published.NARAYANAN_2021_TABLE1`).

A user model is one `ModelSpec` constructor
call (`ModelSpec("mine", hidden=..., ...)`), `ModelSpec.gpt(...)` fills in
the GPT conventions from hidden size, heads and layers, and `ModelSpec.tiny(...)`
gives a small Llama-style model (what the examples and tests train on CPU).

Architecture options beyond the sizes (defaults: Llama-style, what every
published entry but the GPTs is): `norm` ("rmsnorm" or "layernorm") and
`norm_eps`; `positions` ("rope" with `rope_theta`, "learned" absolute position
embeddings of `max_positions` rows, or "none"); `use_bias` (GPT-style biases on
every linear and the learned LayerNorm shift) and `qkv_bias` (biases on the
query, key and value projections only, as Qwen2); `activation`,
`tied_embeddings`, `window`, `logit_softcap`; `qk_norm` ("head": RMSNorms over each
head of q and k, Qwen3; "flat": over the whole q and k projections, OLMoE) and
`clip_qkv` (OLMoE's clamp of the q, k, v projections). gpt-oss adds `window_layers`
(the window on some blocks only: `layer_window(i)`), `attention_bias` (q, k, v and o
biases), `attention_sinks` (a learned logit per head in every softmax),
`activation="swiglu_clamped"` (`swiglu_limit`, `swiglu_alpha`), YaRN's named
`rope_scaling` (`rope_scaling_parameters`) and, for its experts, `expert_bias`.

Mixture of experts (`experts > 0`; `sf.layers.ParallelMoE` builds it, issue 44):
`experts` routed experts of `expert_hidden` units (None: `ffn_hidden`), `top_k` of
them per token, scored by `routing` ("softmax", or "sigmoid" as DeepSeek-V3),
`normalize_top_k` (the k weights renormalised to sum to 1: Mixtral, Qwen3;
Qwen2-MoE's `norm_topk_prob=False` does not), group-limited selection
(`expert_groups` groups, the best `topk_groups` of them searched: DeepSeek-V3)
and `routed_scaling` (a factor on the routed output); `shared_experts` always-on
experts of `shared_expert_hidden` (None: `expert_hidden`), optionally behind a
sigmoid gate (`shared_expert_gate`, Qwen2-MoE); which blocks: every `moe_every`-th
(`(i + 1) % moe_every == 0`, Qwen2-MoE's `decoder_sparse_step`) from block
`moe_first_dense` on (DeepSeek's `first_k_dense_replace`): `is_moe_layer(i)`,
`moe_layers`; `dense_layers` lists blocks kept dense whatever the rule (Qwen-MoE's
`mlp_only_layers`). Counts: `num_params()` holds every expert (memory),
`active_params()` the weights one token reads (`top_k` routed experts, the shared
ones and the router: the published MoE MFU's count, `shardfuse.flops`).

Example:
  >>> from shardfuse import models
  >>> models.get("llama3-70b").kv_heads
  8
  >>> "gemma2-9b" in models.names()
  True
"""

import dataclasses
import functools

ACTIVATIONS = ("swiglu", "gelu", "swiglu_clamped")
SWIGLU_LIMIT, SWIGLU_ALPHA = 7.0, 1.702  # gpt-oss's clamped SwiGLU (`swiglu_limit`, `_alpha`)
# `rope_scaling`'s named forms: the kind, then its parameters in this order (Llama 3.1's
# 4-tuple without the name is the "llama3" form too)
ROPE_SCALINGS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_positions"),
    "yarn": ("factor", "beta_fast", "beta_slow", "original_max_positions", "truncate",
             "attention_factor"),
}  # fmt: skip
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned", "none")
ROUTINGS = ("softmax", "sigmoid")  # router scores: Mixtral/Qwen softmax, DeepSeek-V3 sigmoid
# Fields that only a mixture of experts reads, with their dense defaults.
MOE_DEFAULTS = dict(
    top_k=1,
    expert_hidden=None,
    shared_experts=0,
    shared_expert_hidden=None,
    shared_expert_gate=False,
    moe_every=1,
    moe_first_dense=0,
    routing="softmax",
    normalize_top_k=True,
    expert_groups=1,
    topk_groups=1,
    routed_scaling=1.0,
    dense_layers=(),
    expert_bias=False,
)
QK_NORMS = (None, "head", "flat")  # q/k RMSNorm: per head (Qwen3) or over all heads (OLMoE)


def _positive_int(value, *, zero_ok=False) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= (0 if zero_ok else 1)


def rope_scaling_parameters(scaling) -> tuple[str, dict]:
    """`(kind, {name: value})` of a `ModelSpec.rope_scaling` (ValueError naming it if invalid).

    Forms: Llama 3.1's `(factor, low_freq_factor, high_freq_factor,
    original_max_positions)` or the same after the name "llama3"; YaRN's `("yarn",
    factor, beta_fast, beta_slow, original_max_positions, truncate, attention_factor)`
    (Peng et al. 2023; `attention_factor` multiplies cos and sin, transformers'
    `attention_scaling`). `sf.layers.attention.rope_frequencies` computes them.

    Example:
      >>> rope_scaling_parameters(("yarn", 32.0, 32.0, 1.0, 4096, False, 1.35))[1]["beta_fast"]
      32.0
      >>> rope_scaling_parameters((8.0, 1.0, 4.0, 8192))[0]
      'llama3'
    """
    if isinstance(scaling, tuple) and len(scaling) == 4 and not isinstance(scaling[0], str):
        scaling = ("llama3", *scaling)
    kind = scaling[0] if isinstance(scaling, tuple) and scaling else None
    names = ROPE_SCALINGS.get(kind) if isinstance(kind, str) else None
    if names is None or len(scaling) != len(names) + 1:
        forms = "; ".join(f"({k!r}, {', '.join(v)})" for k, v in ROPE_SCALINGS.items())
        raise ValueError(
            f"ModelSpec.rope_scaling={scaling!r} must be None, Llama 3.1's (factor, "
            "low_freq_factor, high_freq_factor, original_max_positions), or a tuple naming "
            f"its kind first: {forms}"
        )
    params = dict(zip(names, scaling[1:], strict=True))
    for name, value in params.items():
        if name == "truncate":
            ok = isinstance(value, bool)
        else:
            ok = not isinstance(value, bool) and isinstance(value, int | float) and value > 0
        if not ok:
            want = "a bool" if name == "truncate" else "a positive number"
            raise ValueError(f"ModelSpec.rope_scaling={scaling!r}: {name}={value!r} must be {want}")
    if kind == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(
            f"ModelSpec.rope_scaling={scaling!r}: high_freq_factor must be > low_freq_factor"
        )
    return kind, params


def check_moe(spec) -> None:
    """ValueError naming the field unless `spec`'s mixture-of-experts fields are consistent.

    Dense (`experts=0`): every MoE field at its default (`MOE_DEFAULTS`). MoE:
    `1 <= top_k <= experts`; `expert_groups` divides `experts`, `1 <= topk_groups
    <= expert_groups` and the chosen groups hold at least `top_k` experts; at
    least one block is a mixture of experts (`moe_first_dense < num_layers`).

    Example:
      >>> from shardfuse.models import ModelSpec
      >>> ModelSpec.tiny(experts=4, top_k=5)
      Traceback (most recent call last):
      ...
      ValueError: ModelSpec.top_k=5 must be an int in [1, experts=4]
    """
    if not _positive_int(spec.experts, zero_ok=True):
        raise ValueError(f"ModelSpec.experts={spec.experts!r} must be an int >= 0 (0: dense)")
    if spec.experts == 0:
        for field, default in MOE_DEFAULTS.items():
            if getattr(spec, field) != default:
                raise ValueError(
                    f"ModelSpec.{field}={getattr(spec, field)!r} needs a mixture of experts "
                    f"(experts > 0); experts=0 is a dense model ({field}={default!r})"
                )
        return
    if not _positive_int(spec.top_k) or spec.top_k > spec.experts:
        raise ValueError(
            f"ModelSpec.top_k={spec.top_k!r} must be an int in [1, experts={spec.experts}]"
        )
    for field, zero_ok in (("moe_every", False), ("moe_first_dense", True),
                           ("shared_experts", True), ("expert_groups", False),
                           ("topk_groups", False)):  # fmt: skip
        if not _positive_int(getattr(spec, field), zero_ok=zero_ok):
            least = 0 if zero_ok else 1
            raise ValueError(
                f"ModelSpec.{field}={getattr(spec, field)!r} must be an int >= {least}"
            )
    for field in ("expert_hidden", "shared_expert_hidden"):
        value = getattr(spec, field)
        if value is not None and not _positive_int(value):
            raise ValueError(f"ModelSpec.{field}={value!r} must be None or a positive int")
    for field in ("shared_expert_gate", "normalize_top_k", "expert_bias"):
        if not isinstance(getattr(spec, field), bool):
            raise ValueError(f"ModelSpec.{field}={getattr(spec, field)!r} must be a bool")
    if spec.routing not in ROUTINGS:
        raise ValueError(f"ModelSpec.routing={spec.routing!r} must be one of {ROUTINGS}")
    scaling = spec.routed_scaling
    if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not scaling > 0:
        raise ValueError(f"ModelSpec.routed_scaling={scaling!r} must be a positive number")
    if spec.shared_experts == 0 and (spec.shared_expert_gate or spec.shared_expert_hidden):
        raise ValueError(
            f"ModelSpec.shared_experts=0 with shared_expert_gate={spec.shared_expert_gate} / "
            f"shared_expert_hidden={spec.shared_expert_hidden}: no shared expert to size or gate"
        )
    if spec.experts % spec.expert_groups:
        raise ValueError(
            f"ModelSpec.expert_groups={spec.expert_groups} must divide experts={spec.experts}"
        )
    if spec.topk_groups > spec.expert_groups:
        raise ValueError(
            f"ModelSpec.topk_groups={spec.topk_groups} must be <= expert_groups="
            f"{spec.expert_groups}"
        )
    if spec.topk_groups * (spec.experts // spec.expert_groups) < spec.top_k:
        raise ValueError(
            f"ModelSpec.topk_groups={spec.topk_groups}: {spec.topk_groups} groups of "
            f"{spec.experts // spec.expert_groups} experts hold fewer than top_k={spec.top_k}"
        )
    dense = spec.dense_layers
    if (
        not isinstance(dense, tuple)
        or any(not _positive_int(i, zero_ok=True) or i >= spec.num_layers for i in dense)
        or list(dense) != sorted(set(dense))
    ):
        raise ValueError(
            f"ModelSpec.dense_layers={dense!r} must be a sorted tuple of distinct block "
            f"indices in [0, num_layers={spec.num_layers})"
        )
    if spec.moe_first_dense >= spec.num_layers or not spec.moe_layers:
        raise ValueError(
            f"ModelSpec.moe_first_dense={spec.moe_first_dense} with moe_every={spec.moe_every} "
            f"leaves no mixture-of-experts block among num_layers={spec.num_layers}"
        )


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The sizes of one decoder-only transformer.

    Attributes:
      name: short name, the key of `MODELS` ("llama3-8b").
      hidden: model width (`hidden_size`).
      heads: query heads H.
      kv_heads: key/value heads K (`H % K == 0`; K < H is GQA, K == 1 MQA).
      head_dim: D (may differ from `hidden // heads`, as in Gemma).
      ffn_hidden: MLP hidden size (`intermediate_size`).
      num_layers: transformer blocks.
      vocab_size: embedding rows.
      window: sliding-window size (keys, the query itself included) of its local
        attention layers, or None (global attention only).
      window_layers: the blocks that use `window`, a sorted tuple of block indices; None
        (default): every block (gpt-oss: the even blocks, its `layer_types`).
        `layer_window(i)` says it per block.
      logit_softcap: attention logit softcap, or None.
      activation: MLP activation: "swiglu" (gated: three `hidden x ffn_hidden`
        matrices, Llama, Mistral, Gemma), "gelu" (two, GPT) or "swiglu_clamped"
        (gpt-oss's gated form, three matrices: the gate clamped above at
        `swiglu_limit`, the up half to `[-swiglu_limit, swiglu_limit]`, then
        `(up + 1) * gate * sigmoid(swiglu_alpha * gate)`; `sf.layers.mlp.activate`).
      swiglu_limit, swiglu_alpha: of "swiglu_clamped" (gpt-oss: 7.0 and 1.702, the
        defaults); no other activation reads them.
      tied_embeddings: the output projection reuses the input embedding (GPT).
      norm: "rmsnorm" (scale only) or "layernorm" (scale and shift).
      norm_eps: epsilon of every norm (added to the mean square).
      positions: "rope" (rotary, base `rope_theta`), "learned" (a `[max_positions,
        hidden]` table added to the token embeddings, GPT-2) or "none".
      rope_theta: RoPE base (with `positions="rope"`).
      rope_scaling: None; Llama 3.1's RoPE frequency scaling `(factor,
        low_freq_factor, high_freq_factor, original_max_positions)` (also spelled
        with "llama3" first); or YaRN's `("yarn", factor, beta_fast, beta_slow,
        original_max_positions, truncate, attention_factor)` (gpt-oss;
        `rope_scaling_parameters`, `sf.layers.attention.rope_frequencies`).
      max_positions: rows of the learned position table (required with
        `positions="learned"`: the longest sequence the model reads), else None.
      use_bias: biases on every linear layer (q, k, v, o and the MLP), GPT-style.
      qkv_bias: biases on the q, k and v projections only (Qwen2); implied by
        `use_bias`.
      attention_bias: biases on the q, k, v and o projections, none in the MLP
        (gpt-oss's `attention_bias`); implied by `use_bias`.
      attention_sinks: a learned logit per query head joining every softmax's
        denominator (no value): gpt-oss's `sinks`; the layer's parameter `sinks [H]`.
      experts: routed experts per mixture-of-experts block (0: a dense model).
      top_k: experts each token is routed to (`1 <= top_k <= experts`).
      expert_hidden: hidden size of one routed expert (None: `ffn_hidden`).
      shared_experts, shared_expert_hidden: always-on experts and their hidden size
        (None: `expert_hidden`).
      shared_expert_gate: a sigmoid gate `hidden -> 1` on the shared experts' output
        (Qwen2-MoE).
      moe_every, moe_first_dense: which blocks are MoE (`is_moe_layer`).
      routing: "softmax" or "sigmoid" router scores.
      normalize_top_k: the top-k weights renormalised to sum to 1.
      expert_groups, topk_groups: group-limited top-k (DeepSeek-V3: 8 groups, 4 searched).
      routed_scaling: factor on the routed experts' output (DeepSeek-V3: 2.5).
      expert_bias: biases on the router's logits (`[E]`) and on each routed expert's
        projections (`[2 x expert_hidden]` and `[hidden]` per expert): gpt-oss.
      dense_layers: blocks whose MLP is dense whatever `moe_every` says (Qwen-MoE's
        `mlp_only_layers`), a sorted tuple of block indices.
      qk_norm: None, "head" (an RMSNorm over each head's `head_dim` of q and k, before
        RoPE: Qwen3) or "flat" (an RMSNorm over the whole q projection `heads x
        head_dim` and the whole k projection `kv_heads x head_dim`: OLMoE).
      clip_qkv: None, or clamp the q, k and v projections to `[-clip_qkv, clip_qkv]`
        (after the q/k norms, before RoPE: OLMoE's `clip_qkv`).

    Raises:
      ValueError: a size is not a positive int, `heads % kv_heads != 0`, or an
        option outside its valid values (the message names the field).

    Example:
      >>> from shardfuse.models import ModelSpec
      >>> ModelSpec("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=256,
      ...            num_layers=2, vocab_size=1000).heads
      4
    """

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    num_layers: int
    vocab_size: int
    window: int | None = None
    logit_softcap: float | None = None
    activation: str = "swiglu"
    tied_embeddings: bool = False
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    positions: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_positions: int | None = None
    use_bias: bool = False
    qkv_bias: bool = False
    experts: int = 0
    top_k: int = 1
    expert_hidden: int | None = None
    shared_experts: int = 0
    shared_expert_hidden: int | None = None
    shared_expert_gate: bool = False
    moe_every: int = 1
    moe_first_dense: int = 0
    routing: str = "softmax"
    normalize_top_k: bool = True
    expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    dense_layers: tuple = ()
    qk_norm: str | None = None
    clip_qkv: float | None = None
    window_layers: tuple | None = None
    attention_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float = SWIGLU_LIMIT
    swiglu_alpha: float = SWIGLU_ALPHA

    def __post_init__(self):
        for field in (
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "ffn_hidden",
            "num_layers",
            "vocab_size",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelSpec.{field}={value!r} must be a positive int")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelSpec heads={self.heads} must be a multiple of kv_heads={self.kv_heads}"
            )
        for field, valid in (
            ("activation", ACTIVATIONS),
            ("norm", NORMS),
            ("positions", POSITIONS),
        ):
            if getattr(self, field) not in valid:
                raise ValueError(
                    f"ModelSpec.{field}={getattr(self, field)!r} must be one of {valid}"
                )
        for field in ("tied_embeddings", "use_bias", "qkv_bias", "attention_bias",
                      "attention_sinks"):  # fmt: skip
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"ModelSpec.{field}={getattr(self, field)!r} must be a bool (True or False)"
                )
        for field, optional in (
            ("norm_eps", False),
            ("rope_theta", False),
            ("logit_softcap", True),
        ):
            value = getattr(self, field)
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ModelSpec.{field}={value!r} must be a positive number")
        for field in ("window", "max_positions"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"ModelSpec.{field}={value!r} must be None or a positive int")
        if self.rope_scaling is not None:
            rope_scaling_parameters(self.rope_scaling)
        for field in ("swiglu_limit", "swiglu_alpha"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ModelSpec.{field}={value!r} must be a positive number")
        layers = self.window_layers
        if layers is not None and (
            self.window is None
            or not isinstance(layers, tuple)
            or any(not _positive_int(i, zero_ok=True) or i >= self.num_layers for i in layers)
            or list(layers) != sorted(set(layers))
        ):
            raise ValueError(
                f"ModelSpec.window_layers={layers!r} must be None (every block, when window is "
                "set) or, with a window, a sorted tuple of distinct block indices in "
                f"[0, num_layers={self.num_layers}) (window={self.window!r})"
            )
        if self.positions == "learned" and self.max_positions is None:
            raise ValueError(
                "ModelSpec.max_positions=None: positions='learned' needs the number of "
                "position embeddings (the longest sequence), e.g. max_positions=2048"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(
                f"ModelSpec.head_dim={self.head_dim} must be even with positions='rope' "
                "(rotary embeddings rotate pairs)"
            )
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"ModelSpec.qk_norm={self.qk_norm!r} must be one of {QK_NORMS}")
        clip = self.clip_qkv
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0
        ):
            raise ValueError(f"ModelSpec.clip_qkv={clip!r} must be None or a positive number")
        check_moe(self)

    @classmethod
    def gpt(cls, name: str, hidden: int, heads: int, num_layers: int, vocab_size: int = 51200):
        """A GPT-style model: MHA, head dim `hidden / heads`, GELU MLP of `4 * hidden`, tied.

        Raises:
          ValueError: `hidden % heads != 0`, or a size that is not a positive int.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> ModelSpec.gpt("gpt-small", 768, 12, 12).ffn_hidden
          3072
        """
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"hidden={hidden!r} and heads={heads!r} must be positive ints")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        return cls(
            name,
            hidden,
            heads,
            heads,
            hidden // heads,
            4 * hidden,
            num_layers=num_layers,
            vocab_size=vocab_size,
            activation="gelu",
            tied_embeddings=True,
        )

    @classmethod
    def tiny(
        cls,
        name: str = "tiny",
        *,
        hidden: int = 64,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int | None = None,
        ffn_hidden: int = 128,
        num_layers: int = 4,
        vocab_size: int = 256,
        **options,
    ):
        """A small model, Llama-style by default, that trains on 8 CPU devices in seconds.

        Sizes by keyword, `head_dim` defaulting to `hidden // heads`; `options`: any
        other field (`activation="gelu"`, `positions="learned"`, `max_positions=...`).

        Raises:
          ValueError: `hidden % heads != 0` without a `head_dim`, or an invalid field.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> spec = ModelSpec.tiny(num_layers=2)
          >>> spec.hidden, spec.head_dim, spec.num_layers
          (64, 16, 2)
        """
        if head_dim is None:
            if not isinstance(heads, int) or heads < 1 or not isinstance(hidden, int):
                raise ValueError(f"hidden={hidden!r} and heads={heads!r} must be positive ints")
            if hidden % heads:
                raise ValueError(
                    f"hidden={hidden} must be a multiple of heads={heads}; or pass head_dim"
                )
            head_dim = hidden // heads
        return cls(
            name,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn_hidden,
            num_layers=num_layers,
            vocab_size=vocab_size,
            **options,
        )

    def replace(self, **fields):
        """A copy with `fields` changed (validated again): `dataclasses.replace`.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> ModelSpec.tiny().replace(num_layers=1).num_layers
          1
        """
        return dataclasses.replace(self, **fields)

    @property
    def mlp_matrices(self) -> int:
        """`hidden x ffn_hidden` matrices per MLP: 3 gated (swiglu, swiglu_clamped), 2 plain
        (gelu)."""
        return 2 if self.activation == "gelu" else 3

    # ---- mixture of experts ----

    @property
    def is_moe(self) -> bool:
        """Whether any block's MLP is a mixture of experts (`experts > 0`)."""
        return self.experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (0-based) is a mixture of experts.

        Blocks `moe_first_dense, ...` whose number `layer + 1` is a multiple of
        `moe_every` (Qwen2-MoE's `decoder_sparse_step`; DeepSeek's
        `first_k_dense_replace` is `moe_first_dense`).

        Raises:
          ValueError: `layer` outside `[0, num_layers)`.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> spec = ModelSpec.tiny(num_layers=4, experts=4, top_k=2, moe_every=2)
          >>> [spec.is_moe_layer(i) for i in range(4)]
          [False, True, False, True]
        """
        if (
            isinstance(layer, bool)
            or not isinstance(layer, int)
            or not 0 <= layer < self.num_layers
        ):
            raise ValueError(f"layer={layer!r} must be an int in [0, num_layers={self.num_layers})")
        return (
            self.experts > 0
            and layer >= self.moe_first_dense
            and (layer + 1) % self.moe_every == 0
            and layer not in self.dense_layers
        )

    @functools.cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """The blocks whose MLP is a mixture of experts, in order (empty when dense).

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> ModelSpec.tiny(num_layers=4, experts=4, moe_first_dense=1).moe_layers
          (1, 2, 3)
        """
        if self.experts == 0:
            return ()
        return tuple(
            i
            for i in range(self.moe_first_dense, self.num_layers)
            if (i + 1) % self.moe_every == 0 and i not in self.dense_layers
        )

    @property
    def expert_ffn_hidden(self) -> int:
        """Hidden size of one routed expert: `expert_hidden`, else `ffn_hidden`."""
        return self.ffn_hidden if self.expert_hidden is None else self.expert_hidden

    @property
    def shared_expert_ffn_hidden(self) -> int:
        """Hidden size of one shared expert: `shared_expert_hidden`, else `expert_ffn_hidden`."""
        if self.shared_expert_hidden is None:
            return self.expert_ffn_hidden
        return self.shared_expert_hidden

    def expert_params(self) -> int:
        """Weights of one routed expert: `mlp_matrices x hidden x expert_ffn_hidden`."""
        return self.mlp_matrices * self.hidden * self.expert_ffn_hidden

    def mlp_matmul_params(self, layer: int, *, active: bool = True) -> int:
        """Matmul weights of block `layer`'s MLP; `active`: those one token reads.

        Dense: `mlp_matrices x hidden x ffn_hidden`. Mixture of experts: the
        routed experts (`top_k` of them active, all `experts` in total), the
        shared experts, the router (`hidden x experts`) and the shared expert's
        gate (`hidden x 1`, Qwen2-MoE) -- the count of published MoE MFU.

        Example:
          >>> from shardfuse import models
          >>> mixtral = models.get("mixtral-8x7b")
          >>> mixtral.mlp_matmul_params(0) == 2 * 3 * 4096 * 14336 + 4096 * 8
          True
        """
        if not self.is_moe_layer(layer):
            return self.mlp_matrices * self.hidden * self.ffn_hidden
        return self._moe_mlp_params(active)

    def _moe_mlp_params(self, active: bool) -> int:
        routed = (self.top_k if active else self.experts) * self.expert_params()
        shared = (
            self.shared_experts * self.mlp_matrices * self.hidden * (self.shared_expert_ffn_hidden)
        )
        router = self.hidden * self.experts + (self.hidden if self.shared_expert_gate else 0)
        return routed + shared + router

    def routed_expert_params(self, *, active: bool = True) -> float:
        """Routed experts' weights per block, the mean over the blocks (`top_k` of them when
        `active`): what an expert axis shards, and what runs as grouped matmuls.

        Example:
          >>> from shardfuse import models
          >>> models.get("mixtral-8x7b").routed_expert_params(active=False) == 8 * 3 * 4096 * 14336
          True
        """
        return self._block_means[("routed_experts", bool(active))]

    def mlp_width(self) -> float:
        """Hidden units of the MLP a token runs through, the mean over the blocks.

        `ffn_hidden` dense; in a mixture of experts `top_k x expert_ffn_hidden +
        shared_experts x shared_expert_ffn_hidden` (what the activations of a
        token hold).

        Example:
          >>> from shardfuse import models
          >>> models.get("qwen3-30b-a3b").mlp_width()
          6144
        """
        n_moe = len(self.moe_layers)
        if not n_moe:
            return self.ffn_hidden
        moe = self.top_k * self.expert_ffn_hidden
        moe += self.shared_experts * self.shared_expert_ffn_hidden
        return self._mean(n_moe * moe + (self.num_layers - n_moe) * self.ffn_hidden)

    def _mean(self, total):
        """`total / num_layers`, an int where it divides."""
        return total // self.num_layers if total % self.num_layers == 0 else total / self.num_layers

    # ---- parameter counts ----

    def attention_matmul_params(self) -> int:
        """Matmul weights of one block's attention: the q, k, v and o projections."""
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        return self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden

    def layer_matmul_params(self, layer: int | None = None, *, active: bool = True):
        """Matmul weights of a block: q, k, v, o projections and the MLP (what FLOPs count).

        `layer`: that block's; None: the mean over the blocks (every block's in a
        dense model; an int where it divides). `active`: the weights one token
        reads (a mixture of experts: `top_k` routed experts, the shared ones and
        the router, `mlp_matmul_params`); False: all of them.

        Example:
          >>> from shardfuse import models
          >>> models.get("llama3-8b").layer_matmul_params()
          218103808
        """
        if layer is not None:
            return self.attention_matmul_params() + self.mlp_matmul_params(layer, active=active)
        return self._block_means[("matmul", bool(active))]

    def _mlp_total(self, active: bool) -> int:
        """The MLP matmul weights of all the blocks (the search asks for them often: no loop)."""
        n_moe = len(self.moe_layers)
        dense = self.mlp_matrices * self.hidden * self.ffn_hidden
        moe = self._moe_mlp_params(active) if n_moe else 0
        return n_moe * moe + (self.num_layers - n_moe) * dense

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: scale (RMSNorm), scale and shift (LayerNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def _layer_extras(self) -> int:
        """A block's weights beyond its matmuls: biases, sinks and two norms (an MoE block's
        expert biases: `_expert_biases`)."""
        biases = 0
        if self.use_bias or self.qkv_bias or self.attention_bias:
            biases += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.use_bias or self.attention_bias:  # o
            biases += self.hidden
        if self.use_bias:  # MLP up (2 x ffn_hidden when gated) and down
            biases += (self.mlp_matrices - 1) * self.ffn_hidden + self.hidden
        if self.attention_sinks:
            biases += self.heads
        flat = (self.heads + self.kv_heads) * self.head_dim
        qk_norm = {"head": 2 * self.head_dim, "flat": flat}.get(self.qk_norm, 0)
        return biases + 2 * self.norm_params + qk_norm

    def layer_params(self, layer: int | None = None, *, active: bool = False):
        """Weights of a transformer block: q, k, v, o projections, MLP, biases, two norms.

        `layer` and `active` as in `layer_matmul_params`, but all experts by
        default (`active=False`: what memory holds).

        Example:
          >>> from shardfuse import models
          >>> models.get("llama3-8b").layer_params()
          218112000
        """
        if layer is None:
            return self._block_means[("layer", bool(active))]
        extras = self._layer_extras()
        if self.is_moe_layer(layer):
            extras += self._expert_biases(active)
        return self.layer_matmul_params(layer, active=active) + extras

    @functools.cached_property
    def _block_means(self) -> dict:
        """The means over the blocks of `routed_expert_params`, `layer_matmul_params` and
        `layer_params`, by `(count, active)`: the planner's cost model reads them for every
        candidate of a search, and a spec is frozen, so they are computed once."""
        means = {}
        for active in (False, True):  # `active` is read for its truth only
            routed = (self.top_k if active else self.experts) * self.expert_params()
            means["routed_experts", active] = self._mean(routed * len(self.moe_layers))
            matmul = self.attention_matmul_params() + self._mean(self._mlp_total(active))
            means["matmul", active] = matmul
            extras = self._layer_extras()
            extras += self._mean(len(self.moe_layers) * self._expert_biases(active))
            means["layer", active] = matmul + extras
        return means

    def embedding_params(self) -> int:
        """Input embedding, output projection (once when tied), positions, the final norm."""
        tables = 1 if self.tied_embeddings else 2
        positions = self.max_positions * self.hidden if self.positions == "learned" else 0
        return tables * self.vocab_size * self.hidden + positions + self.norm_params

    def num_params(self, *, active: bool = False) -> int:
        """Total weights: `num_layers * layer_params() + embedding_params()`.

        `active=True`: the weights one token reads (`active_params`).

        Example:
          >>> from shardfuse import models
          >>> round(models.get("llama3-8b").num_params() / 1e9, 2)
          8.03
          >>> round(models.get("mixtral-8x7b").num_params() / 1e9, 2)
          46.7
        """
        per_layer = self.attention_matmul_params() + self._layer_extras()
        layers = self.num_layers * per_layer + self._mlp_total(active)
        layers += len(self.moe_layers) * self._expert_biases(active)
        return layers + self.embedding_params()

    def _expert_biases(self, active: bool) -> int:
        """An MoE block's biases with `expert_bias`: the router's `[E]` and each routed
        expert's up (`2 x expert_hidden` gated) and down (`hidden`); `active`: top_k's."""
        if not self.expert_bias:
            return 0
        per_expert = (self.mlp_matrices - 1) * self.expert_ffn_hidden + self.hidden
        return self.experts + (self.top_k if active else self.experts) * per_expert

    def active_params(self) -> int:
        """Weights one token reads: `num_params(active=True)` (all of them in a dense model).

        Example:
          >>> from shardfuse import models
          >>> round(models.get("mixtral-8x7b").active_params() / 1e9, 2)
          12.88
        """
        return self.num_params(active=True)

    def layer_window(self, layer: int) -> tuple[int, int] | None:
        """The `window=` of block `layer`'s attention (`sf.flash_attention`'s): `(window - 1,
        0)` where the block slides (`window` set, and `layer` in `window_layers` when given),
        else None.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> spec = ModelSpec.tiny(num_layers=4, window=8, window_layers=(0, 2))
          >>> [spec.layer_window(i) for i in range(4)]
          [(7, 0), None, (7, 0), None]
        """
        self.is_moe_layer(layer)  # (its check of `layer`)
        if self.window is None or (self.window_layers is not None
                                   and layer not in self.window_layers):  # fmt: skip
            return None
        return (self.window - 1, 0)

    @property
    def causal_mask(self) -> tuple[tuple[int, int] | None, str]:
        """`(window, variant)` of its causal self-attention.

        `window` is the `window=` argument of `sf.flash_attention` (a window of W
        keys is `(W - 1, 0)`, None without one) of its windowed blocks (all of them
        unless `window_layers` says: `layer_window`); `variant` labels the mask and
        options ("causal window=4096 softcap=50").

        Example:
          >>> from shardfuse import models
          >>> models.get("mistral-7b").causal_mask
          ((4095, 0), 'causal window=4096')
        """
        window = (self.window - 1, 0) if self.window else None
        variant = "causal"
        if window:
            variant += f" window={self.window}"
        if self.logit_softcap:
            variant += f" softcap={self.logit_softcap:g}"
        return window, variant


# Figures and sources: the module docstring.
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama3-8b", 4096, 32, 8, 128, 14336, num_layers=32, vocab_size=128256),
        ModelSpec("llama3-70b", 8192, 64, 8, 128, 28672, num_layers=80, vocab_size=128256),
        ModelSpec("llama3-405b", 16384, 128, 8, 128, 53248, num_layers=126, vocab_size=128256),
        ModelSpec(
            "mistral-7b", 4096, 32, 8, 128, 14336, num_layers=32, vocab_size=32000, window=4096
        ),
        ModelSpec("gemma-7b", 3072, 16, 16, 256, 24576, num_layers=28, vocab_size=256000),
        ModelSpec(
            "gemma2-9b",
            3584,
            16,
            8,
            256,
            14336,
            num_layers=42,
            vocab_size=256000,
            window=4096,
            logit_softcap=50.0,
        ),
        ModelSpec(
            "gpt3-175b",
            12288,
            96,
            96,
            128,
            49152,
            num_layers=96,
            vocab_size=50257,
            activation="gelu",
            tied_embeddings=True,
        ),
        # Narayanan et al. 2021, Table 1 (heads, hidden, layers); vocabulary 51200.
        ModelSpec.gpt("gpt-1.7b", 2304, 24, 24),
        ModelSpec.gpt("gpt-3.6b", 3072, 32, 30),
        ModelSpec.gpt("gpt-7.5b", 4096, 32, 36),
        ModelSpec.gpt("gpt-18b", 6144, 48, 40),
        ModelSpec.gpt("gpt-39b", 8192, 64, 48),
        ModelSpec.gpt("gpt-76b", 10240, 80, 60),
        ModelSpec.gpt("gpt-145b", 12288, 96, 80),
        ModelSpec.gpt("gpt-310b", 16384, 128, 96),
        ModelSpec.gpt("gpt-530b", 20480, 128, 105),
        ModelSpec.gpt("gpt-1t", 25600, 160, 128),
        # Mixtures of experts (module docstring): every block's MLP routed.
        ModelSpec(
            "mixtral-8x7b",
            4096,
            32,
            8,
            128,
            14336,
            num_layers=32,
            vocab_size=32000,
            rope_theta=1e6,
            norm_eps=1e-5,
            experts=8,
            top_k=2,
        ),  # fmt: skip
        ModelSpec(
            "qwen1.5-moe-a2.7b",
            2048,
            16,
            16,
            128,
            5632,
            num_layers=24,
            vocab_size=151936,
            rope_theta=1e6,
            qkv_bias=True,
            experts=60,
            top_k=4,
            expert_hidden=1408,
            shared_experts=1,
            shared_expert_hidden=5632,
            shared_expert_gate=True,
            normalize_top_k=False,
        ),  # fmt: skip
        ModelSpec(
            "qwen2-57b-a14b",
            3584,
            28,
            4,
            128,
            18944,
            num_layers=28,
            vocab_size=151936,
            rope_theta=1e6,
            qkv_bias=True,
            experts=64,
            top_k=8,
            expert_hidden=2560,
            shared_experts=1,
            shared_expert_hidden=20480,
            shared_expert_gate=True,
            normalize_top_k=False,
        ),  # fmt: skip
        ModelSpec(
            "qwen3-30b-a3b",
            2048,
            32,
            4,
            128,
            6144,
            num_layers=48,
            vocab_size=151936,
            rope_theta=1e6,
            experts=128,
            top_k=8,
            expert_hidden=768,
            qk_norm="head",
        ),  # fmt: skip
        ModelSpec(
            "qwen3-235b-a22b",
            4096,
            64,
            4,
            128,
            12288,
            num_layers=94,
            vocab_size=151936,
            rope_theta=1e6,
            experts=128,
            top_k=8,
            expert_hidden=1536,
            qk_norm="head",
        ),  # fmt: skip
    )
}


def names() -> list[str]:
    """The names `get` accepts, sorted.

    Example:
      >>> from shardfuse import models
      >>> models.names()[:2]
      ['gemma-7b', 'gemma2-9b']
    """
    return sorted(MODELS)


def get(name: str) -> ModelSpec:
    """The `ModelSpec` called `name`.

    Args:
      name: a key of `MODELS`, e.g. "llama3-8b".

    Returns:
      The model's shape.

    Raises:
      ValueError: unknown `name` (the message lists the valid ones).

    Example:
      >>> from shardfuse import models
      >>> models.get("llama3-8b").ffn_hidden
      14336
    """
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"model {name!r} is not one of {names()}") from None
