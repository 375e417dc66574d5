"""Ring attention: context-parallel flash attention over a mesh axis, forward and backward.

`ring_attention` (per shard, inside `jax.shard_map`), the layouts that
balance causal work (`to_ring_layout`, `from_ring_layout`, `ring_positions`)
and `ring_balance`, each device's block work under a layout.
"""

from shardfuse.collectives.ring_attention.api import ring_attention
from shardfuse.collectives.ring_attention.balance import RingBalance, ring_balance
from shardfuse.collectives.ring_attention.layouts import (
    LAYOUTS,
    from_ring_layout,
    ring_positions,
    to_ring_layout,
)

__all__ = [
    "LAYOUTS",
    "RingBalance",
    "from_ring_layout",
    "ring_attention",
    "ring_balance",
    "ring_positions",
    "to_ring_layout",
]
