"""Text generation with a KV cache sharded like the attention.

    prefill:  the prompt through every layer at once (flash attention, causal),
              its keys and values written to the cache
    decode:   one token per step; its query against the cache (decode attention:
              flash-decoding, split over the cache length and merged by lse)

Both run as one `jax.shard_map` over the whole mesh with the parameters in a
decode layout: heads, kv heads and MLP units over `model` (as in training),
routed experts over `expert` (as in training), the batch over `data` and `fsdp`
where it divides them, nothing over `pipeline` or `sequence` (a pipelined or
ZeRO-3 model is gathered along those axes once, before the first step).

Mixture-of-experts blocks route each token as `ParallelMoE` does (the same
`router.route`, dropless: no capacity at inference) and run only the routed
experts, two grouped matmuls over the token slots sorted by expert. On an
expert axis every shard sees its data shard's tokens, computes the slots of its
own experts (`grouped_matmul`'s `group_offset`; the others' rows are zero) and
the routed outputs are summed over `expert` (a `[tokens, F]` all-reduce per MoE
block; the shared experts are added after it, once). A spec mixing dense and MoE
blocks, or windowed and global attention (`window_layers`), runs one layer scan per run
of blocks of one kind (`BlockRuns`). Attention sinks (gpt-oss) scale the prefill's and
the decode's attention by their lse (`sf.layers.attention.apply_sinks`).

The cache is `[L, B, S, K, D]` for keys and values, kv heads over `model` when
`K % model == 0` (else each model shard keeps the kv head its query heads read),
the batch like the tokens. Its size S is fixed, so the decode step compiles once
for every token.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.sharding import place
from shardfuse.kernels.attention import api as attention_api
from shardfuse.kernels.decode_attention.api import decode_attention
from shardfuse.layers import moe as moe_lib
from shardfuse.layers import router as router_lib
from shardfuse.layers.attention import apply_sinks, qk_transform, rope
from shardfuse.layers.block import normalize
from shardfuse.layers.mlp import activate
from shardfuse.models.block_runs import moe_keywords

MODEL = "model"
EXPERT = "expert"
BATCH_AXES = ("data", "fsdp")

# Trace counts of the prefill and decode programs (the compile-once test reads them).
TRACES = {"prefill": 0, "decode": 0}


def _leaf(path):
    """Our name of a parameter: the last two path entries joined ("attention.q_kernel")."""
    return ".".join(str(p) for p in path[-2:])


_LAYER_NAMES = {
    "attention.q_kernel": "q",
    "attention.kv_kernel": "kv",
    "attention.o_kernel": "o",
    "attention.q_bias": "q_b",
    "attention.kv_bias": "kv_b",
    "attention.o_bias": "o_b",
    "up.kernel": "up",
    "up.bias": "up_b",
    "down.kernel": "down",
    "down.bias": "down_b",
    "norm_1.scale": "n1",
    "norm_1.bias": "n1_b",
    "norm_2.scale": "n2",
    "norm_2.bias": "n2_b",
    "attention.q_norm": "qn",
    "attention.k_norm": "kn",
    "attention.sinks": "sinks",
    "mlp.router_bias": "router_b",
    "mlp.gate_up_bias": "gate_up_b",
    "mlp.down_bias": "moe_down_b",
    "mlp.router": "router",
    "mlp.selection_bias": "sel_bias",
    "mlp.gate_up": "gate_up",
    "mlp.down": "moe_down",
    "mlp.shared_up": "shared_up",
    "mlp.shared_down": "shared_down",
    "mlp.shared_gate": "shared_gate",
}
_TOP_NAMES = {"embed": "embed", "norm.scale": "nf", "norm.bias": "nf_b",
              "unembed.kernel": "unembed", "pos_embed": "pos"}  # fmt: skip


def _decode_spec(spec, mesh):
    """`spec` with every axis but `model` and `expert` dropped (the decode layout)."""

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        return MODEL if MODEL in names else EXPERT if EXPERT in names else None

    return P(*[keep(a) for a in spec])


def decode_params(model) -> dict:
    """The model's parameters by short name, resharded to the decode layout."""
    return _decode_layout(model)[0]


