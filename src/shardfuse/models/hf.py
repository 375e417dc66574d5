"""Hugging Face checkpoints in and out: Llama, Mistral and Qwen2 on any mesh.

    config.json            <->  `ModelSpec`        (`spec_from_hf_config`, `hf_config`)
    *.safetensors (+index) <->  `Transformer` state (`load_hf`, `save_hf`)

Loading reads lazily: the model is built abstractly (`nnx.eval_shape`), and
each parameter is made with `jax.make_array_from_callback`, whose callback
reads from the safetensors files only the rows and columns of the slice one
device holds (the files are memory-mapped; nothing else is read). No host
materialises a whole parameter unless a device of it holds the whole
parameter, and no host ever holds the whole model.

Layout (Hugging Face `nn.Linear` weights are `[out, in]`; ours are `[in, out]`
kernels, the layers stacked along a leading axis):

    q_proj [H*D, F]             -> attention.q_kernel  [L, F, H*D]       transposed
    k_proj, v_proj [K*D, F]     -> attention.kv_kernel [L, F, K*2*D]     per kv head: k then v
    o_proj [F, H*D]             -> attention.o_kernel  [L, H*D, F]
    gate_proj, up_proj [I, F]   -> mlp.up.kernel       [L, F, 2*I]       per unit: gate then up
    down_proj [F, I]            -> mlp.down.kernel     [L, I, F]
    input/post_attention_layernorm -> norm_1 / norm_2 scale
    embed_tokens [V, F]         -> embed [V, F];  lm_head [V, F] -> unembed [F, V] (untied)

Both use the rotate-half RoPE convention, so q and k need no permutation.
"""

import dataclasses
import json
import math
import re
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from shardfuse.model_spec import ModelSpec
from shardfuse.models.safetensors import SafetensorsDir, write_safetensors
from shardfuse.models.transformer import Transformer

# --- config.json <-> ModelSpec ---------------------------------------------------------

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


# --- our parameters <-> their tensors ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Map:
    """How one of our parameters is made of checkpoint tensors.

    kind "copy": the same array; "t": the transpose of a 2-D weight; "pair": two
    tensors interleaved in groups of `group` rows (k and v per head: group D; gate
    and up per unit: group 1), then transposed when 2-D. `stacked`: one tensor per
    layer (`{layer}` in the names), stacked along our leading axis.
    """

    names: tuple
    kind: str
    stacked: bool = False
    group: int = 1


_LAYER = "model.layers.{layer}."


