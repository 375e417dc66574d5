"""Hugging Face `config.json` <-> `ModelSpec`: Llama, Mistral, Qwen2 and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

The config half of Hugging Face checkpoints (`shardfuse.models.hf` is the
tensor half, and re-exports these names): `spec_from_hf_config` maps a
`config.json` (a dict) to the `ModelSpec` it describes, refusing, by name,
any field whose value shardfuse does not compute; `hf_config` is the inverse
for a model family; `read_hf_spec` reads a checkpoint directory's
`config.json` (what `load_hf` and the trainer's `init_from` read).
"""

import json
from pathlib import Path

from shardfuse.model_spec import ModelSpec

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Families known and refused, with what shardfuse does not compute (named in the ValueError).
NOT_SUPPORTED = {
    "gpt_oss": "attention sinks (a learned per-head logit in every softmax), sliding "
    "windows on alternate layers, the router's bias with softmax over the top-k logits, "
    "expert biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit), o_proj biases",
}
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu"}


def _rope_parameters(config: dict) -> dict:
    """A config's RoPE fields: old (`rope_theta`, `rope_scaling`) or new (`rope_parameters`).

    As transformers reads them (`convert_rope_params_to_dict`): a non-empty
    `rope_scaling` replaces `rope_parameters` whole (transformers 5 writes a default
    `rope_parameters` into every config it saves, and model cards have users add a
    `rope_scaling` beside it), and `rope_theta` comes from the chosen dict, else the
    top-level field, else 10000.
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
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


def spec_from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """The `ModelSpec` of a Hugging Face `config.json` (a dict) of a family in `ARCHITECTURES`.

    Llama, Mistral, Qwen2 (dense) and Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE (mixtures of
    experts, `_moe_fields`; Qwen3-MoE's per-head q/k RMSNorm is `qk_norm="head"`,
    OLMoE's over the whole q and k projections `qk_norm="flat"` with its `clip_qkv`).

    Raises:
      ValueError: an unknown `model_type`, or a field with a value shardfuse does not
        compute (named), e.g. `hidden_act="gelu"` on a Llama, `mlp_bias=True`,
        `attention_bias=True` on Llama, Qwen3-MoE or OLMoE (an `o_proj` bias), a RoPE
        type other than "default" or "llama3", sliding windows on some layers (Qwen),
        Mixtral's `router_jitter_noise > 0`.

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
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json: hidden_act={act!r} is not supported; supported: silu")
    if kind == "llama" and config.get("mlp_bias"):  # Mistral's and Qwen2's MLPs ignore it
        raise ValueError("config.json: mlp_bias=True is not supported (biases in the MLP)")
    rope = _rope_parameters(config)
    if rope["rope_type"] not in ("default", "llama3"):
        raise ValueError(
            f"config.json: rope type {rope['rope_type']!r} is not supported; "
            "supported: 'default', 'llama3'"
        )
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
    scaling = None
    if rope["rope_type"] == "llama3":
        fields = (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        )
        if "max_position_embeddings" in config:  # transformers' default for it
            rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
        missing = [f for f in fields if f not in rope]
        if missing:
            raise ValueError(f"config.json: rope type 'llama3' needs {missing} in rope_parameters")
        scaling = (
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    return ModelSpec(
        name,
        hidden=hidden,
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        ffn_hidden=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        window=window,
        activation="swiglu",
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm="rmsnorm",
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        max_positions=config.get("max_position_embeddings"),
        qk_norm=qk_norm,
        clip_qkv=None if clip is None else float(clip),
        **(_moe_fields(config, kind) if kind in MOE_FAMILIES else {}),
    )


def hf_config(spec: ModelSpec, *, model_type: str = "llama", dtype: str = "float32") -> dict:
    """The `config.json` (a dict) under which `transformers` builds `spec`'s model.

    Mixtures of experts: `mixtral` (every block routed, renormalised top-k, no shared
    expert), `qwen2_moe` (one sigmoid-gated shared expert; sparse blocks written as
    `decoder_sparse_step` and `mlp_only_layers`), `qwen3_moe` (per-head q/k norms),
    `olmoe` (flat q/k norms, `clip_qkv`; every block routed).

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
    unsupported = dict(
        activation=(spec.activation, "swiglu"),
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
        factor, low, high, original = spec.rope_scaling
        rope.update(rope_type="llama3", factor=factor, low_freq_factor=low,
                    high_freq_factor=high, original_max_position_embeddings=original)  # fmt: skip
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
        config["num_local_experts" if model_type == "mixtral" else "num_experts"] = spec.experts
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
    return config


def _check_family(spec: ModelSpec, model_type: str):
    """ValueError naming the first field of `spec` that `model_type`'s checkpoints cannot hold."""
    moe = model_type in MOE_FAMILIES
    if spec.window is not None and model_type not in ("mistral", "mixtral", "qwen3_moe"):
        raise ValueError(
            f"spec.window={spec.window} needs model_type 'mistral', 'mixtral' or 'qwen3_moe'"
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
    if model_type in ("mixtral", "olmoe"):  # one expert width: intermediate_size
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
