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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from shardfuse.kernels.attention.api import attention_reference
from shardfuse.layers.attention import rope
from shardfuse.layers.block import normalize
from shardfuse.layers.mlp import activate


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
    return _dense(
        activate(layer.activation, h), p["down"]["kernel"], p["down"].get("bias"), precision
    )


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
    q = rope(q, positions, layer.rope_theta)
    k = rope(kv[..., 0, :], positions, layer.rope_theta)
    v = kv[..., 1, :]
    o = attention_reference(
        q,
        k,
        v,
        causal=layer.causal,
        q_segment_ids=segment_ids,
        kv_segment_ids=segment_ids,
        window=layer.window,
        logit_softcap=layer.logit_softcap,
    )
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
    return h + mlp(block.mlp, p["mlp"], norm(block.norm_2, p["norm_2"], h), dtype=dtype)
