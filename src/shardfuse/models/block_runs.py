"""The blocks of a `ModelSpec` as `Stack`s: one per run of blocks of the same kind.

A dense model, or one whose every block is a mixture of experts, is one `Stack` (one
layer scan). A spec mixing the two (DeepSeek's first dense blocks, `moe_first_dense`;
Qwen2-MoE's every n-th, `moe_every`) has blocks of two parameter structures, which one
scan cannot stack; a spec with a sliding window on some blocks only (`window_layers`:
gpt-oss's alternate layers) has blocks of two static attention masks, which one scan
cannot compile either. The blocks split into maximal runs of one kind (`block_runs(spec)`:
MoE or not, windowed or not), each run its own `Stack`, applied in order by `BlockRuns`.
"""

import itertools
from typing import NamedTuple

from flax import nnx

from shardfuse.model_spec import ModelSpec


class BlockRun(NamedTuple):
    """`count` consecutive blocks of one kind: a mixture of experts or not, windowed or not."""

    is_moe: bool
    windowed: bool
    count: int


def block_runs(spec: ModelSpec) -> list[BlockRun]:
    """The spec's blocks as maximal runs of one kind (`BlockRun`s), in order.

    Example:
      >>> from shardfuse.models import ModelSpec
      >>> block_runs(ModelSpec.tiny(num_layers=4))
      [BlockRun(is_moe=False, windowed=False, count=4)]
      >>> [r.count for r in block_runs(ModelSpec.tiny(num_layers=4, experts=4, top_k=2,
      ...                                             moe_first_dense=1))]
      [1, 3]
      >>> [r.windowed for r in block_runs(ModelSpec.tiny(num_layers=3, window=8,
      ...                                                window_layers=(0, 2)))]
      [True, False, True]
    """
    kinds = [
        (spec.is_moe_layer(i), spec.layer_window(i) is not None) for i in range(spec.num_layers)
    ]
    return [BlockRun(*kind, len(list(run))) for kind, run in itertools.groupby(kinds)]


def moe_keywords(
    spec: ModelSpec, capacity_factor: float | None = None, dispatch_chunks: int = 1
) -> dict:
    """The `ParallelMoE` keywords of the spec's MoE blocks (`ParallelTransformerBlock(moe=...)`),
    with the run's `capacity_factor` and `dispatch_chunks` (`RunOptions`).

    Example:
      >>> from shardfuse.models import ModelSpec
      >>> moe_keywords(ModelSpec.tiny(experts=8, top_k=2))["num_experts"]
      8
    """
    groups = spec.expert_groups > 1
    keywords = dict(
        num_experts=spec.experts,
        top_k=spec.top_k,
        routing=spec.routing,
        normalize_top_k=spec.normalize_top_k,
        n_groups=spec.expert_groups if groups else None,
        topk_groups=spec.topk_groups if groups else None,
        routed_scaling=float(spec.routed_scaling),
        shared_experts=spec.shared_experts,
        shared_expert_gate=spec.shared_expert_gate,
        capacity_factor=capacity_factor,
        expert_bias=spec.expert_bias,
    )
    if spec.shared_experts:
        keywords["shared_hidden"] = spec.shared_experts * spec.shared_expert_ffn_hidden
    if dispatch_chunks != 1:
        keywords["dispatch_chunks"] = dispatch_chunks
    return keywords


class BlockRuns(nnx.Module):
    """`Stack`s applied in order (`runs[0]` first): the blocks of a spec mixing kinds.

    Read like a `Stack` by the model: `features`, `has_moe`, `num_layers` (the sum),
    `io_spec()` (the first run's blocks'), and `__call__(x, **kwargs)`.
    """

    def __init__(self, runs):
        self.runs = nnx.List(runs)
        self.features = runs[0].features
        self.has_moe = any(run.has_moe for run in runs)
        self.num_layers = sum(run.num_layers for run in runs)

    def io_spec(self):
        """The `[B, T, F]` activations' PartitionSpec (every run's blocks share it)."""
        return self.runs[0].blocks.io_spec()

    def __call__(self, x, **kwargs):
        for run in self.runs:
            x = run(x, **kwargs)
        return x


__all__ = ["BlockRun", "BlockRuns", "block_runs", "moe_keywords"]
