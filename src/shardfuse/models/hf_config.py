"""Hugging Face `config.json` <-> `ModelSpec`: Llama, Mistral, Qwen2 and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss.

The config half of Hugging Face checkpoints (`shardfuse.models.hf` is the
tensor half, and re-exports these names): `spec_from_hf_config` maps a
`config.json` (a dict) to the `ModelSpec` it describes, refusing, by name,
any field whose value shardfuse does not compute; `hf_config` is the inverse
for a model family; `read_hf_spec` reads a checkpoint directory's
`config.json` (what `load_hf` and the trainer's `init_from` read).
"""

import json
import math
from pathlib import Path

from shardfuse.model_spec import SWIGLU_ALPHA, SWIGLU_LIMIT, ModelSpec, rope_scaling_parameters

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
# Families known and refused, with what shardfuse does not compute (named in the ValueError).
NOT_SUPPORTED: dict[str, str] = {}
# gpt-oss's defaults where its config.json omits a field (`GptOssConfig`)
GPT_OSS_DEFAULTS = dict(
    rope_theta=150000.0,
    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=4096),
    sliding_window=128,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    num_local_experts=128,
    num_experts_per_tok=4,
    head_dim=64,
    attention_bias=True,
    swiglu_alpha=SWIGLU_ALPHA,
    swiglu_limit=SWIGLU_LIMIT,
)  # fmt: skip
_LAYER_TYPES = ("sliding_attention", "full_attention")
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}


def _rope_parameters(config: dict, default_theta: float = 10000.0) -> dict:
    """A config's RoPE fields: old (`rope_theta`, `rope_scaling`) or new (`rope_parameters`).

    As transformers reads them (`convert_rope_params_to_dict`): a non-empty
    `rope_scaling` replaces `rope_parameters` whole (transformers 5 writes a default
    `rope_parameters` into every config it saves, and model cards have users add a
    `rope_scaling` beside it), and `rope_theta` comes from the chosen dict, else the
    top-level field, else the family's `default_theta` (10000; gpt-oss 150000).
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if params.get("rope_theta") is None:
        theta = config.get("rope_theta")
        params["rope_theta"] = default_theta if theta is None else theta
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = kind
    return params


def _moe_fields(config: dict, kind: str) -> dict:
    """The `ModelSpec` fields of a mixture-of-experts family's config (as transformers 5
    reads them: `modeling_{mixtral,qwen2_moe,qwen3_moe,olmoe}.py`).

    Routing is a float32 softmax, top `num_experts_per_tok`, renormalised always
    (Mixtral) or where `norm_topk_prob` (Qwen, OLMoE). Qwen-MoE blocks are sparse where
    `(i + 1) % decoder_sparse_step == 0` and `i` is not in `mlp_only_layers`; Qwen2-MoE
    adds one shared expert behind a sigmoid gate. `router_jitter_noise` (Mixtral) is
    noise transformers applies in training only: refused when > 0 (shardfuse trains
    what it loads). `output_router_logits` and the aux-loss coefficients say nothing
    about the forward: ignored.
    """
    experts = config.get("num_local_experts") if kind == "mixtral" else None
    experts = experts or config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        if kind in ("mixtral", "olmoe"):
            raise ValueError(f"config.json: model_type={kind!r} needs num_experts > 0")
        return {}
    if config.get("num_experts_per_tok") is None:
        raise ValueError("config.json: the required field 'num_experts_per_tok' is missing")
    if config.get("router_jitter_noise"):
        raise ValueError(
            f"config.json: router_jitter_noise={config['router_jitter_noise']} is not "
            "supported (training-time noise on the router's input); set it to 0.0"
        )
    fields = dict(experts=int(experts), top_k=int(config["num_experts_per_tok"]))
    if kind in ("mixtral", "olmoe"):
        fields["expert_hidden"] = config["intermediate_size"]
    else:
        if "moe_intermediate_size" not in config:
            raise ValueError("config.json: the required field 'moe_intermediate_size' is missing")
        fields["expert_hidden"] = config["moe_intermediate_size"]
    # Mixtral renormalises always; the others' default (their config classes): False
    fields["normalize_top_k"] = kind == "mixtral" or bool(config.get("norm_topk_prob", False))
    if kind in ("qwen2_moe", "qwen3_moe"):
        step = config.get("decoder_sparse_step", 1) or 1
        dense = sorted(set(config.get("mlp_only_layers") or []))
        layers = config["num_hidden_layers"]
        if any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
            raise ValueError(
                f"config.json: mlp_only_layers={config.get('mlp_only_layers')} must hold "
                f"block indices in [0, {layers})"
            )
        if all((i + 1) % step or i in dense for i in range(layers)):
            return {}  # no sparse block: transformers builds a dense model
        # indices that step already makes dense say nothing more
        fields.update(moe_every=int(step), dense_layers=tuple(i for i in dense
                                                              if (i + 1) % step == 0))  # fmt: skip
    if kind == "qwen2_moe":
        shared = config.get("shared_expert_intermediate_size")
        if not shared:
            raise ValueError(
                f"config.json: shared_expert_intermediate_size={shared!r}: Qwen2-MoE's shared "
                "expert needs a positive width"
            )
        fields.update(shared_experts=1, shared_expert_hidden=int(shared),
                      shared_expert_gate=True)  # fmt: skip
    return fields


def _check_quantization(quantization: dict, kind: str):
    """ValueError unless `quantization_config` is one `load_hf` dequantizes: gpt-oss's MXFP4
    experts (`shardfuse.models.mxfp4`)."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if kind == "gpt_oss" and method == "mxfp4":
        return
    raise ValueError(
        f"config.json: quantization_config={quantization!r} is not supported; supported: "
        "quant_method 'mxfp4' on gpt_oss (its experts, dequantized on load)"
    )


