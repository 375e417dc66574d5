"""Per-shard multi-device algorithms, called inside `jax.shard_map`."""

from shardfuse.collectives import expert_dispatch
from shardfuse.collectives.collective_matmul import (
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)
from shardfuse.collectives.ring_attention.api import ring_attention

__all__ = [
    "all_gather_matmul",
    "expert_dispatch",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "ring_attention",
]
