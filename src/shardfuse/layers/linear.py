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

Activations are `[B, T, F]`: batch over `data_axis` (and `fsdp_axis`), sequence over
`sequence_axis` (the context-parallel axis, the one ring attention runs
over) and, with `sequence_parallel=True` (Megatron sequence parallelism),
also over `model_axis`: `P(data, (sequence, model), None)` between layers.
The same keywords mean the same in every layer of `shardfuse.layers`.

Every layer validates its input eagerly, then runs through one `jax.jit`
per layer configuration (`_sharding.call_compiled`), so eager calls are as
fast as jitted ones after the first. Input rules shared by all layers:
floating-point activations only (integer or bool `x` raises TypeError); an
empty batch or sequence returns an empty output of the right shape.

Defaults: `use_bias=True` and `sequence_parallel=False` make the linear
layers and `ParallelMLP` drop-in replacements for `nnx.Linear` (replicated
activations in and out); the attention layer and the transformer block use
the Llama-style defaults `use_bias=False`, and the block, whose activations
stay sharded from block to block, defaults to `sequence_parallel=True`.
"""

import functools
import inspect
from collections.abc import Callable

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from shardfuse._keywords import renamed_keywords
from shardfuse.layers import _sharding, fsdp
from shardfuse.layers import options as options_lib
from shardfuse.layers.parallel_matmul import column_matmul

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()


class _ParallelLinear(nnx.Module):
    """Shared constructor and call of the linear layers (the subclasses' docstrings say more).

    A subclass adds its specs, its per-shard product (`matmul`) and its one
    layout keyword (`_layer_init`); the parameters both layers take are
    listed here only.
    """

    sharded_features: str  # "out" for column, "in" for row
    # the per-shard product `matmul(x, kernel)`: parallel_matmul's column_matmul or row_matmul
    matmul: Callable

    @options_lib.option_keywords
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        options: options_lib.LayerOptions | None = None,
        use_bias: bool = True,
        kernel_init=default_kernel_init,
        bias_init=default_bias_init,
        rngs: nnx.Rngs,
    ):
        options_lib.configure(self, options)
        mesh = self.mesh
        column = self.sharded_features == "out"
        sharded = out_features if column else in_features
        name = "out_features" if column else "in_features"
        _sharding.check_divisible(name, sharded, mesh, self.model_axis)
        fsdp.check_kernel(
            "in_features" if column else "out_features",
            in_features if column else out_features,
            mesh,
            self.zero,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        make = _sharding.param_maker(rngs, self.param_dtype, mesh)
        self.kernel = make(kernel_init, (in_features, out_features), self.kernel_spec())
        bias_spec = self.bias_spec_for(self.model_axis)
        self.bias = make(bias_init, (out_features,), bias_spec) if use_bias else None

    def _sequence_spec(self, parallel: bool):
        return _sharding.sequence_spec(self.sequence_axis, self.model_axis, parallel)

    def kernel_spec(self):
        """PartitionSpec of `kernel` (with the fsdp axis under zero=3)."""
        dim = 0 if self.sharded_features == "out" else 1  # the dimension model_axis leaves whole
        return fsdp.kernel_spec(self.kernel_spec_for(self.model_axis), self.zero, dim)

    def weight(self, kernel, dtype, like=None):
        """Per shard: this device's kernel in `dtype` (gathered over fsdp under zero=3).

        `like`: the activations it multiplies (`fsdp.gather`'s `like`).
        """
        return fsdp.gather(
            self.zero, kernel, 0 if self.sharded_features == "out" else 1, dtype, like
        )

    def local_params(self, dtype):
        """`[kernel, bias]` and their specs; bias cast to `dtype` (None without one).

        The kernel stays in `param_dtype`: the per-shard function casts it
        (and under zero=3 gathers it, see `weight`), so that its gradient is
        reduced before it is cast back.
        """
        bias = None if self.bias is None else self.bias[...].astype(dtype)
        return [self.kernel[...], bias], [self.kernel_spec(), self.bias_spec_for(self.model_axis)]

    def local(self, x, kernel, bias=None):
        """Per-shard computation (inside `jax.shard_map` over the layer's mesh)."""
        y = self.matmul(x, self.weight(kernel, x.dtype, x))
        return checkpoint_name(y if bias is None else y + bias, "linear")

    def _check(self, x):
        """Validates `x` `[B, T, in]` (before any tracing)."""
        _sharding.check_activations(x)
        if x.ndim != 3:
            raise ValueError(f"x has shape {x.shape}; expected [B, T, {self.in_features}]")
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x has {x.shape[-1]} features (shape {x.shape}); "
                f"expected in_features={self.in_features}"
            )
        B, T = x.shape[:2]
        sequence = self._sequence_spec(self.sequence_parallel)
        _sharding.check_divisible("sequence length T", T, self.mesh, sequence)
        _sharding.check_divisible("batch size B", B, self.mesh, self.batch_axes)

    def _run(self, local, x, in_spec, out_spec):
        dtype = _sharding.compute_dtype(self.dtype, x, self.kernel[...])
        x = x.astype(dtype)
        if x.size == 0:  # empty batch or sequence: nothing to compute or communicate
            shape = (*x.shape[:-1], self.out_features)
            return _sharding.empty_output(x, shape, self.mesh, out_spec)
        values, specs = self.local_params(dtype)
        local = fsdp.reshard_after_forward(local, self.zero)
        return _sharding.shard_map_call(local, self.mesh, [x, *values], [in_spec, *specs], out_spec)

    def __call__(self, x):
        """`x` `[B, T, in]` -> `[B, T, out]`, sharded as `output_spec()`.

        Raises:
          TypeError: `x` is not floating point.
          ValueError: wrong shape, or B / T not divisible by their mesh axes.
        """
        self._check(x)
        return _sharding.call_compiled(self, "forward", x)


def _layer_init(own_init):
    """Decorator: a linear layer's `__init__` from the keywords it adds to the shared ones.

    `own_init(self, *, flag=default)` stores what is the layer's own (its
    layout flag); the decorated `__init__` takes `_ParallelLinear.__init__`'s
    parameters (sizes, `options` and the option keywords, `use_bias`, the
    initializers, `rngs`) together with `own_init`'s, builds the shared part,
    then calls `own_init`. `help()` and `inspect.signature` list every keyword;
    `axis` stays the deprecated spelling of `model_axis`.
    """
    shared = inspect.signature(_ParallelLinear.__init__)
    own = [p for p in inspect.signature(own_init).parameters.values() if p.kind is p.KEYWORD_ONLY]

    @functools.wraps(own_init)
    def __init__(self, *args, **kwargs):
        own_kwargs = {p.name: kwargs.pop(p.name) for p in own if p.name in kwargs}
        _ParallelLinear.__init__(self, *args, **kwargs)
        own_init(self, **own_kwargs)

    params = list(shared.parameters.values())
    at = next(i for i, p in enumerate(params) if p.name == "use_bias")
    __init__.__signature__ = shared.replace(parameters=[*params[:at], *own, *params[at:]])
    return renamed_keywords(axis="model_axis")(__init__)


class ColumnParallelLinear(_ParallelLinear):
    """`y = x @ W + b` with W split by output features over `model_axis`.

    Parameters: `kernel` `[in, out]` with `P(None, model)`, `bias` `[out]` with
    `P(model)`. Input `[B, T, in]`: `P(data, sequence, None)`, or with
    `sequence_parallel=True` sequence-sharded over `model_axis` too,
    `P(data, (sequence, model), None)`, in which case the all-gather of the
    sequence is fused with the matmul (`all_gather_matmul`). Output
    `[B, T, out]`: `P(data, sequence, model)`, or `P(data, sequence, None)` with
    `gather_output=True`. Integer or bool `x` raises TypeError; an empty batch
    gives an empty output.

    Args:
      in_features, out_features: sizes; `out_features` divisible by the
        size of `model_axis`.
      gather_output: all-gather the output features (replicated output).
      options: the `LayerOptions` shared by the layers of a model (mesh, axes,
        ZeRO, dtypes, precision, implementation); None: the defaults. Each
        option keyword below overrides its field (not given: the field
        stands; `shardfuse.layers.options` has the rule).
      mesh: the `jax.sharding.Mesh` (Explicit or Auto axes; `jax.set_mesh` is
        not needed).
      model_axis: the tensor-parallel mesh axis (deprecated spelling: `axis`).
      sequence_parallel: Megatron sequence parallelism: the sequence is sharded
        over `model_axis` too (besides `sequence_axis`). Default False, as a
        drop-in for `nnx.Linear` on replicated activations.
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in
        `nnx.Linear` (`dtype` = compute dtype, `param_dtype` = storage dtype,
        `precision` of the matmuls; None: HIGHEST for float32, DEFAULT for
        16-bit). `use_bias=True` as in `nnx.Linear`.
      data_axis: mesh axis of the batch.
      sequence_axis: the context-parallel mesh axis the sequence is sharded
        over (the axis ring attention runs over). The defaults of `data_axis`
        and `sequence_axis` are ignored when the mesh lacks them; None: not
        sharded.
      implementation: matmul / collective implementation (None: best).
      zero, fsdp_axis, reshard_after_forward, reduce_dtype: ZeRO stage (0-3)
        over `fsdp_axis` (default "fsdp", ignored when the mesh lacks it; the
        batch is split over `(data_axis, fsdp_axis)`); zero=3 also shards the
        kernel over it, gathered just in time (dropped after the forward
        unless `reshard_after_forward=False`), its gradient reduce-scattered
        in `reduce_dtype` (float32; None: compute dtype). See `layers.fsdp`.
      rngs: `nnx.Rngs` for the initializers.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2,), ("model",))
      >>> layer = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
      >>> y = layer(jnp.ones((2, 8, 16)))
      >>> y.shape, y.sharding.spec
      ((2, 8, 32), P(None, None, 'model'))
    """

    sharded_features = "out"

    @staticmethod
    def kernel_spec_for(axis):
        return P(None, axis)

    @staticmethod
    def bias_spec_for(axis):
        return P(axis)

    matmul = column_matmul

    @_layer_init
    def __init__(self, *, gather_output: bool = False):
        self.gather_output = bool(gather_output)

    def output_spec(self):
        """PartitionSpec of the `[B, T, out]` output."""
        features = None if self.gather_output else self.model_axis
        return P(self.batch_axes, self._sequence_spec(False), features)

    def forward(self, x):
        """`__call__` without the input checks (traced by `call_compiled`)."""
        in_spec = P(self.batch_axes, self._sequence_spec(self.sequence_parallel), None)
        out_spec = P(self.batch_axes, self._sequence_spec(False), self.model_axis)
        y = self._run(self.local, x, in_spec, out_spec)
        if self.model_axis is None:
            return y
        if self.gather_output and _sharding.in_manual_region(self.mesh):  # per shard
            y = jax.lax.all_gather(y, self.model_axis, axis=y.ndim - 1, tiled=True)
        elif self.gather_output:  # XLA's all-gather of the feature shards
            y = _sharding.place(y, self.mesh, self.output_spec())
        return y


# RowParallelLinear lives in row_linear.py, which builds on this module (not the reverse).
__all__ = ["ColumnParallelLinear", "default_bias_init", "default_kernel_init"]