def _decode_layout(model):
    """`(params, specs)`: `decode_params` and their PartitionSpecs, read from the model's
    arrays (under a caller's jit the resharded values are tracers, an Auto mesh's without
    the spec in their type)."""
    mesh = model.mesh
    params, specs = {}, {}
    state = nnx.state(model, nnx.Any(nnx.Param, router_lib.SelectionBias))
    for path, variable in nnx.to_flat_state(state):
        name = _leaf(path)
        short = _LAYER_NAMES.get(name) or _TOP_NAMES.get(name) or _TOP_NAMES.get(str(path[-1]))
        if short is None:
            raise ValueError(f"generate: parameter {'.'.join(map(str, path))} is not understood")
        if name in _LAYER_NAMES and path[:2] == ("blocks", "runs"):  # run i of `BlockRuns`
            short = f"r{int(path[2])}.{short}"
        value = variable[...]
        specs[short] = _decode_spec(value.sharding.spec, mesh)
        params[short] = jax.device_put(value, NamedSharding(mesh, specs[short]))
    return params, specs


def _batch_axes(mesh, batch):
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    return axes if axes and batch % size == 0 else None


def _cache_spec(mesh, batch_axes):
    """`[L, B, S, K, D]`: kv heads over `model` (K = tp one-head slots when `K % tp != 0`)."""
    tp = mesh.shape[MODEL] if MODEL in mesh.axis_names else 1
    return P(None, batch_axes, None, MODEL if tp > 1 else None)


