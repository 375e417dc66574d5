"""Flax NNX layers that wrap `jax.shard_map` around the collectives.

Data flows one way: layers -> collectives -> kernels. Each layer holds its
parameters (created already sharded, with `nnx.get_partition_spec`-visible
specs) and a mesh, and calls per-shard collectives inside `jax.shard_map`.
`shardfuse.layers.reference` holds unsharded single-device references.

Every layer works eagerly (one compiled program per layer configuration,
reused from the second call on), under `nnx.jit`, `jax.jit` (through
`nnx.split` / `nnx.merge`) and `nnx.grad`, on meshes with Explicit or Auto
axes, with or without `jax.set_mesh`.

Options. The settings every layer shares (mesh, axis names `model_axis`
(tensor parallel), `sequence_axis` (context parallel), `data_axis` (batch),
`fsdp_axis`; ZeRO; remat; dtypes; precision; implementations) are the fields
of one frozen `LayerOptions`: build it once and pass `options=` to every
layer; a composite layer hands it to its children. Each field is also a
keyword of every layer, overriding the options it is given
(`shardfuse.layers.options`).

`place_on_mesh` readies an `nnx.Optimizer` so that a jitted training step
compiles once (parameters are created in `canonical_spec` form, the form a
jitted step returns them in).
"""

from shardfuse.layers import moe, options, reference, remat, router
from shardfuse.layers._sharding import (
    canonical_spec,
    in_manual_region,
    place,
    place_on_mesh,
    sharded_param,
)
from shardfuse.layers.attention import ParallelSelfAttention
from shardfuse.layers.block import Norm, ParallelTransformerBlock
from shardfuse.layers.linear import ColumnParallelLinear
from shardfuse.layers.loss import token_loss
from shardfuse.layers.mlp import ParallelMLP
from shardfuse.layers.moe import MoEStats, ParallelMoE, moe_aux_loss, moe_stats
from shardfuse.layers.options import LayerOptions
from shardfuse.layers.row_linear import RowParallelLinear
from shardfuse.layers.stack import Stack

__all__ = [
    "ColumnParallelLinear",
    "LayerOptions",
    "MoEStats",
    "Norm",
    "ParallelMLP",
    "ParallelMoE",
    "ParallelSelfAttention",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "Stack",
    "canonical_spec",
    "in_manual_region",
    "moe",
    "moe_aux_loss",
    "moe_stats",
    "options",
    "place",
    "place_on_mesh",
    "reference",
    "remat",
    "router",
    "sharded_param",
    "token_loss",
]
