"""Tensor-parallel MLP: column-parallel up projection, activation, row-parallel down.

With `activation="swiglu"` (Shazeer 2020) the gate and up projections are
fused into one column-parallel kernel `[features, 2 * hidden]` whose columns
interleave per hidden unit, `(gate_0, up_0, gate_1, up_1, ...)`, so that each
tensor-parallel shard holds matching gate and up columns and one matmul (one
all-gather under sequence parallelism) serves both.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse.layers import _sharding
from shardfuse.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    default_bias_init,
    default_kernel_init,
)

ACTIVATIONS = ("gelu", "swiglu")


def activate(activation: str, h):
    """`gelu(h)`, or for swiglu `silu(gate) * up` on interleaved `[..., 2 * hidden]` columns."""
    if activation == "gelu":
        return jax.nn.gelu(h)
    gate, up = h[..., 0::2], h[..., 1::2]
    return jax.nn.silu(gate) * up


class ParallelMLP(nnx.Module):
    """`down(act(up(x)))` with `up` column-parallel and `down` row-parallel over `axis`.

    Input and output `[B, T, features]`: `P(data, sequence, None)`, or with
    `sequence_parallel=True` `P(data, (sequence, axis), None)` (the up
    projection all-gathers, the down projection reduce-scatters, both
    overlapped with their matmuls).

    Args:
      features: model width.
      hidden_features: MLP width, divisible by the size of `axis`.
      activation: "gelu" or "swiglu" (fused, interleaved gate/up kernel).
      mesh, axis, sequence_parallel, use_bias, dtype, param_dtype, precision,
        kernel_init, bias_init, data_axis, sequence_axis, implementation, rngs:
        as in `ColumnParallelLinear`.

    Example usage::

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> mlp = sf.layers.ParallelMLP(16, 64, activation="swiglu", mesh=mesh, rngs=nnx.Rngs(0))
      >>> mlp(jnp.ones((2, 8, 16))).shape
      (2, 8, 16)
    """

    def __init__(
        self,
        features: int,
        hidden_features: int,
        *,
        activation: str = "gelu",
        mesh,
        axis: str = "model",
        sequence_parallel: bool = False,
        use_bias: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        data_axis: str | None = _sharding.DEFAULT_DATA_AXIS,
        sequence_axis: str | None = _sharding.DEFAULT_SEQUENCE_AXIS,
        implementation: str | None = None,
        precision=None,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
        _sharding.require_axis(mesh, axis, "axis")
        _sharding.check_divisible("hidden_features", hidden_features, axis, mesh.shape[axis])
        common = dict(
            mesh=mesh,
            axis=axis,
            sequence_parallel=sequence_parallel,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
            data_axis=data_axis,
            sequence_axis=sequence_axis,
            implementation=implementation,
            precision=precision,
            rngs=rngs,
        )
        self.activation = activation
        self.features = features
        self.hidden_features = hidden_features
        width = 2 * hidden_features if activation == "swiglu" else hidden_features
        self.up = ColumnParallelLinear(features, width, **common)
        self.down = RowParallelLinear(hidden_features, features, **common)

    def local(self, x, up_kernel, up_bias, down_kernel, down_bias):
        """Per-shard MLP (inside `jax.shard_map`); biases may be None."""
        h = self.up.local(x, up_kernel, up_bias)
        return self.down.local(activate(self.activation, h), down_kernel, down_bias)

    def local_params(self, dtype):
        """`(up_kernel, up_bias, down_kernel, down_bias)` cast to `dtype`, and their specs."""
        values, specs = [], []
        for layer in (self.up, self.down):
            values.append(layer.kernel[...].astype(dtype))
            specs.append(layer.kernel_spec_for(layer.axis))
            values.append(None if layer.bias is None else layer.bias[...].astype(dtype))
            specs.append(layer.bias_spec_for(layer.axis))
        return values, specs

    def __call__(self, x):
        """`x` `[B, T, features]` -> `[B, T, features]`."""
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, {self.features}]")
        up = self.up
        dtype = _sharding.compute_dtype(up.dtype, x, up.kernel[...])
        seq = up._sequence_spec(up.sequence_parallel)
        _sharding.check_divisible(
            "sequence length T",
            x.shape[1],
            seq,
            _sharding.axis_size(up.mesh, up.sequence_axis)
            * (_sharding.axis_size(up.mesh, up.axis) if up.sequence_parallel else 1),
        )
        spec = P(up.data_axis, seq, None)
        values, specs = self.local_params(dtype)
        fn = jax.shard_map(self.local, mesh=up.mesh, in_specs=(spec, *specs), out_specs=spec)
        return fn(_sharding.place(x.astype(dtype), up.mesh, spec), *values)
