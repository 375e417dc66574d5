"""Flax NNX layers that wrap `jax.shard_map` around the collectives.

Data flows one way: layers -> collectives -> kernels. Each layer holds its
parameters (created already sharded, with `nnx.get_partition_spec`-visible
specs) and a mesh, and calls per-shard collectives inside `jax.shard_map`.
`shardfuse.layers.reference` holds unsharded single-device references.
"""

from shardfuse.layers import reference
from shardfuse.layers.attention import ParallelSelfAttention
from shardfuse.layers.block import Norm, ParallelTransformerBlock
from shardfuse.layers.linear import ColumnParallelLinear, RowParallelLinear
from shardfuse.layers.mlp import ParallelMLP

__all__ = [
    "ColumnParallelLinear",
    "Norm",
    "ParallelMLP",
    "ParallelSelfAttention",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "reference",
]
