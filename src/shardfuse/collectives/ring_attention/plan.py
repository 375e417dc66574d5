"""The static plan of one `sf.ring_attention` call, and `ring_attention_plan`.

`make_plan` validates the mesh axes, layout and strategy, resolves
`strategy=None` by the cost rule of `strategy.py`, and fixes the padded
lengths; the resulting `Plan` is hashable, the jit cache key of the global
wrapper (`sharded.py`). `ring_attention_plan` shows what `strategy=None`
would choose for given inputs, with every strategy's prediction
(`ContextParallelPlan`, from `plan_for_call`).
"""

import dataclasses
import logging
import math
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from shardfuse import axes
from shardfuse.collectives import sharding
from shardfuse.collectives.collective_matmul.cost_model import Hardware
from shardfuse.collectives.ring_attention import api, layouts
from shardfuse.collectives.ring_attention import strategy as strategy_rule
from shardfuse.kernels.attention import api as attention_api
from shardfuse.kernels.attention import base

RULE = (
    "strategy=None: the applicable strategy with the smallest predicted forward + backward "
    "time per device (ties: ring, all_gather, ulysses, ulysses_ring); ulysses needs the heads "
    "per device to divide by the sequence axis size; a tuple of two sequence axes runs "
    "ulysses_ring"
)


@dataclasses.dataclass(frozen=True)
class ContextParallelPlan:
    """What `strategy=None` chooses and why: the choice and every strategy's prediction.

    Attributes:
      strategy: the choice.
      costs: one `StrategyCost` per strategy considered (applicable or not).
      hardware: the figures used.
      rule: the rule, in words.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.collectives.ring_attention import ring_attention_plan
      >>> q = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16)
      >>> k = jax.ShapeDtypeStruct((1, 8192, 8, 128), jnp.bfloat16)
      >>> plan = ring_attention_plan(q, k, mesh=jax.make_mesh((8,), ("sequence",)),
      ...                            causal=True, hardware="h100-sxm")
      >>> plan.strategy, plan.cost("ulysses").ulysses_size
      ('ulysses', 8)
    """

    strategy: str
    costs: tuple
    hardware: Hardware
    rule: str = RULE

    def cost(self, strategy: str) -> strategy_rule.StrategyCost:
        """The `StrategyCost` of `strategy` (KeyError if it was not considered)."""
        for cost in self.costs:
            if cost.strategy == strategy:
                return cost
        raise KeyError(strategy)

    def __str__(self) -> str:
        lines = [f"context parallel on {self.hardware.name}: {self.strategy}", self.rule]
        for c in self.costs:
            note = "" if c.applicable else f"  (not applicable: {c.why_not})"
            lines.append(
                f"  {c.strategy:12} u{c.ulysses_size} x r{c.ring_size}  "
                f"fwd {c.forward_s * 1e6:10.1f} us  bwd {c.backward_s * 1e6:10.1f} us  "
                f"sent {c.bytes_sent / 1e6:9.2f} MB{note}"
            )
        return "\n".join(lines)


def _plan_for(costs, hardware, allowed) -> ContextParallelPlan:
    """A `ContextParallelPlan` from `strategy_costs` output: the choice among `allowed`;
    the strategies outside `allowed` are marked not applicable (needing another mesh)."""
    marked = tuple(
        c
        if c.strategy in allowed or not c.applicable
        else dataclasses.replace(c, applicable=False, why_not=_needs(c.strategy))
        for c in costs
    )
    return ContextParallelPlan(
        strategy_rule.choose(marked, allowed), marked, strategy_rule.resolve_hardware(hardware)
    )


def _needs(strategy: str) -> str:
    if strategy == "ulysses_ring":
        return "needs sequence_axis=(ulysses_axis, ring_axis)"
    return "needs a single sequence axis (sequence_axis a str)"


