"""The per-shard products of a tensor-parallel layer, with Megatron sequence parallelism.

A kernel split by output columns (`column_matmul`) or by input rows
(`row_matmul`) over the layer's `model_axis`; with `sequence_parallel` the
sequence all-gather or reduce-scatter is fused with the matmul by the
overlapped collective matmuls. Shared by the linear layers and attention's
fused QKV and output projections.
"""

from shardfuse import collectives
from shardfuse.kernels.matmul import matmul


def column_matmul(layer, x, kernel):
    """Per-shard `x @ kernel` of a kernel split by output columns over `layer.model_axis`.

    x `[b, t, C]` -> `[b, t, N / tp]`. Under `layer.sequence_parallel` x is a
    sequence shard `[b, t / tp, C]` and its all-gather over the tensor-parallel
    axis is fused with the matmul (`all_gather_matmul`). `layer` is any layer
    with `model_axis`, `sequence_parallel`, `implementation` and `precision`.
    """
    options = dict(implementation=layer.implementation, precision=layer.precision)
    if layer.sequence_parallel and layer.model_axis is not None:
        return collectives.all_gather_matmul(
            x, kernel, layer.model_axis, gather_axis=x.ndim - 2, **options
        )
    return matmul(x, kernel, **options)


def row_matmul(layer, x, kernel):
    """Per-shard `x @ kernel` of a kernel split by input rows over `layer.model_axis`, summed.

    x `[b, t, C / tp]` -> `[b, t, N]`, the partial products all-reduced
    (`matmul_all_reduce`), or under `layer.sequence_parallel` reduce-scattered
    along the sequence to `[b, t / tp, N]` (`matmul_reduce_scatter`). `layer`
    as in `column_matmul`. Without a model axis (None) a plain matmul.
    """
    options = dict(implementation=layer.implementation, precision=layer.precision)
    if layer.model_axis is None:  # no tensor-parallel axis: nothing to reduce
        return matmul(x, kernel, **options)
    if layer.sequence_parallel:
        return collectives.matmul_reduce_scatter(
            x, kernel, layer.model_axis, scatter_axis=x.ndim - 2, **options
        )
    return collectives.matmul_all_reduce(x, kernel, layer.model_axis, **options)
