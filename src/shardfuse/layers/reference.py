"""Unsharded single-device references of the parallel layers: the layers' test oracles.

Each function takes a parallel layer (for its static options), its
parameters as a plain nested dict on one device (`params(layer)`, the same
tree as `nnx.state(layer, nnx.Param).to_pure_dict()`, so gradients compare
key by key) and natural-order global inputs, and computes the layer with
plain `jnp` (float32 accumulation, HIGHEST precision for float32) and
`sf.attention_reference`. Everything is differentiable. Use them to check a model built
from shardfuse layers, or as the definition of what each layer computes.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from flax import nnx
  >>> import shardfuse as sf
  >>> from shardfuse.layers import reference
  >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  >>> mlp = sf.layers.ParallelMLP(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
  >>> x = jnp.ones((1, 4, 16))
  >>> params = reference.params(mlp)
  >>> bool(jnp.allclose(mlp(x), reference.mlp(mlp, params, x), atol=1e-5))
  True
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardfuse.kernels.attention.api import attention_reference
from shardfuse.layers.attention import apply_sinks, qk_transform, rope
from shardfuse.layers.block import normalize


def params(layer) -> dict:
    """The layer's parameters as a nested dict of unsharded arrays on the first device."""
    from flax import nnx

    state = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), state)


def _dtype(layer_dtype, x, kernel, override=None):
    """Compute dtype: `override`, else the layer's `dtype`, else the inputs' promoted dtype."""
    if override is not None:
        return jnp.dtype(override)
    return jnp.dtype(layer_dtype) if layer_dtype is not None else jnp.result_type(x, kernel)