def plan_for_call(
    q_shape, k_shape, dtype_bytes: int, *, seq_sizes, batch_size: int = 1, head_size: int = 1,
    kv_replicated: bool = False, causal: bool = False, hardware=None,
    latency_us: float | None = None,
) -> ContextParallelPlan:  # fmt: skip
    """The plan of one `sf.ring_attention` call: global shapes, the sizes of its sequence
    axes (one axis: ring / all_gather / ulysses; two, (ulysses, ring): ulysses_ring), and the
    data / model axis sizes that split batch and heads.

    Example usage::

      >>> from shardfuse.collectives.ring_attention.plan import plan_for_call
      >>> plan = plan_for_call((1, 4096, 8, 64), (1, 4096, 2, 64), 2, seq_sizes=(4, 2),
      ...                      hardware="tpu-v5p")
      >>> plan.strategy, plan.cost("ulysses_ring").ring_size
      ('ulysses_ring', 2)
    """
    B, T, H, D = q_shape
    S, K = k_shape[1], k_shape[2]
    n = math.prod(seq_sizes)
    two_axes = len(seq_sizes) == 2
    costs = strategy_rule.strategy_costs(
        batch=max(B // batch_size, 1), seq_len=max(T, 1), kv_seq_len=max(S, 1),
        heads=H // head_size, kv_heads=K if kv_replicated else K // head_size,
        head_dim=max(D, 1), sequence_size=n, ulysses_size=seq_sizes[0] if two_axes else None,
        dtype_bytes=dtype_bytes, causal=causal, hardware=hardware,
        latency_us=latency_us,
    )  # fmt: skip
    allowed = ("ulysses_ring",) if two_axes else ("ring", "all_gather", "ulysses")
    return _plan_for(costs, hardware, allowed)


STRATEGIES = strategy_rule.STRATEGIES  # ("ring", "all_gather", "ulysses", "ulysses_ring")
_LOG = logging.getLogger("shardfuse")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one global call (hashable: the jit cache key).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.kernels.attention import base
      >>> from shardfuse.collectives.ring_attention.plan import make_plan
      >>> q = k = jnp.zeros((1, 30, 4, 8))
      >>> config = base.validate(q, k, k, causal=True, q_positions=None, kv_positions=None,
      ...     q_segment_ids=None, kv_segment_ids=None, window=None, logit_softcap=None,
      ...     scale=None)
      >>> plan = make_plan(q, k, config, mesh=jax.make_mesh((2, 2), ("ring", "u")),
      ...     seq_axis=("u", "ring"), batch_axis=None, head_axis=None, layout="zigzag",
      ...     strategy="ulysses_ring", impl=None)
      >>> plan.seq_spec, plan.lengths  # ring-major; padded to 2 x 4 devices
      (('ring', 'u'), (30, 30, 32, 32))
    """

    mesh: Hashable
    seq_axes: tuple  # as given: (axis,), or (ulysses axis, ring axis)
    batch_axes: tuple | None
    head_axes: tuple | None
    kv_head_axes: tuple | None
    layout: str  # "contiguous" for ulysses: the whole sequence is local, in natural order
    strategy: str
    config: base.AttentionConfig
    implementation: str | None
    lengths: tuple  # (T, S, padded T, padded S)
    pad_by_segment: bool  # padding needs segment ids (not hidden by causality)

    @property
    def seq_spec(self):
        """The sequence dimension's PartitionSpec entry: the axis, or (ring, ulysses) for USP
        (ring-major: a ring group's Ulysses devices hold consecutive shards)."""
        return self.seq_axes[0] if len(self.seq_axes) == 1 else self.seq_axes[::-1]

    @property
    def seq_size(self) -> int:
        return sharding.axes_size(self.mesh, self.seq_axes)


def _check_sequence_axis(seq_axis, strategy):
    if strategy is not None and strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {list(STRATEGIES)} or None")
    if isinstance(seq_axis, str):
        if strategy == "ulysses_ring":
            raise ValueError(
                f"strategy='ulysses_ring' needs sequence_axis=(ulysses_axis, ring_axis), two "
                f"mesh axes; got sequence_axis={seq_axis!r}"
            )
        return (seq_axis,)
    if (
        isinstance(seq_axis, tuple | list)
        and len(seq_axis) == 2
        and all(isinstance(a, str) for a in seq_axis)
    ):
        if strategy not in (None, "ulysses_ring"):
            raise ValueError(
                f"sequence_axis={seq_axis!r} (two axes) runs strategy='ulysses_ring' (or None); "
                f"got strategy={strategy!r}"
            )
        return tuple(seq_axis)
    raise TypeError(
        f"sequence_axis={seq_axis!r} must be one mesh axis name (a str), or two, "
        "(ulysses_axis, ring_axis), for strategy='ulysses_ring'"
    )


def make_plan(
    q, k, config, *, mesh, seq_axis, batch_axis, head_axis, layout, strategy, impl,
    hardware=None, latency_us=None, explain=False,
):  # fmt: skip
    """The `Plan` of one `sf.ring_attention` call (see `Plan` for an example).

    Validates mesh, axes, layout, strategy and divisibility (batch by
    `batch_axis`, heads by `head_axis` and, for Ulysses, by its axis), resolves
    `strategy=None` by the cost rule (logged at DEBUG on the "shardfuse"
    logger), fixes the layout (Ulysses: natural order) and the padded lengths.
    With `explain=True` returns the cost rule's `ContextParallelPlan` instead.

    Raises:
      ValueError, TypeError: as `sf.ring_attention`.
    """
    if not isinstance(mesh, jax.sharding.Mesh | jax.sharding.AbstractMesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    seq_axes = _check_sequence_axis(seq_axis, strategy)
    axes = sharding.check_mesh_axes(
        mesh, sequence_axis=seq_axis, data_axis=batch_axis, model_axis=head_axis
    )
    layouts.check_layout(layout)
    ring_only = set(api.RING_ATTENTION.candidates(impl)) - set(attention_api.ATTENTION.names)
    if isinstance(impl, list):
        impl = tuple(impl)  # hashable: the plan is a jit cache key
    batch_axes, head_axes = axes["data_axis"], axes["model_axis"]
    B, T, H, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    batch_size = sharding.axes_size(mesh, batch_axes)
    head_size = sharding.axes_size(mesh, head_axes)
    if B % batch_size:
        raise ValueError(
            f"batch size B={B} must be a multiple of the {batch_axes} size {batch_size}"
        )
    if H % head_size:
        raise ValueError(f"num heads H={H} must be a multiple of the {head_axes} size {head_size}")
    kv_head_axes = head_axes
    if K % head_size:
        if K != 1:
            raise ValueError(
                f"num kv heads K={K} must be a multiple of the {head_axes} size {head_size} "
                "(or 1: MQA, replicated over it)"
            )
        kv_head_axes = None  # MQA: every head shard reads the one kv head
    if strategy is None or explain:
        choice = plan_for_call(
            q.shape, k.shape, jnp.dtype(q.dtype).itemsize,
            seq_sizes=tuple(mesh.shape[a] for a in seq_axes), batch_size=batch_size,
            head_size=head_size, kv_replicated=kv_head_axes is None, causal=config.causal,
            hardware=hardware, latency_us=latency_us,
        )  # fmt: skip
        if explain:
            return choice
        strategy = choice.strategy
        _LOG.debug("sf.ring_attention(strategy=None) -> %s\n%s", strategy, choice)
    if strategy != "ring" and ring_only:
        raise ValueError(
            f"implementation={impl!r}: {sorted(ring_only)} run the whole ring in one kernel "
            f"(strategy='ring' only); strategy={strategy!r} runs a per-block attention "
            f"implementation, one of {attention_api.ATTENTION.names}"
        )
    if strategy in ("ulysses", "ulysses_ring"):
        ulysses_size = mesh.shape[seq_axes[0]]
        if (H // head_size) % ulysses_size:
            raise ValueError(
                f"strategy={strategy!r}: num heads H={H}"
                + (f" / {head_size} ({head_axes})" if head_size > 1 else "")
                + f" must be a multiple of the Ulysses axis {seq_axes[0]!r} size {ulysses_size} "
                "(each device attends to H / N heads)"
            )
    if strategy == "ulysses":
        layout = "contiguous"  # the all-to-all hands each device the natural-order sequence
    if strategy == "ulysses_ring" and layout == "striped":
        raise ValueError(
            "layout='striped' is not supported with strategy='ulysses_ring': use 'zigzag' "
            "(balanced causal work) or 'contiguous'"
        )
    multiple = sharding.axes_size(mesh, seq_axes) * layouts.shards_per_device(layout)
    padded = (-(-T // multiple) * multiple, -(-S // multiple) * multiple)
    needs_padding = padded != (T, S)
    return Plan(
        mesh=mesh,
        seq_axes=seq_axes,
        batch_axes=batch_axes,
        head_axes=head_axes,
        kv_head_axes=kv_head_axes,
        layout=layout,
        strategy=strategy,
        config=config,
        implementation=impl,
        lengths=(T, S, *padded),
        pad_by_segment=needs_padding and not config.causal,
    )


def ring_attention_plan(
    q, k, v=None, *, mesh, sequence_axis=axes.SEQUENCE, data_axis=None, model_axis=None,
    causal: bool = False, hardware=None, latency_us: float | None = None,
) -> ContextParallelPlan:  # fmt: skip
    """What `sf.ring_attention(q, k, v, strategy=None, ...)` chooses, with every prediction.

    The rule (`strategy.py`): per device, predicted forward + backward time of
    ring, all_gather and ulysses (one sequence axis) or ulysses_ring (two),
    from the per-device sequence length, heads, head dim, dtype, peak FLOP/s
    and link bandwidth (`shardfuse.hardware`); the fastest applicable wins.

    Args:
      q, k, v: as `sf.ring_attention` (arrays or `jax.ShapeDtypeStruct`s; only
        shapes and dtypes are read; v defaults to k).
      mesh, sequence_axis, data_axis, model_axis, causal: as `sf.ring_attention`.
      hardware: None (this chip; where `shardfuse.hardware` does not know it,
        e.g. CPU, the H100 SXM figures), a `shardfuse.hardware` key ("tpu-v5p"),
        "h100_nvlink" / "tpu_v5p_ici", or a `collective_matmul.cost_model.Hardware`.
      latency_us: fixed cost of one collective, µs; None: the link's (`shardfuse.hardware`).

    Returns:
      A `ContextParallelPlan`: `.strategy` (the choice), `.costs` (one
      `StrategyCost` per strategy, with why one is not applicable); `print` it
      for a table.

    Raises:
      ValueError, TypeError: as `sf.ring_attention`; an unknown `hardware`.

    Example usage::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from shardfuse.collectives.ring_attention import ring_attention_plan
      >>> mesh = jax.make_mesh((8,), ("sequence",))
      >>> q = jax.ShapeDtypeStruct((1, 131072, 32, 128), jnp.bfloat16)
      >>> k = jax.ShapeDtypeStruct((1, 131072, 8, 128), jnp.bfloat16)
      >>> plan = ring_attention_plan(q, k, mesh=mesh, causal=True, hardware="h100-sxm")
      >>> plan.strategy in ("ring", "all_gather", "ulysses")
      True
    """
    v = k if v is None else v
    config = base.validate(q, k, v, causal=causal)
    return make_plan(
        q, k, config, mesh=mesh, seq_axis=sequence_axis, batch_axis=data_axis,
        head_axis=model_axis, layout="zigzag", strategy=None, impl=None, hardware=hardware,
        latency_us=latency_us, explain=True,
    )  # fmt: skip
