"""A pre-norm transformer block with tensor, sequence and context parallelism.

    h   = x + attention(norm_1(x))
    out = h + mlp(norm_2(h))

Norms (RMSNorm, Zhang & Sennrich 2019; or LayerNorm) are per token, so they
run on the sequence-sharded activations without communication (Megatron
sequence parallelism, Korthikanti et al. 2022). The whole block is one
`jax.shard_map`: attention and MLP reuse the per-shard code of
`ParallelSelfAttention` and `ParallelMLP`.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse.layers import _sharding
from shardfuse.layers.attention import ParallelSelfAttention
from shardfuse.layers.mlp import ParallelMLP

NORMS = ("rmsnorm", "layernorm")


def normalize(kind: str, x, scale, bias, eps: float):
    """RMSNorm or LayerNorm of `x` `[..., F]` in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    if kind == "layernorm":
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


class Norm(nnx.Module):
    """RMSNorm (`scale` `[F]`) or LayerNorm (`scale` and `bias` `[F]`), replicated `P()`.

    Example usage::

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> from shardfuse.layers.block import Norm
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> Norm(8, kind="rmsnorm", mesh=mesh, rngs=nnx.Rngs(0))(jnp.ones((2, 8))).shape
      (2, 8)
    """

    def __init__(
        self,
        features: int,
        *,
        kind: str = "rmsnorm",
        eps: float = 1e-6,
        mesh,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if kind not in NORMS:
            raise ValueError(f"norm={kind!r} must be one of {NORMS}")
        self.kind, self.eps = kind, float(eps)
        ones, zeros = nnx.initializers.ones_init(), nnx.initializers.zeros_init()
        self.scale = _sharding.replicated_param(ones, rngs.params(), (features,), param_dtype, mesh)
        self.bias = (
            _sharding.replicated_param(zeros, rngs.params(), (features,), param_dtype, mesh)
            if kind == "layernorm"
            else None
        )

    def params(self):
        return [self.scale[...], None if self.bias is None else self.bias[...]]

    def __call__(self, x):
        scale, bias = self.params()
        return normalize(self.kind, x, scale, bias, self.eps)


class ParallelTransformerBlock(nnx.Module):
    """Pre-norm transformer block: `ParallelSelfAttention` and `ParallelMLP` with residuals.

    Input and output `[B, T, features]`, sharded `P(data, (cp, tp), None)` with
    `sequence_parallel=True` (the default here: Megatron sequence
    parallelism), else `P(data, cp, None)`; along T in the ring `layout` order
    when `cp_axis` is set (`sf.to_ring_layout` once at the model input).

    Args:
      features: model width.
      num_heads: query heads.
      hidden_features: MLP width.
      norm: "rmsnorm" or "layernorm".
      norm_eps: epsilon of the norms.
      activation: MLP activation, "gelu" or "swiglu".
      mesh, tp_axis, cp_axis, data_axis, sequence_parallel, num_kv_heads,
        head_dim, causal, layout, rope_theta, window, logit_softcap, use_bias,
        dtype, param_dtype, kernel_init, bias_init, implementation: as in
        `ParallelSelfAttention` and `ParallelMLP` (`tp_axis` is the MLP's `axis`).
      rngs: `nnx.Rngs`.

    Example usage::

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("sequence", "model"))
      >>> block = sf.layers.ParallelTransformerBlock(32, 4, 64, num_kv_heads=2, mesh=mesh,
      ...                                            rngs=nnx.Rngs(0))
      >>> block(jnp.ones((2, 16, 32))).shape
      (2, 16, 32)
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        hidden_features: int,
        *,
        mesh,
        norm: str = "rmsnorm",
        norm_eps: float = 1e-6,
        activation: str = "swiglu",
        tp_axis: str = "model",
        cp_axis: str | None = _sharding.DEFAULT_SEQUENCE_AXIS,
        data_axis: str | None = _sharding.DEFAULT_DATA_AXIS,
        sequence_parallel: bool = True,
        use_bias: bool = False,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        **attention_kwargs,
    ):
        mlp_kwargs = {
            k: attention_kwargs[k]
            for k in ("dtype", "precision", "kernel_init", "bias_init", "implementation")
            if k in attention_kwargs
        }
        self.attention = ParallelSelfAttention(
            features,
            num_heads,
            mesh=mesh,
            tp_axis=tp_axis,
            cp_axis=cp_axis,
            data_axis=data_axis,
            sequence_parallel=sequence_parallel,
            use_bias=use_bias,
            param_dtype=param_dtype,
            rngs=rngs,
            **attention_kwargs,
        )
        self.mlp = ParallelMLP(
            features,
            hidden_features,
            activation=activation,
            mesh=mesh,
            axis=tp_axis,
            sequence_parallel=sequence_parallel,
            data_axis=data_axis,
            sequence_axis=cp_axis,
            use_bias=use_bias,
            param_dtype=param_dtype,
            rngs=rngs,
            **mlp_kwargs,
        )
        norm_kwargs = dict(kind=norm, eps=norm_eps, mesh=mesh, param_dtype=param_dtype, rngs=rngs)
        self.norm_1 = Norm(features, **norm_kwargs)
        self.norm_2 = Norm(features, **norm_kwargs)
        self.features = features

    def local(self, x, positions, segment_ids, norm_params, attention_params, mlp_params):
        """Per-shard block (inside `jax.shard_map`)."""
        (s1, b1), (s2, b2) = norm_params
        h = normalize(self.norm_1.kind, x, s1, b1, self.norm_1.eps)
        h = x + self.attention.local(h, positions, segment_ids, *attention_params)
        y = normalize(self.norm_2.kind, h, s2, b2, self.norm_2.eps)
        return h + self.mlp.local(y, *mlp_params)

    def __call__(self, x, *, positions=None, segment_ids=None):
        """`x` `[B, T, features]` -> `[B, T, features]`; arguments as `ParallelSelfAttention`."""
        attention = self.attention
        positions = attention.check_input(x, positions, segment_ids)
        mesh = attention.mesh
        dtype = _sharding.compute_dtype(attention.dtype, x, attention.q_kernel[...])
        attention_values, attention_specs = attention.local_params(dtype)
        mlp_values, mlp_specs = self.mlp.local_params(dtype)
        norm_values = [self.norm_1.params(), self.norm_2.params()]
        norm_specs = [[P(), P()], [P(), P()]]
        spec = attention.io_spec()
        seg_spec = P(attention.data_axis, attention.cp_axis)
        fn = jax.shard_map(
            self.local,
            mesh=mesh,
            in_specs=(spec, P(attention.cp_axis), seg_spec, norm_specs, attention_specs, mlp_specs),
            out_specs=spec,
        )

        def put(values, specs):
            return [
                None if v is None else _sharding.place(v, mesh, s)
                for v, s in zip(values, specs, strict=True)
            ]

        return fn(
            _sharding.place(x.astype(dtype), mesh, spec),
            _sharding.place(positions, mesh, P(attention.cp_axis)),
            None if segment_ids is None else _sharding.place(segment_ids, mesh, seg_spec),
            [put(v, s) for v, s in zip(norm_values, norm_specs, strict=True)],
            put(attention_values, attention_specs),
            put(mlp_values, mlp_specs),
        )