def _rope_scaling(config: dict, rope: dict):
    """`ModelSpec.rope_scaling` of a config's RoPE parameters (`_rope_parameters`): None,
    Llama 3.1's 4-tuple, or YaRN's named tuple with its `attention_factor` resolved as
    transformers' `_compute_yarn_parameters` does (`mscale`, `mscale_all_dim`, `factor`)."""
    kind = rope["rope_type"]
    if kind not in ("default", "llama3", "yarn"):
        raise ValueError(
            f"config.json: rope type {kind!r} is not supported; supported: 'default', "
            "'llama3', 'yarn'"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"config.json: partial_rotary_factor={rope['partial_rotary_factor']} is not "
            "supported (RoPE on part of each head)"
        )
    if kind == "default":
        return None
    # transformers' `standardize_rope_params`: a top-level original length first, else the
    # config's max_position_embeddings
    if "original_max_position_embeddings" in config:
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    elif "max_position_embeddings" in config:
        rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    if kind == "llama3":
        fields = ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")  # fmt: skip
        missing = [f for f in fields if f not in rope]
        if missing:
            raise ValueError(f"config.json: rope type 'llama3' needs {missing} in rope_parameters")
        original = int(rope["original_max_position_embeddings"])
        return (float(rope["factor"]), float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]), original)  # fmt: skip
    original = rope.get("original_max_position_embeddings")
    if not original:
        raise ValueError(
            "config.json: rope type 'yarn' needs original_max_position_embeddings in "
            "rope_parameters (or max_position_embeddings)"
        )
    factor = rope.get("factor")
    if factor is None:  # (DeepSeek-V3's form: the ratio of the lengths)
        factor = config["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:

        def mscale(scale, m=1):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else (
            mscale(factor))  # fmt: skip
    return ("yarn", float(factor), float(rope.get("beta_fast") or 32),
            float(rope.get("beta_slow") or 1), original, bool(rope.get("truncate", True)),
            float(attention_factor))  # fmt: skip


def _gpt_oss_fields(config: dict) -> dict:
    """The `ModelSpec` fields of a gpt-oss config (`modeling_gpt_oss.py`), past the sizes.

    Every block is a mixture of experts: a biased router whose top-k logits are
    softmaxed (the renormalised top-k of the full softmax: `normalize_top_k`), experts of
    `intermediate_size` with biases and the clamped SwiGLU (`swiglu_limit`,
    `swiglu_alpha`); attention with sinks, q/k/v/o biases where `attention_bias` (the
    default), a window of `sliding_window` keys on the blocks `layer_types` calls
    "sliding_attention" (default: the even ones). Training-time dropout is refused
    (shardfuse trains what it loads).
    """
    layers = config["num_hidden_layers"]
    types = config.get("layer_types") or [_LAYER_TYPES[i % 2] for i in range(layers)]
    if len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(
            f"config.json: layer_types={config.get('layer_types')!r} must list "
            f"num_hidden_layers={layers} of {_LAYER_TYPES}"
        )
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    window = config.get("sliding_window", GPT_OSS_DEFAULTS["sliding_window"])
    if sliding and not window:
        raise ValueError(
            f"config.json: sliding_window={window!r} with sliding layers {list(sliding)} "
            "(layer_types): a sliding layer needs a window"
        )
    if config.get("attention_dropout"):
        raise ValueError(
            f"config.json: attention_dropout={config['attention_dropout']} is not supported "
            "(training-time dropout on the attention weights); set it to 0.0"
        )
    get = lambda field: config.get(field, GPT_OSS_DEFAULTS[field])  # noqa: E731
    experts, top_k = get("num_local_experts"), get("num_experts_per_tok")
    return dict(
        window=int(window) if sliding else None,
        window_layers=None if len(sliding) in (0, layers) else sliding,
        attention_bias=bool(get("attention_bias")),
        attention_sinks=True,
        activation="swiglu_clamped",
        swiglu_limit=float(get("swiglu_limit")),
        swiglu_alpha=float(get("swiglu_alpha")),
        experts=int(experts),
        top_k=int(top_k),
        expert_hidden=config["intermediate_size"],
        normalize_top_k=True,
        expert_bias=True,
    )


def spec_from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """The `ModelSpec` of a Hugging Face `config.json` (a dict) of a family in `ARCHITECTURES`.

    Llama, Mistral, Qwen2 (dense) and Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss
    (mixtures of experts, `_moe_fields`, `_gpt_oss_fields`; Qwen3-MoE's per-head q/k
    RMSNorm is `qk_norm="head"`, OLMoE's over the whole q and k projections
    `qk_norm="flat"` with its `clip_qkv`). RoPE: default, Llama 3.1's "llama3" and
    "yarn" (`_rope_scaling`), for every family.

    Raises:
      ValueError: an unknown `model_type`, or a field with a value shardfuse does not
        compute (named), e.g. `hidden_act="gelu"` on a Llama, `mlp_bias=True`,
        `attention_bias=True` on Llama, Qwen3-MoE or OLMoE (an `o_proj` bias), a RoPE
        type other than "default", "llama3" or "yarn", a `partial_rotary_factor`,
        sliding windows on some layers (Qwen), Mixtral's `router_jitter_noise > 0`,
        gpt-oss's `attention_dropout > 0`, a `quantization_config` other than gpt-oss's
        MXFP4.

    Example:
      >>> from shardfuse.models import hf
      >>> spec = hf.spec_from_hf_config(dict(model_type="llama", hidden_size=64,
      ...     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
      ...     num_hidden_layers=2, vocab_size=100))
      >>> spec.kv_heads, spec.head_dim
      (2, 16)
    """
    kind = config.get("model_type")
    if kind in NOT_SUPPORTED:
        raise ValueError(
            f"config.json: model_type={kind!r} is not supported: shardfuse does not compute "
            f"its {NOT_SUPPORTED[kind]}"
        )
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"config.json: model_type={kind!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    for field in ("hidden_size", "intermediate_size", "num_attention_heads",
                  "num_hidden_layers", "vocab_size"):  # fmt: skip
        if field not in config:
            raise ValueError(f"config.json: the required field {field!r} is missing")
    act = config.get("hidden_act", "silu")
    if act not in _ACTIVATIONS and kind != "gpt_oss":  # (gpt-oss's experts do not read it)
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; supported: silu")
    if kind == "llama" and config.get("mlp_bias"):  # Mistral's and Qwen2's MLPs ignore it
        raise ValueError("config.json: mlp_bias=True is not supported (biases in the MLP)")
    if config.get("quantization_config"):
        _check_quantization(config["quantization_config"], kind)
    if kind == "gpt_oss":  # GptOssConfig's defaults for what config.json omits
        omitted = ("rope_scaling", "rope_parameters")
        defaults = {k: v for k, v in GPT_OSS_DEFAULTS.items() if k not in omitted}
        if not (config.get("rope_scaling") or config.get("rope_parameters")):
            defaults["rope_parameters"] = GPT_OSS_DEFAULTS["rope_parameters"]
        config = {**defaults, **config}
    default_theta = GPT_OSS_DEFAULTS["rope_theta"] if kind == "gpt_oss" else 10000.0
    rope = _rope_parameters(config, default_theta)
    scaling = _rope_scaling(config, rope)
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    window = None
    if kind == "mistral":  # 4096 where config.json has no such key (MistralConfig's default)
        window = int(config.get("sliding_window", 4096) or 0) or None
    if kind == "mixtral":  # no window where config.json has none (MixtralConfig's default)
        window = int(config.get("sliding_window") or 0) or None
    if kind == "qwen2" and config.get("use_sliding_window") and config.get("sliding_window"):
        # Qwen2 slides on layers max_window_layers.. (or where layer_types says so).
        layers = config["num_hidden_layers"]
        types = config.get("layer_types") or [
            "sliding_attention" if i >= config.get("max_window_layers", 28) else "full_attention"
            for i in range(layers)
        ]
        if "sliding_attention" in types:
            raise ValueError(
                "config.json: use_sliding_window=True (Qwen2) with sliding layers is not "
                "supported (a window on some layers only)"
            )
    if kind == "qwen3_moe" and config.get("use_sliding_window"):  # every layer slides
        window = int(config.get("sliding_window") or 0) or None
    if kind == "qwen2_moe" and config.get("use_sliding_window"):
        if config.get("sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
            raise ValueError(
                f"config.json: use_sliding_window=True ({kind}) is not supported (a window on "
                "some layers only)"
            )
    # q/k/v biases: always on Qwen2, never on Mistral; Llama's `attention_bias` puts a
    # bias on o_proj too, which the spec cannot hold (transformers' modeling files).
    if kind in ("llama", "qwen3_moe", "olmoe") and config.get("attention_bias"):
        raise ValueError(
            f"config.json: attention_bias=True ({kind}: biases on q, k, v and o_proj) is not "
            "supported; q, k and v biases alone are model_type='qwen2'"
        )
    # Qwen2-MoE: `qkv_bias` (transformers 5; True where an older config.json lacks it)
    qkv_bias = kind == "qwen2" or (kind == "qwen2_moe" and bool(config.get("qkv_bias", True)))
    qk_norm = {"qwen3_moe": "head", "olmoe": "flat"}.get(kind)
    if kind == "olmoe" and head_dim * heads != hidden:
        raise ValueError(
            f"config.json: head_dim={head_dim} with num_attention_heads={heads} and "
            f"hidden_size={hidden}: OLMoE's q/k norms are hidden_size wide (head_dim must be "
            "hidden_size / num_attention_heads)"
        )
    clip = config.get("clip_qkv") if kind == "olmoe" else None
    fields = dict(window=window, activation="swiglu", qkv_bias=qkv_bias, qk_norm=qk_norm,
                  clip_qkv=None if clip is None else float(clip))  # fmt: skip
    if kind == "gpt_oss":
        fields.update(_gpt_oss_fields(config))
    elif kind in MOE_FAMILIES:
        fields.update(_moe_fields(config, kind))
    return ModelSpec(
        name,
        hidden=hidden,
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm="rmsnorm",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=scaling,
        max_positions=config.get("max_position_embeddings"),
        **fields,
    )


def hf_config(spec: ModelSpec, *, model_type: str = "llama", dtype: str = "float32") -> dict:
    """The `config.json` (a dict) under which `transformers` builds `spec`'s model.

    Mixtures of experts: `mixtral` (every block routed, renormalised top-k, no shared
    expert), `qwen2_moe` (one sigmoid-gated shared expert; sparse blocks written as
    `decoder_sparse_step` and `mlp_only_layers`), `qwen3_moe` (per-head q/k norms),
    `olmoe` (flat q/k norms, `clip_qkv`; every block routed), `gpt_oss` (every block
    routed with biased router and experts and the clamped SwiGLU; attention sinks, q/k/v/o
    biases where `attention_bias`, the window on `window_layers` written as `layer_types`).

    Raises:
      ValueError: `model_type` unknown, or `spec` uses an option the family lacks
        (GELU, LayerNorm, learned positions, biases outside q/k/v, softcap, a window
        outside mistral/mixtral/qwen3_moe, experts in a dense family or none in a MoE
        one, the family's MoE rules: the field is named).

    Example:
      >>> from shardfuse.models import hf
      >>> spec = hf.spec_from_hf_config(dict(model_type="qwen2", hidden_size=64,
      ...     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
      ...     num_hidden_layers=2, vocab_size=100))
      >>> hf.hf_config(spec, model_type="qwen2")["architectures"]
      ['Qwen2ForCausalLM']
    """
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type={model_type!r} is not one of {sorted(ARCHITECTURES)}")
    gpt_oss = model_type == "gpt_oss"
    unsupported = dict(
        activation=(spec.activation, "swiglu_clamped" if gpt_oss else "swiglu"),
        norm=(spec.norm, "rmsnorm"),
        positions=(spec.positions, "rope"),
        use_bias=(spec.use_bias, False),
        logit_softcap=(spec.logit_softcap, None),
    )
    for field, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ValueError(
                f"spec.{field}={value!r} cannot be written as a {model_type} checkpoint "
                f"(which needs {wanted!r})"
            )
    _check_family(spec, model_type)
    rope = {"rope_theta": spec.rope_theta, "rope_type": "default"}
    if spec.rope_scaling is not None:
        kind, params = rope_scaling_parameters(spec.rope_scaling)
        params["original_max_position_embeddings"] = params.pop("original_max_positions")
        rope.update(rope_type=kind, **params)
    config = dict(
        architectures=[ARCHITECTURES[model_type]],
        model_type=model_type,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn_hidden,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        num_hidden_layers=spec.num_layers,
        vocab_size=spec.vocab_size,
        hidden_act="silu",
        rms_norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta,
        rope_parameters=rope,
        rope_scaling=rope,
        tie_word_embeddings=spec.tied_embeddings,
        max_position_embeddings=spec.max_positions or 4096,
        dtype=dtype,
        torch_dtype=dtype,
    )
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if model_type in ("mistral", "mixtral"):
        config.update(sliding_window=spec.window)
    if model_type == "qwen2":
        config.update(sliding_window=None, use_sliding_window=False)
    if model_type in MOE_FAMILIES:
        config.update(num_experts_per_tok=spec.top_k, router_jitter_noise=0.0,
                      output_router_logits=False)  # fmt: skip
        experts = "num_local_experts" if model_type in ("mixtral", "gpt_oss") else "num_experts"
        config[experts] = spec.experts
    if model_type in ("qwen2_moe", "qwen3_moe"):
        dense = [i for i in range(spec.num_layers)
                 if not spec.is_moe_layer(i) and (i + 1) % spec.moe_every == 0]  # fmt: skip
        config.update(moe_intermediate_size=spec.expert_ffn_hidden,
                      norm_topk_prob=spec.normalize_top_k, decoder_sparse_step=spec.moe_every,
                      mlp_only_layers=dense)  # fmt: skip
    if model_type == "qwen2_moe":
        config.update(shared_expert_intermediate_size=spec.shared_expert_ffn_hidden,
                      qkv_bias=spec.qkv_bias, sliding_window=None,
                      use_sliding_window=False)  # fmt: skip
    if model_type == "qwen3_moe":
        config.update(attention_bias=False, sliding_window=spec.window,
                      use_sliding_window=spec.window is not None)  # fmt: skip
    if model_type == "olmoe":
        config.update(attention_bias=False, clip_qkv=spec.clip_qkv,
                      norm_topk_prob=spec.normalize_top_k)  # fmt: skip
    if gpt_oss:
        del config["router_jitter_noise"]
        types = [_LAYER_TYPES[spec.layer_window(i) is None] for i in range(spec.num_layers)]
        config.update(intermediate_size=spec.expert_ffn_hidden, sliding_window=spec.window,
                      layer_types=types, attention_bias=spec.attention_bias,
                      swiglu_limit=spec.swiglu_limit, swiglu_alpha=spec.swiglu_alpha,
                      attention_dropout=0.0)  # fmt: skip
    return config


def _check_family(spec: ModelSpec, model_type: str):
    """ValueError naming the first field of `spec` that `model_type`'s checkpoints cannot hold."""
    moe = model_type in MOE_FAMILIES
    windows = ("mistral", "mixtral", "qwen3_moe", "gpt_oss")
    if spec.window is not None and model_type not in windows:
        raise ValueError(f"spec.window={spec.window} needs a model_type of {windows}")
    if spec.window_layers is not None and model_type != "gpt_oss":
        raise ValueError(
            f"spec.window_layers={spec.window_layers} (a window on some blocks only) needs "
            "model_type='gpt_oss'"
        )
    gpt_oss = model_type == "gpt_oss"
    for field in ("attention_sinks", "expert_bias"):
        if getattr(spec, field) != gpt_oss:
            raise ValueError(
                f"spec.{field}={getattr(spec, field)!r} cannot be written as a {model_type} "
                f"checkpoint (which needs {gpt_oss!r}; gpt_oss has them)"
            )
    if spec.attention_bias and not gpt_oss:
        raise ValueError(
            f"spec.attention_bias=True (q, k, v and o biases) cannot be written as a "
            f"{model_type} checkpoint; model_type='gpt_oss' holds them"
        )
    if spec.clip_qkv is not None and model_type != "olmoe":
        raise ValueError(f"spec.clip_qkv={spec.clip_qkv} needs model_type='olmoe'")
    qk_norm = {"qwen3_moe": "head", "olmoe": "flat"}.get(model_type)
    if spec.qk_norm != qk_norm:
        raise ValueError(
            f"spec.qk_norm={spec.qk_norm!r} cannot be written as a {model_type} checkpoint "
            f"(which needs {qk_norm!r})"
        )
    if spec.qkv_bias and model_type not in ("qwen2", "qwen2_moe"):
        raise ValueError(
            f"spec.qkv_bias=True cannot be written as a {model_type} checkpoint: q/k/v biases "
            "are model_type 'qwen2' or 'qwen2_moe'"
        )
    if model_type == "qwen2" and not spec.qkv_bias:
        raise ValueError("a qwen2 checkpoint has q/k/v biases: spec.qkv_bias must be True")
    if not moe:
        if spec.is_moe:
            raise ValueError(
                f"spec.experts={spec.experts} (a mixture of experts) cannot be written as a "
                f"{model_type} checkpoint; use one of {list(MOE_FAMILIES)}"
            )
        return
    if not spec.is_moe:
        raise ValueError(f"spec.experts=0 (dense) cannot be written as a {model_type} checkpoint")
    every_block = all(spec.is_moe_layer(i) for i in range(spec.num_layers))
    moe_need = dict(
        routing=(spec.routing, "softmax"),
        expert_groups=(spec.expert_groups, 1),
        routed_scaling=(spec.routed_scaling, 1.0),
        shared_experts=(spec.shared_experts, 1 if model_type == "qwen2_moe" else 0),
    )
    if model_type == "qwen2_moe":
        moe_need["shared_expert_gate"] = (spec.shared_expert_gate, True)
    if model_type == "mixtral":
        moe_need["normalize_top_k"] = (spec.normalize_top_k, True)
    if model_type == "gpt_oss":
        moe_need["normalize_top_k"] = (spec.normalize_top_k, True)
    if model_type in ("mixtral", "olmoe", "gpt_oss"):  # one expert width: intermediate_size
        moe_need["expert_hidden"] = (spec.expert_ffn_hidden, spec.ffn_hidden)
        moe_need["moe_layers (every block)"] = (every_block, True)
        if model_type == "olmoe":
            moe_need["head_dim"] = (spec.head_dim * spec.heads, spec.hidden)
    for field, (value, wanted) in moe_need.items():
        if value != wanted:
            raise ValueError(
                f"spec.{field}={value!r} cannot be written as a {model_type} checkpoint "
                f"(which needs {wanted!r})"
            )


def read_hf_spec(path, *, argument: str = "path") -> ModelSpec:
    """The `ModelSpec` of the checkpoint directory `path` (its `config.json`), named after it.

    Raises:
      ValueError: `path` has no `config.json` (the message names `argument`), or a
        field `spec_from_hf_config` refuses.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{argument}={str(path)!r} is not a Hugging Face checkpoint directory (no config.json)"
        )
    return spec_from_hf_config(json.loads(config_file.read_text()), name=path.name or "hf")
