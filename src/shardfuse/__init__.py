"""shardfuse: fused kernels and drop-in Flax NNX layers for model-parallel transformers.

Example:
  >>> import jax, shardfuse as sf
  >>> q = jax.random.normal(jax.random.key(0), (1, 64, 4, 32))
  >>> k = v = jax.random.normal(jax.random.key(1), (1, 64, 2, 32))
  >>> sf.flash_attention(q, k, v, causal=True).shape
  (1, 64, 4, 32)
"""

from shardfuse import (
    axes,
    collectives,
    flops,
    hardware,
    kernels,
    layers,
    models,
    parallel,
    planner,
    profile,  # callable: sf.profile(step, *args)
)
from shardfuse._info import info
from shardfuse._version import __version__ as __version__
from shardfuse.collectives.ring_attention import from_ring_layout, ring_positions, to_ring_layout
from shardfuse.collectives.ring_attention.plan import ring_attention_plan
from shardfuse.collectives.ring_attention.sharded import ring_attention
from shardfuse.kernels.attention import BlockSizes, attention_reference, flash_attention
from shardfuse.kernels.decode_attention import decode_attention
from shardfuse.kernels.grouped_matmul import grouped_matmul
from shardfuse.kernels.matmul import MatmulBlockSizes, matmul
from shardfuse.models.generation import generate
from shardfuse.planner import plan

__all__ = [
    "BlockSizes",
    "MatmulBlockSizes",
    "attention_reference",
    "axes",
    "collectives",
    "decode_attention",
    "flash_attention",
    "flops",
    "from_ring_layout",
    "generate",
    "grouped_matmul",
    "hardware",
    "info",
    "kernels",
    "layers",
    "matmul",
    "models",
    "parallel",
    "plan",
    "planner",
    "profile",
    "ring_attention",
    "ring_attention_plan",
    "ring_positions",
    "to_ring_layout",
]
