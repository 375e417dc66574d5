"""Ring attention: context-parallel flash attention over a mesh axis, forward and backward.

`ring_attention` (per shard, inside `jax.shard_map`), the layouts that
balance causal work (`to_ring_layout`, `from_ring_layout`, `ring_positions`)
and `ring_balance`, each device's block work under a layout. The global
`sf.ring_attention` (`sharded.py`) also runs Ulysses and Ulysses x ring (USP)
(`ulysses.py`); `ring_attention_plan` shows which strategy `strategy=None`
picks and the cost rule's predictions (`strategy.py`).
"""

from shardfuse.collectives.ring_attention.api import ring_attention
from shardfuse.collectives.ring_attention.balance import RingBalance, ring_balance
from shardfuse.collectives.ring_attention.layouts import (
    LAYOUTS,
    from_ring_layout,
    ring_positions,
    to_ring_layout,
)
from shardfuse.collectives.ring_attention.plan import ContextParallelPlan, ring_attention_plan
from shardfuse.collectives.ring_attention.strategy import StrategyCost

__all__ = [
    "LAYOUTS",
    "ContextParallelPlan",
    "RingBalance",
    "from_ring_layout",
    "ring_attention",
    "ring_attention_plan",
    "ring_balance",
    "ring_positions",
    "StrategyCost",
    "to_ring_layout",
]