def _map_of(path: tuple, spec) -> _Map:
    """The `_Map` of our parameter at `path` (ValueError for a parameter HF has no name for)."""
    D = spec.head_dim
    layer = {
        ("attention", "q_kernel"): ("self_attn.q_proj.weight",),
        ("attention", "kv_kernel"): ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        ("attention", "o_kernel"): ("self_attn.o_proj.weight",),
        ("attention", "q_bias"): ("self_attn.q_proj.bias",),
        ("attention", "kv_bias"): ("self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        ("up", "kernel"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        ("down", "kernel"): ("mlp.down_proj.weight",),
        ("norm_1", "scale"): ("input_layernorm.weight",),
        ("norm_2", "scale"): ("post_attention_layernorm.weight",),
    }
    key = tuple(path[-2:])
    if key in layer:
        names = tuple(_LAYER + n for n in layer[key])
        if len(names) == 2:
            return _Map(names, "pair", stacked=True, group=D if key[0] == "attention" else 1)
        return _Map(names, "copy" if key[1] in ("q_bias", "scale") else "t", stacked=True)
    if path[-1] == "embed":
        return _Map(("model.embed_tokens.weight",), "copy")
    if key == ("norm", "scale"):
        return _Map(("model.norm.weight",), "copy")
    if key == ("unembed", "kernel"):
        return _Map(("lm_head.weight",), "t")
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no Hugging Face counterpart")


def _bounds(index, shape):
    """Slices of `index` (padded to `shape`) as `(start, stop)` pairs."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided slice {s} is not supported")
        out.append((start, stop))
    return out


def _read_one(source, m: _Map, layer, bounds):
    """Our (unstacked) parameter's block at `bounds` from the tensors of layer `layer`."""
    names = [n.format(layer=layer) for n in m.names]
    if m.kind == "copy":
        return source.read(names[0], tuple(slice(a, b) for a, b in bounds))
    if m.kind == "t":
        (r0, r1), (c0, c1) = bounds
        return source.read(names[0], (slice(c0, c1), slice(r0, r1))).T
    # "pair": our columns (last axis) interleave the two tensors' rows in groups
    (c0, c1) = bounds[-1]
    step = 2 * m.group
    g0, g1 = c0 // step, -(-c1 // step)
    rows = (slice(g0 * m.group, g1 * m.group),)
    if len(bounds) == 2:  # a kernel [F, C]: the tensors are [rows, F]
        rows = rows + (slice(*bounds[0]),)
    a, b = (source.read(n, rows) for n in names)
    both = np.stack([a.reshape(g1 - g0, m.group, *a.shape[1:]),
                     b.reshape(g1 - g0, m.group, *b.shape[1:])], axis=1)  # fmt: skip
    both = both.reshape((g1 - g0) * step, *a.shape[1:])[c0 - g0 * step : c1 - g0 * step]
    return both.T if both.ndim == 2 else both


def _read(source, m: _Map, shape, index, dtype):
    bounds = _bounds(index, shape)
    if not m.stacked:
        block = _read_one(source, m, None, bounds)
    else:
        (l0, l1), rest = bounds[0], bounds[1:]
        block = np.stack([_read_one(source, m, layer, rest) for layer in range(l0, l1)])
    return block.astype(dtype)


def _check_shapes(source, m: _Map, shape, path):
    """ValueError unless the checkpoint's tensors have the sizes our parameter needs."""
    layers = range(shape[0]) if m.stacked else [None]
    per_layer = shape[1:] if m.stacked else shape
    for layer in layers:
        got = [source.info(n.format(layer=layer))[0] for n in m.names]
        if m.kind == "copy":
            want = [tuple(per_layer)]
        elif m.kind == "t":
            want = [tuple(per_layer[::-1])]
        else:
            rows = per_layer[-1] // 2
            want = [(rows, *per_layer[:-1])] * 2
        if got != want:
            raise ValueError(
                f"checkpoint tensors {[n.format(layer=layer) for n in m.names]} have shapes {got}; "
                f"parameter {'.'.join(map(str, path))} {tuple(shape)} needs {want}"
            )


# Tensors a checkpoint may hold that are not parameters (older transformers saved RoPE's
# buffer) or that repeat one (a tied lm_head).
_NOT_PARAMETERS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _check_all_used(source, maps, state, spec):
    """ValueError naming the checkpoint's tensors that no parameter reads.

    A tensor left unread is a part of the model we would silently drop (a bias the
    spec has no place for, an unknown layer): refuse instead of computing another model.
    """
    shapes = {p: v.get_raw_value().shape for p, v in _params(state)}
    used = set()
    for p, m in maps.items():
        layers = range(shapes[p][0]) if m.stacked else [None]
        used.update(n.format(layer=layer) for n in m.names for layer in layers)
    unused = [n for n in source.names() if n not in used and not _NOT_PARAMETERS.search(n)]
    if spec.tied_embeddings and "lm_head.weight" in unused:
        _check_tied_head(source)
        unused.remove("lm_head.weight")
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ValueError(
            f"the checkpoint holds tensors that model {spec.name!r} has no parameter for: "
            f"{shown}; loading without them would compute another model"
        )


def _check_tied_head(source, rows_per_read: int = 4096):
    """ValueError where config.json ties the embeddings but the checkpoint's `lm_head.weight`
    is not `embed_tokens.weight`: transformers then keeps the head untied (its
    `tie_weights` warns), so tying it would compute another model. Read in row blocks."""
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    shape = source.info(head)[0]
    same = shape == source.info(embed)[0]
    for start in range(0, shape[0] if same else 0, rows_per_read):
        block = (slice(start, start + rows_per_read),)
        if not np.array_equal(source.read(head, block), source.read(embed, block)):
            same = False
            break
    if not same:
        raise ValueError(
            "config.json has tie_word_embeddings=true, but the checkpoint's lm_head.weight "
            "differs from model.embed_tokens.weight (transformers uses it untied): set "
            "tie_word_embeddings to false in config.json to load the head it holds"
        )


def _params(state):
    """`(path, variable)` of every `nnx.Param` of a split state."""
    return [(p, v) for p, v in nnx.to_flat_state(state) if isinstance(v, nnx.Param)]


def load_hf(path, *, mesh, pipelined: bool = False, param_dtype=np.float32, **model_options):
    """A `models.Transformer` on `mesh` holding the Hugging Face checkpoint in `path`.

    Reads `config.json` (`spec_from_hf_config`) and the safetensors files, each device's
    slices only (see the module docstring). Works on every mesh the model does:
    data, fsdp (ZeRO-3 via `zero=3`), sequence, model, pipeline (`pipelined=True`).

    Args:
      path: a checkpoint directory (`config.json`, `model.safetensors` or
        `model.safetensors.index.json` with its shards).
      mesh: the mesh.
      pipelined: stack the layers over the `pipeline` axis.
      param_dtype: storage dtype of the parameters (float32 default).
      **model_options: layer options of `models.Transformer` (zero=, remat=, ...).

    Returns:
      the model (its `spec` attribute holds the `ModelSpec`).

    Raises:
      ValueError: an unknown architecture or unsupported config field (named), a missing
        shard file or tensor, tensors of the wrong shape, a tensor no parameter reads
        (named), a mesh that does not divide the heads (raised by the layers, before
        anything is read).

    Example:
      >>> import jax, tempfile
      >>> from flax import nnx
      >>> from shardfuse.models import ModelSpec, Transformer, hf
      >>> mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
      >>> model = Transformer(ModelSpec.tiny(num_layers=1), mesh=mesh, rngs=nnx.Rngs(0))
      >>> path = hf.save_hf(model, tempfile.mkdtemp())
      >>> hf.load_hf(path, mesh=mesh).spec.num_layers
      1
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise ValueError(f"no config.json in {str(path)!r}")
    spec = spec_from_hf_config(json.loads(config_file.read_text()), name=path.name or "hf")
    source = SafetensorsDir(path)

    def build():
        return Transformer(spec, mesh=mesh, pipelined=pipelined, rngs=nnx.Rngs(0),
                           **model_options)  # fmt: skip

    graphdef, state = nnx.split(nnx.eval_shape(build))
    maps = {}
    for p, variable in _params(state):
        m = _map_of(p, spec)
        _check_shapes(source, m, variable.get_raw_value().shape, p)
        maps[p] = m
    _check_all_used(source, maps, state, spec)
    for p, variable in _params(state):
        abstract = variable.get_raw_value()
        sharding = NamedSharding(mesh, abstract.sharding.spec)
        m, shape = maps[p], abstract.shape
        slices = {}  # one read per distinct slice (replicas on this process share it)

        def callback(index, m=m, shape=shape, slices=slices):
            key = tuple(_bounds(index, shape))
            if key not in slices:
                slices[key] = _read(source, m, shape, index, param_dtype)
            return slices[key]

        value = jax.make_array_from_callback(shape, sharding, callback)
        variable.set_raw_value(value)
    return nnx.merge(graphdef, state)


def _full(array, layer=None):
    """One layer (or all) of a global array as numpy on this host (gathered across hosts)."""
    part = array if layer is None else array[layer]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(part, tiled=True))
    return np.asarray(jax.device_get(part))


def _split(m: _Map, ours):
    """The checkpoint tensors of one (unstacked) block of ours: inverse of `_read_one`."""
    if m.kind == "copy":
        return [ours]
    if m.kind == "t":
        return [ours.T]
    rows = ours.T if ours.ndim == 2 else ours  # [C, F] or [C]
    step = 2 * m.group
    both = rows.reshape(rows.shape[0] // step, 2, m.group, *rows.shape[1:])
    return [both[:, i].reshape(-1, *rows.shape[1:]) for i in (0, 1)]


def save_hf(model, path, *, model_type: str | None = None, dtype=None,
            max_shard_bytes: int = 4 << 30):  # fmt: skip
    """Writes `model` (a `models.Transformer`) as a Hugging Face checkpoint directory.

    `config.json` (`hf_config`), `model.safetensors` or shards
    `model-0000i-of-0000n.safetensors` of at most `max_shard_bytes` with their index.
    Shard files are dealt round-robin to the processes; each process writes its own
    (the arrays are gathered one layer of one parameter at a time). A round trip
    `load_hf(save_hf(model))` is bitwise for float32 parameters.

    Args:
      model: the model; its `spec` says the sizes.
      path: a directory (created; existing files of the same names are replaced).
      model_type: "llama", "mistral" or "qwen2"; default: qwen2 with q/k/v biases,
        mistral with a sliding window, else llama.
      dtype: numpy dtype of the tensors (default: the parameters' own).
      max_shard_bytes: the largest shard file.

    Raises:
      ValueError: the spec cannot be expressed in that family (named), before anything
        is written.

    Example:
      >>> save_hf(model, "/tmp/out")                             # doctest: +SKIP
    """
    spec = model.spec
    if model_type is None:
        model_type = "qwen2" if spec.qkv_bias else "mistral" if spec.window else "llama"
    state = nnx.state(model, nnx.Param)
    entries = []  # (name, shape, dtype, producer)
    params = _params(state)
    first_dtype = None
    for p, variable in params:
        m = _map_of(p, spec)
        value = variable.get_raw_value()
        first_dtype = first_dtype or value.dtype
        out_dtype = np.dtype(dtype or value.dtype)
        layers = range(value.shape[0]) if m.stacked else [None]
        for layer in layers:
            per = value.shape[1:] if m.stacked else value.shape
            shapes = [tuple(s.shape) for s in _split(m, np.empty(per, np.uint8))]
            for i, (name, shape) in enumerate(zip(m.names, shapes, strict=True)):
                entries.append((name.format(layer=layer), shape, out_dtype, (value, m, layer, i)))
    config = hf_config(spec, model_type=model_type,
                       dtype=str(np.dtype(dtype or first_dtype)))  # fmt: skip
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    files, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    count = len(files)
    names = (["model.safetensors"] if count == 1 else
             [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)])  # fmt: skip
    me, processes = jax.process_index(), jax.process_count()
    cache = {}
    for i, (file, group) in enumerate(zip(names, files, strict=True)):
        tensors = {}
        for name, _, out_dtype, (value, m, layer, part) in group:
            key = (id(value), layer)
            if key not in cache:  # every process gathers (a collective across hosts)
                cache.clear()
                cache[key] = _split(m, _full(value, layer))
            if i % processes == me:
                tensors[name] = np.ascontiguousarray(cache[key][part]).astype(out_dtype)
        if i % processes == me:
            write_safetensors(path / file, tensors, metadata={"format": "pt"})
    if me == 0:
        (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        index = path / "model.safetensors.index.json"
        if count > 1:
            weight_map = {e[0]: f for f, group in zip(names, files, strict=True) for e in group}
            total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
            index.write_text(json.dumps({"metadata": {"total_size": total},
                                         "weight_map": weight_map}, indent=2))  # fmt: skip
        elif index.exists():
            index.unlink()
    return path