def _moe(spec, tp, ep, p, h):
    """Per shard: the MoE block's output (partial over `model`) for tokens `h` `[n, F]`.

    Routes as `ParallelMoE` (`router.route` on float32 logits, dropless), runs the routed
    slots of this shard's experts (two grouped matmuls; with `ep > 1` the others' rows
    are zero and the routed sum is reduced over `expert`), adds the shared experts.
    """
    keywords = moe_keywords(spec)
    config = router_lib.RoutingConfig(
        num_experts=spec.experts, top_k=spec.top_k, rule=keywords["routing"],
        normalize_top_k=keywords["normalize_top_k"], n_groups=keywords["n_groups"],
        topk_groups=keywords["topk_groups"], routed_scaling=keywords["routed_scaling"],
    )  # fmt: skip
    logits = router_lib.router_logits(h, p["router"], p.get("router_b"))
    experts, weights, _ = router_lib.route(config, logits, p.get("sel_bias"))
    order, sorted_e = moe_lib.sort_slots(experts, spec.experts)
    sizes = jnp.zeros((spec.experts,), jnp.int32).at[sorted_e].add(1)
    offset = lax.axis_index(EXPERT) * (spec.experts // ep) if ep > 1 else None
    rows = h[order % h.shape[0]]
    cast = lambda name: None if p.get(name) is None else p[name].astype(h.dtype)  # noqa: E731
    act = functools.partial(activate, spec.activation, swiglu_limit=spec.swiglu_limit,
                            swiglu_alpha=spec.swiglu_alpha)  # fmt: skip
    d = moe_lib.routed_experts(
        rows, sorted_e, sizes, cast("gate_up"), cast("moe_down"), act=act, offset=offset,
        gate_up_bias=cast("gate_up_b"), down_bias=cast("moe_down_b"),
        add_down_bias=lax.axis_index(MODEL) == 0 if tp > 1 else True, activation=spec.activation,
    )  # fmt: skip
    y = moe_lib.combine_slots(d, order, weights)
    if ep > 1:
        y = lax.psum(y, EXPERT)
    if p.get("shared_up") is not None:
        y = y + moe_lib.shared_experts(h, p["shared_up"], p["shared_down"], p.get("shared_gate"),
                                       lax.Precision.HIGHEST, act)  # fmt: skip
    return y.astype(h.dtype)


def _runs(params):
    """The layer parameters by short name, one dict per run of blocks of one kind, in order."""
    runs = {}
    for key, value in params.items():
        run, _, short = key.rpartition(".")
        if short in _LAYER_NAMES.values():
            runs.setdefault(int(run[1:]) if run else 0, {})[short] = value
    return [runs[i] for i in sorted(runs)]


def _local_forward(spec, tp, ep, kv_sharded, prefill, implementation, params, tokens, cache_k,
                   cache_v, start):  # fmt: skip
    # (each run of blocks of one kind, `block_runs`, has one window: a scan of its own)
    """Per shard: logits `[b, V]` of the last token, and the updated cache."""
    H, K, D = spec.heads, spec.kv_heads, spec.head_dim
    heads = H // tp
    b, t = tokens.shape
    x = jnp.take(params["embed"], tokens, axis=0)
    positions = start + jnp.arange(t, dtype=jnp.int32)
    if spec.positions == "learned":
        x = x + jnp.take(params["pos"], positions, axis=0)
    model_index = lax.axis_index(MODEL) if tp > 1 else 0
    # a flat k norm over a replicated kv kernel: every kv head projected (for the norm)
    k_whole = spec.qk_norm == "flat" and not kv_sharded and tp > 1
    head = model_index * heads // (H // K)  # the kv head of a shard without its own

    def layer(window, x, xs):
        p, ck, cv = xs
        h = normalize(spec.norm, x, p["n1"], p.get("n1_b"), spec.norm_eps)
        q = h @ p["q"]
        kv_w, kv_b = p["kv"], p.get("kv_b")
        if not kv_sharded and tp > 1 and not k_whole:  # the kv head its query heads read
            kv_w = lax.dynamic_slice_in_dim(kv_w, head * 2 * D, 2 * D, axis=1)
            kv_b = None if kv_b is None else lax.dynamic_slice_in_dim(kv_b, head * 2 * D, 2 * D)
        kv = h @ kv_w
        if p.get("q_b") is not None:
            q, kv = q + p["q_b"], kv + kv_b
        q = q.reshape(b, t, heads, D)
        kv = kv.reshape(b, t, -1, 2, D)
        q, k, v = qk_transform(
            q, kv[..., 0, :], kv[..., 1, :], p.get("qn"), p.get("kn"), kind=spec.qk_norm,
            eps=spec.norm_eps, clip=spec.clip_qkv, axis_name=MODEL if tp > 1 else None,
            widths=(H * D, K * D), k_whole=k_whole,
        )  # fmt: skip
        if k_whole:  # then the one kv head this shard's query heads read
            k, v = (lax.dynamic_slice_in_dim(a, head, 1, axis=2) for a in (k, v))
        if spec.positions == "rope":
            q = rope(q, positions, spec.rope_theta, spec.rope_scaling)
            k = rope(k, positions, spec.rope_theta, spec.rope_scaling)
        ck = lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), start, axis=1)
        cv = lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), start, axis=1)
        masks = dict(window=window, logit_softcap=spec.logit_softcap, implementation=implementation,
                     return_lse=p.get("sinks") is not None)  # fmt: skip
        if prefill:
            o = attention_api.flash_attention(q, k, v, causal=True, **masks)
        else:
            lengths = jnp.full((b,), start + t, jnp.int32)
            # a cache in another dtype (`cache_dtype`) is read back in the queries' dtype
            o = decode_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), lengths, **masks)
        if p.get("sinks") is not None:  # the sink logits in each softmax (`apply_sinks`)
            o = apply_sinks(*o, p["sinks"])
        o = o.reshape(b, t, heads * D) @ p["o"]
        o = lax.psum(o, MODEL) if tp > 1 else o
        if p.get("o_b") is not None:
            o = o + p["o_b"]
        x = x + o.astype(x.dtype)
        h = normalize(spec.norm, x, p["n2"], p.get("n2_b"), spec.norm_eps)
        if "router" in p:  # a mixture of experts
            d = _moe(spec, tp, ep, p, h.reshape(b * t, -1)).reshape(h.shape)
        else:
            u = h @ p["up"]
            if p.get("up_b") is not None:
                u = u + p["up_b"]
            d = activate(spec.activation, u, swiglu_limit=spec.swiglu_limit,
                         swiglu_alpha=spec.swiglu_alpha) @ p["down"]  # fmt: skip
        d = lax.psum(d, MODEL) if tp > 1 else d
        if p.get("down_b") is not None:
            d = d + p["down_b"]
        return x + d.astype(x.dtype), (ck, cv)

    new_k, new_v, first = [], [], 0
    for run in _runs(params):  # one scan per run of blocks of one kind
        count = next(iter(run.values())).shape[0]
        ck, cv = cache_k[first : first + count], cache_v[first : first + count]
        step = functools.partial(layer, spec.layer_window(first))
        x, (ck, cv) = lax.scan(step, x, (run, ck, cv))
        new_k.append(ck)
        new_v.append(cv)
        first += count
    cache_k, cache_v = (parts[0] if len(parts) == 1 else jnp.concatenate(parts)
                        for parts in (new_k, new_v))  # fmt: skip
    x = normalize(spec.norm, x[:, -1], params["nf"], params.get("nf_b"), spec.norm_eps)
    unembed = params["embed"].T if spec.tied_embeddings else params["unembed"]
    logits = x @ unembed
    if logits.shape[-1] != spec.vocab_size:  # this shard's vocabulary columns: gather them
        logits = lax.all_gather(logits, MODEL, axis=1, tiled=True)
    return logits, cache_k, cache_v


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _step(static, prefill, layout, params, tokens, cache_k, cache_v, start):
    """One prefill (`prefill=True`) or decode step: logits `[B, V]` of the last token."""
    TRACES["prefill" if prefill else "decode"] += 1
    spec, mesh, implementation = static
    batch_axes, kv_sharded, param_specs, logits_spec = layout
    tp = mesh.shape[MODEL] if MODEL in mesh.axis_names else 1
    ep = mesh.shape[EXPERT] if EXPERT in mesh.axis_names and spec.is_moe else 1
    cache_spec = _cache_spec(mesh, batch_axes)
    local = functools.partial(_local_forward, spec, tp, ep, kv_sharded, prefill, implementation)
    # a cache or tokens laid out otherwise (by the caller): moved to the step's layout, which
    # an Explicit mesh's shard_map does not do by itself
    tokens = place(tokens, mesh, P(batch_axes, None))
    cache_k, cache_v = (place(c, mesh, cache_spec) for c in (cache_k, cache_v))
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(dict(param_specs), P(batch_axes, None), cache_spec, cache_spec, P()),
        out_specs=(logits_spec, cache_spec, cache_spec),
        check_vma=False,
    )(params, tokens, cache_k, cache_v, start)


