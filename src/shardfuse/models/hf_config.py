"""Hugging Face `config.json` <-> `ModelSpec`: Llama, Mistral and Qwen2 architectures.

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


def spec_from_hf_config(config: dict, name: str = "hf") -> ModelSpec:
    """The `ModelSpec` of a Hugging Face Llama, Mistral or Qwen2 `config.json` (a dict).

    Raises:
      ValueError: an unknown `model_type`, or a field with a value shardfuse does not
        compute (named), e.g. `hidden_act="gelu"` on a Llama, `mlp_bias=True`,
        Llama's `attention_bias=True` (an `o_proj` bias), a RoPE type other than
        "default" or "llama3".

    Example:
      >>> from shardfuse.models import hf
      >>> spec = hf.spec_from_hf_config(dict(model_type="llama", hidden_size=64,
      ...     intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
      ...     num_hidden_layers=2, vocab_size=100))
      >>> spec.kv_heads, spec.head_dim
      (2, 16)
    """
    kind = config.get("model_type")
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
    # q/k/v biases: always on Qwen2, never on Mistral; Llama's `attention_bias` puts a
    # bias on o_proj too, which the spec cannot hold (transformers' modeling files).
    if kind == "llama" and config.get("attention_bias"):
        raise ValueError(
            "config.json: attention_bias=True (Llama: biases on q, k, v and o_proj) is not "
            "supported; q, k and v biases alone are model_type='qwen2'"
        )
    qkv_bias = kind == "qwen2"
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
    )


def hf_config(spec: ModelSpec, *, model_type: str = "llama", dtype: str = "float32") -> dict:
    """The `config.json` (a dict) under which `transformers` builds `spec`'s model.

    Raises:
      ValueError: `model_type` unknown, or `spec` uses an option the family lacks
        (GELU, LayerNorm, learned positions, biases outside q/k/v, softcap).

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
    if spec.window is not None and model_type != "mistral":
        raise ValueError(f"spec.window={spec.window} needs model_type='mistral'")
    if spec.qkv_bias and model_type == "mistral":
        raise ValueError("spec.qkv_bias=True cannot be written as a mistral checkpoint")
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
        config.update(attention_bias=spec.qkv_bias, mlp_bias=False)
        if spec.qkv_bias:
            raise ValueError("spec.qkv_bias=True is written as model_type='qwen2', not 'llama'")
    if model_type == "mistral":
        config.update(sliding_window=spec.window)
    if model_type == "qwen2":
        if not spec.qkv_bias:
            raise ValueError("a qwen2 checkpoint has q/k/v biases: spec.qkv_bias must be True")
        config.update(sliding_window=None, use_sliding_window=False)
    return config


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
