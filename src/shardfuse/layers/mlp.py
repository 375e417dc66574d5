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
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse._keywords import renamed_keywords
from shardfuse.layers import _sharding, fsdp
from shardfuse.layers import options as options_lib
from shardfuse.layers.linear import ColumnParallelLinear, default_bias_init, default_kernel_init
from shardfuse.layers.row_linear import RowParallelLinear
from shardfuse.model_spec import SWIGLU_ALPHA, SWIGLU_LIMIT

ACTIVATIONS = ("gelu", "swiglu", "swiglu_clamped")


def activate(activation: str, h, *, swiglu_limit: float = SWIGLU_LIMIT,
             swiglu_alpha: float = SWIGLU_ALPHA):  # fmt: skip
    """The MLP activations, the one home of each (dense MLPs, routed and shared experts).

    - "gelu": `gelu(h)`.
    - "swiglu" (Shazeer 2020): on interleaved `[..., 2 * hidden]` columns `(gate_0, up_0,
      gate_1, up_1, ...)`, `silu(gate) * up`.
    - "swiglu_clamped" (gpt-oss, transformers' `GptOssExperts._apply_gate`): the gate
      clamped above at `swiglu_limit`, the up half to `[-swiglu_limit, swiglu_limit]`,
      then `(up + 1) * gate * sigmoid(swiglu_alpha * gate)` (defaults: gpt-oss's 7.0
      and 1.702).

    Example:
      >>> import jax.numpy as jnp
      >>> from shardfuse.layers.mlp import activate
      >>> y = activate("swiglu_clamped", jnp.array([9.0, -9.0]))  # gate 7, up -7
      >>> round(float(y[0]), 3)  # (-7 + 1) x 7 x sigmoid(1.702 x 7)
      -42.0
    """
    if activation == "gelu":
        return jax.nn.gelu(h)
    gate, up = h[..., 0::2], h[..., 1::2]
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    gate = jnp.minimum(gate, swiglu_limit)
    up = jnp.clip(up, -swiglu_limit, swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * swiglu_alpha))


class ParallelMLP(nnx.Module):
    """`down(act(up(x)))` with `up` column-parallel and `down` row-parallel over `model_axis`.

    Input and output `[B, T, features]`: `P(data, sequence, None)`, or with
    `sequence_parallel=True` `P(data, (sequence, model), None)` (the up
    projection all-gathers, the down projection reduce-scatters, both
    overlapped with their matmuls). Integer or bool `x` raises TypeError; an
    empty batch gives an empty output.

    Args:
      features: model width.
      hidden_features: MLP width, divisible by the size of `model_axis`.
      activation: "gelu", "swiglu" (fused, interleaved gate/up kernel) or
        "swiglu_clamped" (gpt-oss's, `activate`).
      swiglu_limit, swiglu_alpha: of "swiglu_clamped" (`activate`).
      options: the `LayerOptions`, handed to both linear layers; None: the
        defaults. The option keywords (`mesh`, `model_axis`, `zero`, ...,
        every field of `LayerOptions`) override its fields.
      mesh, model_axis, sequence_parallel, use_bias, dtype, param_dtype,
        precision, kernel_init, bias_init, data_axis, sequence_axis,
        implementation, zero, fsdp_axis, reshard_after_forward, reduce_dtype,
        rngs: as in `ColumnParallelLinear` (the defaults
        `use_bias=True`, `sequence_parallel=False` match it: replicated
        activations in and out, like two `nnx.Linear`s). `axis` is the
        deprecated spelling of `model_axis`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2,), ("model",))
      >>> mlp = sf.layers.ParallelMLP(16, 64, activation="swiglu", mesh=mesh, rngs=nnx.Rngs(0))
      >>> y = mlp(jnp.ones((2, 8, 16)))
      >>> y.shape, y.sharding.spec
      ((2, 8, 16), P(None, None, None))
    """

    @renamed_keywords(axis="model_axis")
    @options_lib.option_keywords
    def __init__(
        self,
        features: int,
        hidden_features: int,
        *,
        activation: str = "gelu",
        swiglu_limit: float = SWIGLU_LIMIT,
        swiglu_alpha: float = SWIGLU_ALPHA,
        options: options_lib.LayerOptions | None = None,
        use_bias: bool = True,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")
        options = options_lib.with_default_sequence_parallel(options, False)
        mesh = options_lib.require_mesh(options, "ParallelMLP")
        model_axis = _sharding.optional_axis(mesh, options.model_axis, "model_axis", axes.MODEL)
        _sharding.check_divisible("hidden_features", hidden_features, mesh, model_axis)
        self.options = options
        self.activation = activation
        self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)
        self.features = features
        self.hidden_features = hidden_features
        width = hidden_features if activation == "gelu" else 2 * hidden_features
        inits = dict(use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)
        self.up = ColumnParallelLinear(features, width, options=options, **inits)
        self.down = RowParallelLinear(hidden_features, features, options=options, **inits)

    def local(self, x, up_kernel, up_bias, down_kernel, down_bias):
        """Per-shard MLP (inside `jax.shard_map`); biases may be None."""
        h = checkpoint_name(self.up.local(x, up_kernel, up_bias), "mlp_up")
        y = self.down.local(self.activate(h), down_kernel, down_bias)
        return checkpoint_name(y, "mlp_down")

    def activate(self, h):
        """The layer's activation of the up projection `h` (`activate`)."""
        return activate(self.activation, h, swiglu_limit=self.swiglu_limit,
                        swiglu_alpha=self.swiglu_alpha)  # fmt: skip

    def local_params(self, dtype):
        """`(up_kernel, up_bias, down_kernel, down_bias)` and their specs (biases in `dtype`)."""
        up_values, up_specs = self.up.local_params(dtype)
        down_values, down_specs = self.down.local_params(dtype)
        return up_values + down_values, up_specs + down_specs

    def io_spec(self):
        """PartitionSpec of the `[B, T, features]` input and output."""
        return P(self.up.batch_axes, self.up._sequence_spec(self.up.sequence_parallel), None)

    def __call__(self, x):
        """`x` `[B, T, features]` -> `[B, T, features]`, sharded as `io_spec()`.

        Raises:
          TypeError: `x` is not floating point.
          ValueError: wrong shape, or B / T not divisible by their mesh axes.
        """
        _sharding.check_activations(x)
        if x.ndim != 3 or x.shape[-1] != self.features:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, {self.features}]")
        self.up._check(x)
        return _sharding.call_compiled(self, "forward", x)

    def forward(self, x):
        """`__call__` without the input checks (traced by `call_compiled`)."""
        up = self.up
        dtype = _sharding.compute_dtype(up.dtype, x, up.kernel[...])
        spec = self.io_spec()
        x = x.astype(dtype)
        if x.size == 0:
            return _sharding.empty_output(x, x.shape, up.mesh, spec)
        values, specs = self.local_params(dtype)
        local = fsdp.reshard_after_forward(self.local, up.zero)
        return _sharding.shard_map_call(local, up.mesh, [x, *values], [spec, *specs], spec)