class DecodeProgram:
    """The prefill and decode steps of one model, batch size and cache size.

    `prefill(tokens)` runs prompts `[B, T]` and returns `(logits [B, V], cache)`;
    `step(tokens, cache, start)` runs `[B, t]` new tokens at positions `start ...`
    and returns the same. Both compile once per shape (`start` is traced).
    `generate` drives one; the benchmarks time its steps.

    Args:
      model: a `models.Transformer`.
      batch: B.
      cache_size: S, the longest prompt plus generated tokens.
      cache_dtype: dtype of the cache (default: the parameters').
      implementation: attention implementation for both prefill (`flash_attention`)
        and decode (`decode_attention`); None: the platform's preference.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> from shardfuse.models.generation import DecodeProgram
      >>> mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
      >>> model = sf.models.Transformer(sf.models.ModelSpec.tiny(num_layers=1), mesh=mesh,
      ...                               rngs=nnx.Rngs(0))
      >>> program = DecodeProgram(model, batch=1, cache_size=8)
      >>> logits, cache = program.prefill(jnp.zeros((1, 4), jnp.int32))
      >>> logits, cache = program.step(jnp.zeros((1, 1), jnp.int32), cache, 4)
      >>> logits.shape
      (1, 256)
    """

    def __init__(self, model, *, batch: int, cache_size: int, cache_dtype=None,
                 implementation=None):  # fmt: skip
        for name, value in (("batch", batch), ("cache_size", cache_size)):
            if not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        spec, mesh = model.spec, model.mesh
        self.params, param_specs = _decode_layout(model)
        tp = mesh.shape[MODEL] if MODEL in mesh.axis_names else 1
        kv_sharded = spec.kv_heads % tp == 0
        self.batch_axes = _batch_axes(mesh, batch)
        self.layout = (self.batch_axes, kv_sharded, tuple(sorted(param_specs.items())),
                       P(self.batch_axes, None))  # fmt: skip
        K = spec.kv_heads if kv_sharded or tp == 1 else tp  # one kv head per model shard
        self.cache_shape = (spec.num_layers, batch, cache_size, K, spec.head_dim)
        self.cache_sharding = NamedSharding(mesh, _cache_spec(mesh, self.batch_axes))
        self.cache_dtype = cache_dtype or _runs(self.params)[0]["q"].dtype
        self.static = (spec, mesh, implementation)  # hashable: the step's static argument
        self.spec, self.mesh, self.cache_size = spec, mesh, cache_size

    def empty_cache(self):
        """Zero keys and values, `[L, B, S, K, D]` each."""
        zeros = jnp.zeros(self.cache_shape, self.cache_dtype)
        return (jax.device_put(zeros, self.cache_sharding),) * 2

    def tokens(self, tokens):
        """int32 `tokens` placed with the batch over the decode layout's batch axes."""
        sharding = NamedSharding(self.mesh, P(self.batch_axes, None))
        return jax.device_put(jnp.asarray(tokens, jnp.int32), sharding)

    def prefill(self, tokens):
        """`(logits [B, V] of the last prompt token, cache)` for prompts `[B, T]`."""
        _check_ids(tokens, self.spec.vocab_size)
        return self.step(tokens, self.empty_cache(), 0, prefill=True)

    def step(self, tokens, cache, start, *, prefill=False):
        """`(logits [B, V], cache)` after `tokens` `[B, t]` at positions `start ... start+t-1`.

        Raises:
          ValueError: (an int `start`) positions outside the cache, or beyond a learned
            position table's `spec.max_positions` rows; either would be computed from
            clamped or NaN rows, not refused, inside the program. Host (numpy) token ids
            outside the vocabulary; prefill checks device arrays too.
        """
        if not isinstance(tokens, jax.Array):  # host ids: checked for free
            _check_ids(tokens, self.spec.vocab_size)
        if isinstance(start, int | np.integer):
            stop = int(start) + np.shape(tokens)[1]
            if start < 0 or stop > self.cache_size:
                raise ValueError(
                    f"tokens at positions {start}..{stop - 1} do not fit "
                    f"cache_size={self.cache_size}"
                )
            if self.spec.positions == "learned" and stop > self.spec.max_positions:
                raise ValueError(
                    f"tokens at positions {start}..{stop - 1}: the learned position table "
                    f"has spec.max_positions={self.spec.max_positions} rows"
                )
        logits, k, v = _step(self.static, prefill, self.layout, self.params, self.tokens(tokens),
                             *cache, jnp.int32(start))  # fmt: skip
        return logits, (k, v)