def _dense(x, kernel, bias=None, precision=None):
    """`x @ kernel (+ bias)` in x's dtype with float32 accumulation."""
    if precision is None:
        precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else lax.Precision.DEFAULT
    y = jnp.einsum(
        "...C,CN->...N",
        x,
        kernel.astype(x.dtype),
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    if bias is not None:
        y = y + bias.astype(x.dtype).astype(jnp.float32)
    return y.astype(x.dtype)


def linear(layer, p, x, *, dtype=None):
    """`x @ kernel + bias` of a `ColumnParallelLinear` or `RowParallelLinear`, unsharded.

    `dtype` overrides the layer's compute dtype (e.g. float32 for a float32
    reference of a bfloat16 layer); so for every function here.
    """
    x = x.astype(_dtype(layer.dtype, x, p["kernel"], dtype))
    return _dense(x, p["kernel"], p.get("bias"), layer.precision)


def mlp(layer, p, x, *, dtype=None):
    """`ParallelMLP`, unsharded."""
    x = x.astype(_dtype(layer.up.dtype, x, p["up"]["kernel"], dtype))
    precision = layer.up.precision
    h = _dense(x, p["up"]["kernel"], p["up"].get("bias"), precision)
    return _dense(layer.activate(h), p["down"]["kernel"], p["down"].get("bias"), precision)


def self_attention(layer, p, x, *, positions=None, segment_ids=None, dtype=None):
    """`ParallelSelfAttention` on natural-order `x` `[B, T, F]`, unsharded.

    `positions` (RoPE) default to `arange(T)`; masks use the natural token
    order, as the layer does through its ring layout.
    """
    x = x.astype(_dtype(layer.dtype, x, p["q_kernel"], dtype))
    B, T, _ = x.shape
    H, K, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    positions = jnp.arange(T, dtype=jnp.int32) if positions is None else positions
    q = _dense(x, p["q_kernel"], p.get("q_bias"), layer.precision).reshape(B, T, H, D)
    kv = _dense(x, p["kv_kernel"], p.get("kv_bias"), layer.precision).reshape(B, T, K, 2, D)
    q, k, v = qk_transform(
        q, kv[..., 0, :], kv[..., 1, :], p.get("q_norm"), p.get("k_norm"), kind=layer.qk_norm,
        eps=layer.qk_norm_eps, clip=layer.clip_qkv, widths=(H * D, K * D),
    )  # fmt: skip
    q = rope(q, positions, layer.rope_theta, layer.rope_scaling)
    k = rope(k, positions, layer.rope_theta, layer.rope_scaling)
    o = attention_reference(
        q,
        k,
        v,
        causal=layer.causal,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
        window=layer.window,
        logit_softcap=layer.logit_softcap,
        return_lse="sinks" in p,
    )
    if "sinks" in p:  # the sink logit in each softmax's denominator (`apply_sinks`)
        o = apply_sinks(*o, p["sinks"])
    return _dense(o.reshape(B, T, H * D), p["o_kernel"], p.get("o_bias"), layer.precision)


def norm(layer, p, x):
    """`Norm` (RMSNorm or LayerNorm), unsharded."""
    return normalize(layer.kind, x, p["scale"], p.get("bias"), layer.eps)


def transformer_block(block, p, x, *, positions=None, segment_ids=None, dtype=None):
    """`ParallelTransformerBlock` on natural-order `x` `[B, T, F]`, unsharded."""
    x = x.astype(_dtype(block.attention.dtype, x, p["attention"]["q_kernel"], dtype))
    dtype = x.dtype
    h = norm(block.norm_1, p["norm_1"], x)
    h = x + self_attention(
        block.attention,
        p["attention"],
        h,
        positions=positions,
        segment_ids=segment_ids,
        dtype=dtype,
    )
    y = norm(block.norm_2, p["norm_2"], h)
    if hasattr(block.mlp, "routing_config"):  # a ParallelMoE
        return h + moe(block.mlp, p["mlp"], y, dtype=dtype)[0]
    return h + mlp(block.mlp, p["mlp"], y, dtype=dtype)


def _moe_routing(layer, logits, bias):
    """The routing of `ParallelMoE` by its definition: `(experts [N, k], weights, probs)`.

    Written apart from `shardfuse.layers.router` (a descending stable argsort for the
    top-k, groups by an explicit loop) so that it checks that module too.
    """
    config = layer.routing_config
    E, k = config.num_experts, config.top_k
    if config.rule == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
        probs = scores
        selection = scores
    else:
        scores = 1.0 / (1.0 + jnp.exp(-logits))
        probs = scores / scores.sum(-1, keepdims=True)
        selection = scores + (0.0 if bias is None else bias)
    selection = lax.stop_gradient(selection)
    if config.n_groups is not None:
        size = E // config.n_groups
        group_scores = []
        for g in range(config.n_groups):
            members = selection[:, g * size : (g + 1) * size]
            if config.rule == "sigmoid":
                best = -jnp.sort(-members, axis=-1)[:, : min(2, size)]
                group_scores.append(best.sum(-1))
            else:
                group_scores.append(members.max(-1))
        group_scores = jnp.stack(group_scores, -1)  # [N, G]
        chosen = jnp.argsort(-group_scores, axis=-1, stable=True)[:, : config.topk_groups]
        allowed_groups = (chosen[:, :, None] == jnp.arange(config.n_groups)).any(1)  # [N, G]
        allowed = jnp.repeat(allowed_groups, size, axis=-1)
        selection = jnp.where(allowed, selection, -jnp.inf)
    experts = jnp.argsort(-selection, axis=-1, stable=True)[:, :k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if config.normalize_top_k:
        weights = weights / weights.sum(-1, keepdims=True)
    return experts, weights * config.routed_scaling, probs


def _moe_kept(layer, experts, groups):
    """`[N, k]` bool: which routed slots fit their expert's capacity (all when dropless).

    Capacity per token group (the tokens one device routes): `ceil(c * n * k / E)`
    slots per expert, first choices before second ones, tokens in order.
    """
    N, k = experts.shape
    if layer.capacity_factor is None:
        return jnp.ones((N, k), bool)
    E = layer.num_experts
    n = N // groups
    capacity = math.ceil(layer.capacity_factor * n * k / E)
    kept = []
    for g in range(groups):
        mine = experts[g * n : (g + 1) * n]  # [n, k]
        one_hot = mine.T.reshape(k * n)[:, None] == jnp.arange(E)  # [k n, E], slot-major
        rank = jnp.cumsum(one_hot, axis=0) - 1  # earlier slots of the same expert
        ok = (rank < capacity) | ~one_hot
        kept.append(ok.all(-1).reshape(k, n).T)
    return jnp.concatenate(kept, 0)


def moe(layer, p, x, *, bias=None, dtype=None):
    """`ParallelMoE` on `x` `[B, T, F]`, unsharded: `(y, stats)`.

    Each token through its k experts by an explicit loop over the experts (every
    expert applied to every token, weighted by the router's weight, zero where the
    token did not choose it or its slot was dropped), plus the shared experts; no
    sorting, no dispatch. The tokens are grouped for the capacity as the layer's
    devices route them (`layer.token_groups()`). `bias`: the sigmoid rule's
    selection bias (None: the layer's). `stats` as the layer's `MoEStats`.
    """
    x = x.astype(_dtype(layer.dtype, x, p["gate_up"], dtype))
    B, T, F = x.shape
    E, k = layer.num_experts, layer.top_k
    if bias is None and layer.selection_bias is not None:
        bias = jnp.asarray(np.asarray(layer.selection_bias[...]))
    batch_groups, sequence_groups = layer.token_groups()
    # tokens in routing-group order: group (i, j) is batch block i x sequence block j
    xg = x.reshape(batch_groups, B // batch_groups, sequence_groups, T // sequence_groups, F)
    xf = xg.transpose(0, 2, 1, 3, 4).reshape(B * T, F)
    logits = jnp.einsum("NF,FE->NE", xf.astype(jnp.float32), p["router"].astype(jnp.float32),
                        precision=lax.Precision.HIGHEST)  # fmt: skip
    if "router_bias" in p:
        logits = logits + p["router_bias"].astype(jnp.float32)
    experts, weights, probs = _moe_routing(layer, logits, bias)
    kept = _moe_kept(layer, experts, batch_groups * sequence_groups)
    y = jnp.zeros((B * T, F), jnp.float32)
    for e in range(E):
        chosen = (experts == e) & kept  # [N, k]
        w = jnp.sum(jnp.where(chosen, weights, 0.0), axis=-1)  # [N]
        h = _dense(xf, p["gate_up"][e], p.get("gate_up_bias", [None] * E)[e], layer.precision)
        out = _dense(layer.activate(h), p["down"][e], p.get("down_bias", [None] * E)[e],
                     layer.precision)  # fmt: skip
        y = y + w[:, None] * out.astype(jnp.float32)
    if "shared_up" in p:
        h = _dense(xf, p["shared_up"], None, layer.precision)
        s = _dense(layer.activate(h), p["shared_down"], None, layer.precision)
        s = s.astype(jnp.float32)
        if "shared_gate" in p:
            s = jax.nn.sigmoid(_dense(xf, p["shared_gate"], None, layer.precision)) * s
        y = y + s
    y = y.astype(x.dtype).reshape(batch_groups, sequence_groups, B // batch_groups,
                                  T // sequence_groups, F)  # fmt: skip
    y = y.transpose(0, 2, 1, 3, 4).reshape(B, T, F)
    N = B * T
    counts = jnp.stack([jnp.sum(experts == e) for e in range(E)]).astype(jnp.int32)
    f = counts.astype(jnp.float32) / (N * k)
    stats = dict(
        load_balancing_loss=E * jnp.sum(f * probs.mean(0)),
        router_z_loss=jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        tokens_per_expert=counts,
        dropped_tokens=jnp.sum(~kept).astype(jnp.int32),
    )
    return y, stats
