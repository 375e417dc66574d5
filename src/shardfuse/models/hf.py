"""Hugging Face checkpoints in and out on any mesh: Llama, Mistral, Qwen2 and the
mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and gpt-oss.

    config.json            <->  `ModelSpec`        (`hf_config.py`: `spec_from_hf_config`,
                                                    `hf_config`, re-exported here)
    *.safetensors (+index) <->  `Transformer` state (this module: `load_hf`, `save_hf`)

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
    self_attn.q_norm, k_norm    -> attention.q_norm, k_norm  [L, D] (Qwen3-MoE, per head)
                                   or [L, H*D], [L, K*D] (OLMoE, over the projection)

Mixture-of-experts blocks (`mlp.` below; Mixtral: `block_sparse_moe.`, its experts'
w1, w3, w2 for gate_proj, up_proj, down_proj; E experts of I units):

    gate.weight [E, F]                       -> mlp.router   [L, F, E]        transposed
    experts.{e}.gate_proj, up_proj [I, F]    -> mlp.gate_up  [L, E, F, 2*I]   per unit: gate, up
    experts.{e}.down_proj [F, I]             -> mlp.down     [L, E, I, F]
    shared_expert.gate_proj, up_proj [S, F]  -> mlp.shared_up [L, F, 2*S]     (Qwen2-MoE)
    shared_expert.down_proj [F, S]           -> mlp.shared_down [L, S, F]
    shared_expert_gate.weight [1, F]         -> mlp.shared_gate [L, F, 1]

or, as transformers 5 holds them in memory, fused per layer: `mlp.experts.gate_up_proj`
`[E, 2*I, F]` (an expert's gate rows, then its up rows) and `mlp.experts.down_proj`
`[E, F, I]` (and Mixtral's router as `mlp.gate.weight`): `load_hf` reads either layout
(still each device's slice only: an expert's rows of the fused tensor); `save_hf`
writes the per-expert one, as transformers' `save_pretrained` does. A spec mixing dense
and MoE blocks (Qwen's `decoder_sparse_step`, `mlp_only_layers`) has a `Stack` per run
of blocks of one kind; their layers are numbered on from the run before.

gpt-oss (`gpt_oss`) holds a layer's experts in our layout already, biases beside them:
`mlp.router.weight [E, F]` -> `mlp.router` (transposed), `mlp.router.bias` ->
`mlp.router_bias`, `mlp.experts.gate_up_proj [E, F, 2I]` (gate and up interleaved per
unit) -> `mlp.gate_up`, `mlp.experts.down_proj [E, I, F]` -> `mlp.down`, their `_bias`
tensors -> `mlp.gate_up_bias`, `mlp.down_bias`; `self_attn.sinks [H]` ->
`attention.sinks`, `self_attn.o_proj.bias` -> `attention.o_bias`. The hub's MXFP4 experts
(`..._blocks`, `..._scales`) are read through the same names, dequantized
(`shardfuse.models.mxfp4`: each device reads its slice's packed bytes); `save_hf` writes
them dequantized.

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

from shardfuse.models import mxfp4
from shardfuse.models.block_runs import block_runs
from shardfuse.models.hf_config import (  # the config half (hf_config.py), re-exported
    ARCHITECTURES as ARCHITECTURES,
)
from shardfuse.models.hf_config import (
    hf_config as hf_config,
)
from shardfuse.models.hf_config import (
    read_hf_spec as read_hf_spec,
)
from shardfuse.models.hf_config import (
    spec_from_hf_config as spec_from_hf_config,
)
from shardfuse.models.hf_reads import TensorRead
from shardfuse.models.safetensors import SafetensorsDir, write_safetensors
from shardfuse.models.transformer import Transformer

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
    offset: int = 0  # the first layer's number (a run of blocks of one kind: `BlockRuns`)
    experts: bool = False  # one tensor per expert (`{expert}`), stacked along our next axis


_LAYER = "model.layers.{layer}."


def _layer_offset(path: tuple, spec) -> int:
    """The number of the first layer of the `Stack` holding `path` (`BlockRuns`' run i)."""
    if len(path) > 2 and path[:2] == ("blocks", "runs"):
        return sum(run.count for run in block_runs(spec)[: int(path[2])])
    return 0


def _moe_names(family: str) -> dict:
    """Our MoE parameter -> `(its checkpoint tensors (names under a layer), kind, one tensor
    per expert)` in `family` (`_Map`'s kinds)."""
    if family == "gpt_oss":  # every expert in one tensor per layer, laid out as ours
        return {
            "router": (("mlp.router.weight",), "t", False),
            "router_bias": (("mlp.router.bias",), "copy", False),
            "gate_up": (("mlp.experts.gate_up_proj",), "copy", False),  # [E, F, 2I] interleaved
            "gate_up_bias": (("mlp.experts.gate_up_proj_bias",), "copy", False),
            "down": (("mlp.experts.down_proj",), "copy", False),  # [E, I, F]
            "down_bias": (("mlp.experts.down_proj_bias",), "copy", False),
        }
    if family == "mixtral":  # the hub's names (what transformers 5's save_pretrained writes)
        moe, (gate, up, down) = "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        moe, (gate, up, down) = "mlp.", ("gate_proj", "up_proj", "down_proj")
    expert = moe + "experts.{expert}."
    return {
        "router": ((moe + "gate.weight",), "t", False),
        "gate_up": ((expert + gate + ".weight", expert + up + ".weight"), "pair", True),
        "down": ((expert + down + ".weight",), "t", True),
        "shared_up": (
            ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
            "pair",
            False,
        ),  # fmt: skip
        "shared_down": (("mlp.shared_expert.down_proj.weight",), "t", False),
        "shared_gate": (("mlp.shared_expert_gate.weight",), "t", False),
    }


def _map_of(path: tuple, spec, family: str = "llama") -> _Map:
    """The `_Map` of our parameter at `path` (ValueError for a parameter HF has no name for)."""
    D = spec.head_dim
    offset = _layer_offset(path, spec)
    if len(path) >= 2 and path[-2] == "mlp" and path[-1] in _moe_names(family):
        names, kind, experts = _moe_names(family)[path[-1]]
        names = tuple(_LAYER + n for n in names)
        return _Map(names, kind, stacked=True, offset=offset, experts=experts)
    layer = {
        ("attention", "q_kernel"): ("self_attn.q_proj.weight",),
        ("attention", "kv_kernel"): ("self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        ("attention", "o_kernel"): ("self_attn.o_proj.weight",),
        ("attention", "q_bias"): ("self_attn.q_proj.bias",),
        ("attention", "kv_bias"): ("self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        ("attention", "o_bias"): ("self_attn.o_proj.bias",),
        ("attention", "sinks"): ("self_attn.sinks",),
        ("up", "kernel"): ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        ("down", "kernel"): ("mlp.down_proj.weight",),
        ("norm_1", "scale"): ("input_layernorm.weight",),
        ("norm_2", "scale"): ("post_attention_layernorm.weight",),
        ("attention", "q_norm"): ("self_attn.q_norm.weight",),
        ("attention", "k_norm"): ("self_attn.k_norm.weight",),
    }
    key = tuple(path[-2:])
    if key in layer:
        names = tuple(_LAYER + n for n in layer[key])
        if len(names) == 2:
            group = D if key[0] == "attention" else 1
            return _Map(names, "pair", stacked=True, group=group, offset=offset)
        copy = key[1] in ("q_bias", "o_bias", "sinks", "scale", "q_norm", "k_norm")
        return _Map(names, "copy" if copy else "t", stacked=True, offset=offset)
    if path[-1] == "embed":
        return _Map(("model.embed_tokens.weight",), "copy")
    if key == ("norm", "scale"):
        return _Map(("model.norm.weight",), "copy")
    if key == ("unembed", "kernel"):
        return _Map(("lm_head.weight",), "t")
    raise ValueError(f"parameter {'.'.join(map(str, path))} has no Hugging Face counterpart")


_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_HALF = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}  # gate rows first, then up


class _Checkpoint:
    """A `SafetensorsDir` read under the per-expert names (`experts.{e}.gate_proj.weight`,
    Mixtral's `block_sparse_moe.experts.{e}.w1.weight`), whichever expert layout it holds.

    Transformers 5 holds a layer's experts fused in memory, `mlp.experts.gate_up_proj`
    `[E, 2I, F]` (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
    `[E, F, I]` (Mixtral's router as `mlp.gate.weight`); a checkpoint saved in that layout
    is read through this view: expert e's `[rows, cols]` block of a per-expert name is
    the block `[e, offset + rows, cols]` of the fused tensor (only those bytes are read).
    """

    def __init__(self, source: SafetensorsDir):
        self.source = source
        self._stored = set(source.names())

    @property
    def on_read(self):
        return self.source.on_read

    @on_read.setter
    def on_read(self, value):
        self.source.on_read = value

    def names(self):
        return self.source.names()

    def _mxfp4(self, name):
        """`(blocks, scales)`: the stored tensors holding `name` in MXFP4 (gpt-oss's
        `mlp.experts.gate_up_proj` as `..._blocks` and `..._scales`), or None."""
        pair = tuple(name + suffix for suffix in mxfp4.SUFFIXES)
        return pair if name not in self._stored and all(p in self._stored for p in pair) else None

    def _resolve(self, name):
        """`(stored tensor, expert or None, row offset)` holding the tensor `name`."""
        if name in self._stored:
            return name, None, 0
        if name.endswith(".block_sparse_moe.gate.weight"):
            fused = name.replace(".block_sparse_moe.", ".mlp.")
            return (fused if fused in self._stored else name), None, 0
        match = _EXPERT.match(name)
        if match:
            layer, expert, weight = match.groups()
            fused = f"{layer}.mlp.experts." + ("down_proj" if weight in ("down_proj", "w2")
                                               else "gate_up_proj")  # fmt: skip
            if fused in self._stored:
                rows = self.source.info(fused)[0][1] // 2 if weight in _HALF else 0
                return fused, int(expert), _HALF.get(weight, 0) * rows
        return name, None, 0  # not stored: `info` names it

    def stored_names(self, name):
        """The stored tensors that hold `name`."""
        return self._mxfp4(name) or (self._resolve(name)[0],)

    def info(self, name):
        if self._mxfp4(name):  # [E, rows, groups, 16] -> dequantized, ours: [E, in, out]
            (experts, rows, groups, _), _ = self.source.info(self._mxfp4(name)[0])
            return (experts, groups * mxfp4.GROUP, rows), np.dtype(np.float32)
        stored, expert, _ = self._resolve(name)
        shape, dtype = self.source.info(stored)
        if expert is None:
            return shape, dtype
        rows = shape[1] // 2 if stored.endswith("gate_up_proj") else shape[1]
        return (rows, *shape[2:]), dtype

    def read(self, name, index=()):
        if self._mxfp4(name):
            return self._read_mxfp4(name, index)
        stored, expert, offset = self._resolve(name)
        if expert is None:
            return self.source.read(stored, index)
        shape = self.info(name)[0]
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        r0, r1, _ = index[0].indices(shape[0])
        rows = slice(r0 + offset, r1 + offset)
        return self.source.read(stored, (slice(expert, expert + 1), rows, *index[1:]))[0]

    def _read_mxfp4(self, name, index):
        """Our `[E, in, out]` block `index` of an MXFP4 tensor: the rows (out) and groups of
        32 columns (in) it covers, read and dequantized (`mxfp4.dequantize`)."""
        (e0, e1), (c0, c1), (r0, r1) = _bounds(index, self.info(name)[0])
        g0, g1 = c0 // mxfp4.GROUP, -(-c1 // mxfp4.GROUP)
        blocks, scales = (self.source.read(n, (slice(e0, e1), slice(r0, r1), slice(g0, g1)))
                          for n in self._mxfp4(name))  # fmt: skip
        values = mxfp4.dequantize(blocks, scales)[
            ..., c0 - g0 * mxfp4.GROUP : c1 - g0 * mxfp4.GROUP
        ]
        return values.transpose(0, 2, 1)


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
    if m.experts:  # one block per expert, stacked along our expert axis
        (e0, e1), rest = bounds[0], bounds[1:]
        return np.stack([_read_expert(source, m, layer, e, rest) for e in range(e0, e1)])
    return _read_expert(source, m, layer, None, bounds)


def _names(m: _Map, layer, expert=None):
    """The checkpoint names of `m`'s tensors of `layer` (and `expert`)."""
    if layer is not None:
        layer += m.offset
    return [n.format(layer=layer, expert=expert) for n in m.names]


def _read_expert(source, m: _Map, layer, expert, bounds):
    names = _names(m, layer, expert)
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
    experts = range(per_layer[0]) if m.experts else [None]
    per_layer = per_layer[1:] if m.experts else per_layer
    for layer, expert in ((a, b) for a in layers for b in experts):
        names = _names(m, layer, expert)
        got = [source.info(n)[0] for n in names]
        if m.kind == "copy":
            want = [tuple(per_layer)]
        elif m.kind == "t":
            want = [tuple(per_layer[::-1])]
        else:
            rows = per_layer[-1] // 2
            want = [(rows, *per_layer[:-1])] * 2
        if got != want:
            raise ValueError(
                f"checkpoint tensors {names} have shapes {got}; "
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
        experts = range(shapes[p][1]) if m.experts else [None]
        names = (n for layer in layers for expert in experts for n in _names(m, layer, expert))
        used.update(stored for n in names for stored in source.stored_names(n))
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


def load_hf(path, *, mesh, pipelined: bool = False, param_dtype=np.float32, on_read=None,
            **model_options):  # fmt: skip
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
      on_read: None, or a callable given a `hf_reads.TensorRead` for every slice this
        process copies out of the files, naming the parameter block it builds
        (`hf_reads.bytes_per_device` sums them per device).
      **model_options: layer options of `models.Transformer` (zero=, remat=, ...).

    Returns:
      the model (its `spec` attribute holds the `ModelSpec`).

    Raises:
      ValueError: an unknown architecture or unsupported config field (named), a missing
        shard file or tensor, tensors of the wrong shape, a tensor no parameter reads
        (named), an `on_read` that is not callable, a mesh that does not divide the heads
        (raised by the layers, before anything is read).

    Example:
      >>> import jax, tempfile
      >>> from flax import nnx
      >>> from shardfuse.models import ModelSpec, Transformer, hf
      >>> mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
      >>> model = Transformer(ModelSpec.tiny(num_layers=1), mesh=mesh, rngs=nnx.Rngs(0))
      >>> path = hf.save_hf(model, tempfile.mkdtemp())
      >>> hf.load_hf(path, mesh=mesh).spec.num_layers
      1
      >>> reads = []  # each slice read, with the parameter block it was read for
      >>> _ = hf.load_hf(path, mesh=mesh, on_read=reads.append)
      >>> [r.block[-1] for r in reads if r.tensor.endswith("q_proj.weight")]  # per model shard
      [(0, 32), (32, 64)]
    """
    if on_read is not None and not callable(on_read):
        raise ValueError(f"on_read={on_read!r} must be None or a callable taking a TensorRead")
    path = Path(path)
    spec = read_hf_spec(path)
    family = _default_family(spec)  # (the MoE families' specs tell them apart)
    source = _Checkpoint(SafetensorsDir(path))

    def build():
        return Transformer(spec, mesh=mesh, pipelined=pipelined, rngs=nnx.Rngs(0),
                           **model_options)  # fmt: skip

    graphdef, state = nnx.split(nnx.eval_shape(build))
    maps = {}
    for p, variable in _params(state):
        m = _map_of(p, spec, family)
        _check_shapes(source, m, variable.get_raw_value().shape, p)
        maps[p] = m
    if on_read is not None:  # reads of no parameter: the tied head's check
        source.on_read = lambda name, index, nbytes: on_read(
            TensorRead(None, None, name, index, nbytes)
        )
    _check_all_used(source, maps, state, spec)
    for p, variable in _params(state):
        abstract = variable.get_raw_value()
        sharding = NamedSharding(mesh, abstract.sharding.spec)
        m, shape = maps[p], abstract.shape
        slices = {}  # one read per distinct slice (replicas on this process share it)
        label = ".".join(map(str, p))

        def callback(index, m=m, shape=shape, slices=slices, label=label):
            key = tuple(_bounds(index, shape))  # the block, as `hf_reads.block_of` says
            if key not in slices:
                if on_read is not None:
                    source.on_read = lambda name, i, nbytes: on_read(
                        TensorRead(label, key, name, i, nbytes)
                    )
                slices[key] = _read(source, m, shape, index, param_dtype)
            return slices[key]

        value = jax.make_array_from_callback(shape, sharding, callback)
        variable.set_raw_value(value)
    source.on_read = None
    for _, variable in nnx.to_flat_state(state):  # not parameters: the MoE statistics (zeros,
        if not isinstance(variable, nnx.Param):  # as the model initialises them)
            abstract = variable.get_raw_value()
            zeros = np.zeros(abstract.shape, abstract.dtype)
            sharding = NamedSharding(mesh, abstract.sharding.spec)
            variable.set_raw_value(jax.make_array_from_callback(
                abstract.shape, sharding, lambda index, zeros=zeros: zeros[index]))  # fmt: skip
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


def _default_family(spec) -> str:
    """The family `save_hf` writes `spec` as when no `model_type` is given."""
    if spec.attention_sinks or spec.expert_bias:
        return "gpt_oss"
    if spec.is_moe:
        if spec.shared_experts:
            return "qwen2_moe"
        return {"head": "qwen3_moe", "flat": "olmoe"}.get(spec.qk_norm, "mixtral")
    return "qwen2" if spec.qkv_bias else "mistral" if spec.window else "llama"


def save_hf(model, path, *, model_type: str | None = None, dtype=None,
            max_shard_bytes: int = 4 << 30):  # fmt: skip
    """Writes `model` (a `models.Transformer`) as a Hugging Face checkpoint directory.

    `config.json` (`hf_config`), `model.safetensors` or shards
    `model-0000i-of-0000n.safetensors` of at most `max_shard_bytes` with their index.
    Shard files are dealt round-robin to the processes; each process writes its own
    (the arrays are gathered one layer of one parameter at a time) to `path` on a file
    system they share, and returns once every process has written its files. A round trip
    `load_hf(save_hf(model))` is bitwise for float32 parameters.

    Args:
      model: the model; its `spec` says the sizes.
      path: a directory (created; existing files of the same names are replaced).
      model_type: a key of `ARCHITECTURES`; default: for a mixture of experts qwen2_moe
        with a shared expert, qwen3_moe with per-head q/k norms, olmoe with flat ones, else
        mixtral; dense: qwen2 with q/k/v biases, mistral with a sliding window, else llama.
        Experts are written one tensor each (`experts.{e}.gate_proj.weight`; Mixtral's
        `block_sparse_moe.experts.{e}.w1.weight`), as transformers' `save_pretrained` does.
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
        model_type = _default_family(spec)
    state = nnx.state(model, nnx.Param)
    entries = []  # (name, shape, dtype, producer)
    params = _params(state)
    first_dtype = None
    for p, variable in params:
        m = _map_of(p, spec, model_type)
        value = variable.get_raw_value()
        first_dtype = first_dtype or value.dtype
        out_dtype = np.dtype(dtype or value.dtype)
        layers = range(value.shape[0]) if m.stacked else [None]
        per = value.shape[1:] if m.stacked else value.shape
        experts = range(per[0]) if m.experts else [None]
        per = per[1:] if m.experts else per
        shapes = [tuple(s.shape) for s in _split(m, np.empty(per, np.uint8))]
        for layer, expert in ((a, b) for a in layers for b in experts):
            for i, (name, shape) in enumerate(zip(_names(m, layer, expert), shapes, strict=True)):
                entries.append((name, shape, out_dtype, (value, m, layer, expert, i)))
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
        for name, _, out_dtype, (value, m, layer, expert, part) in group:
            key = (id(value), layer)
            if key not in cache:  # every process gathers (a collective across hosts)
                cache.clear()
                cache[key] = _full(value, layer)
            if i % processes == me:
                ours = cache[key] if expert is None else cache[key][expert]
                tensors[name] = np.ascontiguousarray(_split(m, ours)[part]).astype(out_dtype)
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
    if processes > 1:  # every file is complete before any process returns (and loads it)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"shardfuse.save_hf {path}")
    return path