def _check_ids(tokens, vocab_size: int):
    """Concrete token ids outside `[0, vocab_size)` are refused: the embedding would read a
    NaN row (`jnp.take`'s fill), whose logits decode as token 0."""
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(
            f"token ids must be in [0, {vocab_size}) (spec.vocab_size); got ids from "
            f"{ids.min()} to {ids.max()}"
        )


def _check_sampling(top_k, top_p):
    if top_k is not None and (not isinstance(top_k, int | np.integer) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be an int >= 1 (or None)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1] (or None)")


def sample(logits, key, *, temperature: float = 0.0, top_k=None, top_p=None):
    """Next tokens `[B]` from logits `[B, V]`: greedy at temperature 0, else sampled.

    `top_k` keeps the k most likely tokens (all of them when `top_k` exceeds the
    vocabulary, as transformers does), `top_p` the smallest set whose probability
    reaches p (nucleus sampling), both before the temperature draw.

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.models.generation import sample
      >>> sample(jnp.array([[0.0, 2.0, 1.0]]), None).tolist()
      [1]
    """
    _check_sampling(top_k, top_p)
    logits = logits.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = lax.top_k(logits, min(int(top_k), logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1)
        logits = jnp.where(logits < cutoff[..., None], -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(model, tokens, max_new_tokens: int, *, temperature: float = 0.0, top_k=None,
             top_p=None, eos_id=None, rngs=None, cache_size=None, cache_dtype=None,
             implementation=None):  # fmt: skip
    """`max_new_tokens` tokens after each prompt row of `tokens` `[B, T]` (int).

    Prefill runs the prompts through the model at once; each later token is one decode
    step against the KV cache (see the module docstring). Decoding is greedy at
    `temperature=0` (the default), else sampled with `top_k` / `top_p`. Rows that emit
    `eos_id` keep emitting it; generation stops early when every row has (not under a
    caller's `jax.jit`, where every step runs). Meshes of Explicit or Auto axes alike.

    Args:
      model: a `models.Transformer` (any mesh; decoding uses the `model`, `data` and
        `fsdp` axes).
      tokens: int `[B, T]` prompts of equal length.
      max_new_tokens: how many tokens to generate (>= 1).
      temperature, top_k, top_p: sampling (`sample`).
      eos_id: token id that ends a row, or None.
      rngs: `nnx.Rngs` (or a key) for sampling; needed when `temperature > 0`.
      cache_size: cache length S (default `T + max_new_tokens`); fixed, so each decode
        step compiles once.
      cache_dtype: dtype of the cache (default: the parameters' dtype).
      implementation: attention implementation of prefill and decode (None: the
        platform's preference).

    Returns:
      int32 `[B, max_new_tokens]`.

    Raises:
      ValueError: bad sizes, `temperature > 0` without `rngs`, a cache too short,
        positions beyond a learned position table, a bad `top_k` or `top_p`, a token id
        outside the vocabulary.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> spec = sf.models.ModelSpec("tiny", hidden=32, heads=4, kv_heads=2, head_dim=8,
      ...                            ffn_hidden=64, num_layers=2, vocab_size=64)
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> model = sf.models.Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0))
      >>> sf.generate(model, jnp.zeros((2, 5), jnp.int32), 4).shape
      (2, 4)
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be int [B, T]; got {tokens.dtype} {tokens.shape}")
    B, T = tokens.shape
    if T < 1 or B < 1:
        raise ValueError(f"tokens has shape {tokens.shape}: B and T must be >= 1")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if temperature > 0 and rngs is None:
        raise ValueError("temperature > 0 samples: pass rngs=nnx.Rngs(seed) (or a key)")
    S = T + max_new_tokens if cache_size is None else cache_size
    if not isinstance(S, int | np.integer) or S < T + max_new_tokens:
        raise ValueError(f"cache_size={S} < prompt length {T} + max_new_tokens {max_new_tokens}")
    _check_sampling(top_k, top_p)
    spec = model.spec
    if spec.positions == "learned" and T + max_new_tokens - 1 > spec.max_positions:
        raise ValueError(
            f"prompt length {T} + max_new_tokens {max_new_tokens} reads positions up to "
            f"{T + max_new_tokens - 2}; the learned position table has spec.max_positions="
            f"{spec.max_positions} rows"
        )
    program = DecodeProgram(model, batch=B, cache_size=S, cache_dtype=cache_dtype,
                            implementation=implementation)  # fmt: skip
    logits, cache = program.prefill(tokens)
    key = rngs() if isinstance(rngs, nnx.Rngs) else rngs
    out, done = [], jnp.zeros((B,), bool)
    for i in range(max_new_tokens):
        step_key = None if key is None else jax.random.fold_in(key, i)
        nxt = sample(logits, step_key, temperature=temperature, top_k=top_k, top_p=top_p)
        if eos_id is not None:
            nxt = jnp.where(done, eos_id, nxt)
            done = done | (nxt == eos_id)
        out.append(nxt)
        stop = eos_id is not None and not isinstance(done, jax.core.Tracer) and bool(done.all())
        if i + 1 == max_new_tokens or stop:  # under a caller's jit: every step, no early stop
            break
        logits, cache = program.step(nxt[:, None], cache, T + i)
    out = jnp.stack(out, axis=1)
    if out.shape[1] < max_new_tokens:
        pad = jnp.full((B, max_new_tokens - out.shape[1]), eos_id, jnp.int32)
        out = jnp.concatenate([out, pad], axis=1)
    return out
