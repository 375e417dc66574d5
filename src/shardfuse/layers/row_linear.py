"""`RowParallelLinear`: a linear layer whose kernel is split by input rows over `model_axis`.

The partial products are all-reduced (or, under Megatron sequence
parallelism, reduce-scattered along the sequence) with the overlapped
collective matmuls of `shardfuse.collectives`. The conventions shared with
`ColumnParallelLinear` (activation specs, eager validation, one compiled
program per configuration, ZeRO options) are those of
`shardfuse.layers.linear`, whose base class it extends.
"""

import jax
from jax.sharding import PartitionSpec as P

from shardfuse.layers.linear import _layer_init, _ParallelLinear
from shardfuse.layers.parallel_matmul import row_matmul


class RowParallelLinear(_ParallelLinear):
    """`y = x @ W + b` with W split by input features over `model_axis`; partial sums reduced.

    Parameters: `kernel` `[in, out]` with `P(model, None)`, `bias` `[out]`
    replicated (added once, after the reduction). Input `[B, T, in]`:
    feature-sharded `P(data, sequence, model)` with `input_is_parallel=True`
    (the output of a `ColumnParallelLinear`), or with `input_is_parallel=False`
    all features on every model shard, `P(data, sequence, None)`, each shard
    slicing its own part locally (no communication). Output `[B, T, out]`:
    with `sequence_parallel=True` reduce-scattered along the sequence
    (`matmul_reduce_scatter`), `P(data, (sequence, model), None)`; otherwise
    all-reduced (`matmul_all_reduce`), `P(data, sequence, None)`. Integer or
    bool `x` raises TypeError; an empty batch gives an empty output.

    Args:
      in_features, out_features: sizes; `in_features` divisible by the size
        of `model_axis`.
      input_is_parallel: Megatron's flag: True, `x` arrives split by features
        over `model_axis`; False, `x` holds all `in_features` replicated over
        `model_axis` and each shard slices its part. Both compute the same
        `x @ W + b`; the flag picks the input layout (and so which
        resharding, if any, an input on another layout costs).
      options, use_bias, kernel_init, bias_init, rngs and the option keywords
        (mesh, model_axis, sequence_parallel, dtype, param_dtype, precision,
        data_axis, sequence_axis, implementation, zero, fsdp_axis,
        reshard_after_forward, reduce_dtype): as in `ColumnParallelLinear`
        (`axis` is the deprecated spelling of `model_axis`); zero=3 shards
        the kernel's output dimension over `fsdp_axis`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2,), ("model",))
      >>> up = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
      >>> down = sf.layers.RowParallelLinear(32, 16, mesh=mesh, rngs=nnx.Rngs(1))
      >>> h = up(jnp.ones((2, 8, 16)))  # features split over "model", as `down` takes them
      >>> y = down(h)  # the partial products all-reduced
      >>> h.sharding.spec, y.shape, y.sharding.spec
      (P(None, None, 'model'), (2, 8, 16), P(None, None, None))
    """

    sharded_features = "in"

    @staticmethod
    def kernel_spec_for(axis):
        return P(axis, None)

    @staticmethod
    def bias_spec_for(axis):
        return P()

    matmul = row_matmul

    @_layer_init
    def __init__(self, *, input_is_parallel: bool = True):
        self.input_is_parallel = bool(input_is_parallel)

    def _local_replicated_input(self, x, kernel, bias=None):
        """`local` on a replicated `x` `[b, t, in]`: this shard keeps its slice of the features."""
        part = kernel.shape[0]  # in / tp rows (fsdp shards the other dimension)
        index = 0 if self.model_axis is None else jax.lax.axis_index(self.model_axis)
        x = jax.lax.dynamic_slice_in_dim(x, index * part, part, axis=2)
        return self.local(x, kernel, bias)

    def input_spec(self):
        """PartitionSpec the `[B, T, in]` input is placed on (see `input_is_parallel`)."""
        features = self.model_axis if self.input_is_parallel else None
        return P(self.batch_axes, self._sequence_spec(False), features)

    def output_spec(self):
        """PartitionSpec of the `[B, T, out]` output."""
        return P(self.batch_axes, self._sequence_spec(self.sequence_parallel), None)

    def forward(self, x):
        """`__call__` without the input checks (traced by `call_compiled`)."""
        local = self.local if self.input_is_parallel else self._local_replicated_input
        return self._run(local, x, self.input_spec(), self.output_spec())
