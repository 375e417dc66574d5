"""Overlapped collective matmuls: all-gather-matmul, matmul-reduce-scatter, matmul-all-reduce.

Per-shard functions, called inside `jax.shard_map`; `cost_model` predicts how
well the transfers hide behind the matmuls.
"""

from shardfuse.collectives.collective_matmul.api import (
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)

__all__ = ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter"]
