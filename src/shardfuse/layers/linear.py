"""Column- and row-parallel linear layers (Megatron-LM tensor parallelism).

Megatron-LM (Shoeybi et al. 2019) splits a linear layer's kernel over the
tensor-parallel axis: by output columns (`ColumnParallelLinear`, no
communication in the forward unless the input must be gathered) or by input
rows (`RowParallelLinear`, whose partial products must be summed). Megatron
sequence parallelism (Korthikanti et al. 2022) keeps activations between
layers sharded along the sequence over the same axis; the column layer then
all-gathers the sequence and the row layer reduce-scatters it. Both are done
with the overlapped collective matmuls of `shardfuse.collectives`, which hide
the ring transfers behind the chunk matmuls.

Activations are `[B, T, F]`: batch over `data_axis`, sequence over
`sequence_axis` (context parallelism) and, with `sequence_parallel=True`,
also over `axis`: `P(data, (sequence, model), None)` between layers.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse import collectives
from shardfuse.kernels.matmul import base as matmul_base
from shardfuse.kernels.matmul import matmul
from shardfuse.layers import _sharding

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class _ParallelLinear(nnx.Module):
    """Shared constructor: sizes, axes, dtypes, and the kernel and bias parameters."""

    sharded_features: str  # "out" for column, "in" for row

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
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
        self.mesh = mesh
        self.axis = _sharding.require_axis(mesh, axis, "axis")
        self.data_axis = _sharding.optional_axis(
            mesh, data_axis, "data_axis", _sharding.DEFAULT_DATA_AXIS
        )
        self.sequence_axis = _sharding.optional_axis(
            mesh, sequence_axis, "sequence_axis", _sharding.DEFAULT_SEQUENCE_AXIS
        )
        named = [a for a in (self.axis, self.data_axis, self.sequence_axis) if a is not None]
        if len(set(named)) != len(named):
            raise ValueError(
                f"axis={self.axis!r}, data_axis={self.data_axis!r} and "
                f"sequence_axis={self.sequence_axis!r} must be different mesh axes"
            )
        size = _sharding.axis_size(mesh, self.axis)
        sharded = out_features if self.sharded_features == "out" else in_features
        name = "out_features" if self.sharded_features == "out" else "in_features"
        _sharding.check_divisible(name, sharded, self.axis, size)
        self.in_features = in_features
        self.out_features = out_features
        self.sequence_parallel = bool(sequence_parallel)
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.implementation = implementation
        self.precision = matmul_base.check_precision(precision)
        self.kernel = _sharding.sharded_param(
            kernel_init,
            rngs.params(),
            (in_features, out_features),
            param_dtype,
            mesh,
            self.kernel_spec_for(self.axis),
        )
        self.bias = (
            _sharding.sharded_param(
                bias_init,
                rngs.params(),
                (out_features,),
                param_dtype,
                mesh,
                self.bias_spec_for(self.axis),
            )
            if use_bias
            else None
        )

    def _sequence_spec(self, parallel: bool):
        axes = tuple(a for a in (self.sequence_axis, self.axis if parallel else None) if a)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    def _cast(self, x):
        dtype = _sharding.compute_dtype(self.dtype, x, self.kernel[...])
        bias = None if self.bias is None else self.bias[...].astype(dtype)
        return x.astype(dtype), self.kernel[...].astype(dtype), bias

    def _run(self, local, x, in_spec, out_spec):
        if x.ndim != 3:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, {self.in_features}]")
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x has {x.shape[-1]} features (shape {x.shape}); "
                f"expected in_features={self.in_features}"
            )
        B, T = x.shape[:2]
        seq_shards = _sharding.axis_size(self.mesh, self.sequence_axis) * (
            _sharding.axis_size(self.mesh, self.axis) if self.sequence_parallel else 1
        )
        _sharding.check_divisible("sequence length T", T, in_spec[1], seq_shards)
        _sharding.check_divisible(
            "batch size B", B, self.data_axis, _sharding.axis_size(self.mesh, self.data_axis)
        )
        x, kernel, bias = self._cast(x)
        args = [_sharding.place(x, self.mesh, in_spec), kernel]
        specs = [in_spec, self.kernel_spec_for(self.axis)]
        if bias is not None:
            args.append(bias)
            specs.append(self.bias_spec_for(self.axis))
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(specs), out_specs=out_spec)
        return fn(*args)


class ColumnParallelLinear(_ParallelLinear):
    """`y = x @ W + b` with W split by output features over `axis`.

    Parameters: `kernel` `[in, out]` with `P(None, axis)`, `bias` `[out]` with
    `P(axis)`. Input `[B, T, in]`: `P(data, sequence, None)`, or with
    `sequence_parallel=True` sequence-sharded over `axis` too,
    `P(data, (sequence, axis), None)`, in which case the all-gather of the
    sequence is fused with the matmul (`all_gather_matmul`). Output
    `[B, T, out]`: `P(data, sequence, axis)`, or `P(data, sequence, None)` with
    `gather_output=True`.

    Args:
      in_features, out_features: sizes; `out_features` divisible by the axis size.
      mesh: the `jax.sharding.Mesh`.
      axis: the tensor-parallel mesh axis.
      sequence_parallel: input arrives sequence-sharded over `axis`.
      gather_output: all-gather the output features (replicated output).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in
        `nnx.Linear` (`dtype` = compute dtype, `param_dtype` = storage dtype,
        `precision` of the matmuls; None: HIGHEST for float32, DEFAULT for 16-bit).
      data_axis, sequence_axis: mesh axes of the batch and (context-parallel)
        sequence; the defaults are ignored when the mesh lacks them.
      implementation: matmul / collective implementation (None: best).
      rngs: `nnx.Rngs` for the initializers.

    Example usage::

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> layer = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 8, 16))).shape
      (2, 8, 32)
    """

    sharded_features = "out"

    @staticmethod
    def kernel_spec_for(axis):
        return P(None, axis)

    @staticmethod
    def bias_spec_for(axis):
        return P(axis)

    def __init__(
        self, in_features: int, out_features: int, *, gather_output: bool = False, **kwargs
    ):
        super().__init__(in_features, out_features, **kwargs)
        self.gather_output = bool(gather_output)

    def local(self, x, kernel, bias=None):
        """Per-shard computation (inside `jax.shard_map` over the layer's mesh)."""
        if self.sequence_parallel:
            y = collectives.all_gather_matmul(
                x,
                kernel,
                self.axis,
                gather_axis=x.ndim - 2,
                implementation=self.implementation,
                precision=self.precision,
            )
        else:
            y = matmul(x, kernel, implementation=self.implementation, precision=self.precision)
        if bias is not None:
            y = y + bias
        return y

    def __call__(self, x):
        """`x` `[B, T, in]` -> `[B, T, out]` (sharding as in the class docstring)."""
        in_spec = P(self.data_axis, self._sequence_spec(self.sequence_parallel), None)
        out_spec = P(self.data_axis, self._sequence_spec(False), self.axis)
        y = self._run(self.local, x, in_spec, out_spec)
        if self.gather_output:  # XLA's all-gather of the feature shards
            y = _sharding.place(y, self.mesh, P(self.data_axis, self._sequence_spec(False), None))
        return y


class RowParallelLinear(_ParallelLinear):
    """`y = x @ W + b` with W split by input features over `axis`; partial sums reduced.

    Parameters: `kernel` `[in, out]` with `P(axis, None)`, `bias` `[out]`
    replicated (added once, after the reduction). Input `[B, T, in]`:
    feature-sharded `P(data, sequence, axis)` (`input_is_parallel=True`, the
    output of a `ColumnParallelLinear`), else replicated and split locally.
    Output `[B, T, out]`: with `sequence_parallel=True` reduce-scattered along
    the sequence (`matmul_reduce_scatter`), `P(data, (sequence, axis), None)`;
    otherwise all-reduced (`matmul_all_reduce`), `P(data, sequence, None)`.

    Args:
      in_features, out_features: sizes; `in_features` divisible by the axis size.
      input_is_parallel: the input is already split by features over `axis`
        (Megatron's flag). Either way the layer places its input on
        `P(data, sequence, axis)` before the shard_map: a feature-sharded input
        stays where it is, a replicated one is sliced locally (no
        communication), so both give the same result; the flag records the
        intended layout.
      Others as `ColumnParallelLinear`.

    Example usage::

      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
      >>> layer = sf.layers.RowParallelLinear(32, 16, mesh=mesh, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 8, 32))).shape
      (2, 8, 16)
    """

    sharded_features = "in"

    @staticmethod
    def kernel_spec_for(axis):
        return P(axis, None)

    @staticmethod
    def bias_spec_for(axis):
        return P()

    def __init__(
        self, in_features: int, out_features: int, *, input_is_parallel: bool = True, **kwargs
    ):
        super().__init__(in_features, out_features, **kwargs)
        self.input_is_parallel = bool(input_is_parallel)

    def local(self, x, kernel, bias=None):
        """Per-shard computation: x `[b, t, in / tp]` (feature shard) -> reduced output."""
        if self.sequence_parallel:
            y = collectives.matmul_reduce_scatter(
                x,
                kernel,
                self.axis,
                scatter_axis=x.ndim - 2,
                implementation=self.implementation,
                precision=self.precision,
            )
        else:
            y = collectives.matmul_all_reduce(
                x, kernel, self.axis, implementation=self.implementation, precision=self.precision
            )
        if bias is not None:
            y = y + bias
        return y

    def __call__(self, x):
        """`x` `[B, T, in]` -> `[B, T, out]` (sharding as in the class docstring)."""
        # A replicated input is simply placed feature-sharded: each device keeps its slice.
        in_spec = P(self.data_axis, self._sequence_spec(False), self.axis)
        out_spec = P(self.data_axis, self._sequence_spec(self.sequence_parallel), None)
        return self._run(self.local, x, in_spec, out_spec)
