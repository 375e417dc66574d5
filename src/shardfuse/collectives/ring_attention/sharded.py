"""`sf.ring_attention`: ring attention on global, natural-order arrays over a mesh.

Pads the sequences to a multiple of the ring (2N for zigzag), runs
`jax.shard_map` with the sequence over `sequence_axis` (and batch / heads
over `data_axis` / `model_axis` if asked), moves each natural-order shard into ring order
(`relayout.py`: two ppermutes for zigzag, an all_to_all for striped; or
`to_ring_layout` on the global arrays where those do not apply), and undoes
all of it on the way out. Padding is masked by position where causality already
hides it (a pad key sits after every real query) and otherwise by a segment
id no real query has (`INT32_MIN`), so any length works.

strategy="ring" runs the ring of `ring.py` (K/V travel by `ppermute`,
O(local length) memory); strategy="all_gather" gathers K/V once over the
axis and runs one block per device (less latency for short sequences,
O(global length) memory for K/V), with the same positions and results.
strategy="ulysses" trades the sequence shard for a head shard by all-to-all
and runs one kernel on the whole natural-order sequence (`ulysses.py`; no
relayout); strategy="ulysses_ring" (USP) runs Ulysses over the first of two
sequence axes and the ring over the second, the sequence sharded ring-major.
strategy=None asks the cost rule (`plan.py`, `strategy.py`).

Meshes: the whole computation runs inside one `jax.jit` with the mesh's
Explicit axes made Auto (`collectives/sharding.py`, `run_on_mesh`), so no
`jax.set_mesh` context is needed, eagerly or under any transformation; the
outputs come back sharded over the same axes as the inputs' specs say.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse._keywords import renamed_keywords
from shardfuse.collectives import sharding
from shardfuse.collectives.ring_attention import api, blocks, layouts, relayout, ring, ulysses
from shardfuse.collectives.ring_attention.plan import Plan, make_plan
from shardfuse.kernels.attention import base

PAD_SEGMENT_ID = int(jnp.iinfo(jnp.int32).min)


def _pad_seq(x, length, value=0, mode="constant"):
    pad = length - x.shape[1]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _all_gather_shard(plan, q, k, v, q_seg, kv_seg):
    """strategy="all_gather": gather K/V (ring order) once, one block with global positions."""
    axis, n = plan.seq_axes[0], plan.seq_size
    T, S, Tp, Sp = plan.lengths
    index = lax.axis_index(axis)
    q_pos = layouts.shard_positions(index, q.shape[1], n, plan.layout) + (S - T)
    kv_pos = layouts.shard_positions(jnp.arange(n), Sp // n, n, plan.layout).reshape(-1)
    with jax.named_scope("ring_attention_all_gather_kv"):
        k, v = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
        if kv_seg is not None:
            kv_seg = lax.all_gather(kv_seg, axis, axis=1, tiled=True)
    return blocks.attend_whole(
        plan.config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, plan.implementation
    )


def _ring_shard(plan, q, k, v, q_seg, kv_seg):
    T, S, _, _ = plan.lengths

    def make_spec(name):
        config = ring.aligned_block_sizes(plan.config, plan.layout, name, q.shape[1], k.shape[1])
        return ring.RingSpec(plan.seq_axes[0], plan.seq_size, plan.layout, config, S - T, name)

    return api.run(make_spec, plan.implementation, q, k, v, q_seg, kv_seg)


def _ulysses_shard(plan, q, k, v, q_seg, kv_seg):
    T, S, _, _ = plan.lengths
    options = dict(config=plan.config, implementation=plan.implementation, q_offset=S - T)
    if plan.strategy == "ulysses":
        return ulysses.ulysses_attention(
            q, k, v, q_seg, kv_seg, axis_name=plan.seq_axes[0], **options
        )
    return ulysses.ulysses_ring_attention(
        q, k, v, q_seg, kv_seg, ulysses_axis=plan.seq_axes[0], ring_axis=plan.seq_axes[1],
        layout=plan.layout, **options,
    )  # fmt: skip


_SHARD_FNS = {
    "ring": _ring_shard,
    "all_gather": _all_gather_shard,
    "ulysses": _ulysses_shard,
    "ulysses_ring": _ulysses_shard,
}


def _out_specs(plan, q_shape):
    """Output and lse specs: sharded over the sequence (and batch / heads) axes.

    A length the ring does not divide comes back replicated over the sequence
    axis: a `jax.Array` cannot hold an uneven split.
    """
    B, T, H, D = q_shape
    batch, seq, heads = plan.batch_axes, plan.seq_spec, plan.head_axes
    out = sharding.divisible_spec(plan.mesh, P(batch, seq, heads, None), (B, T, H, D))
    lse = sharding.divisible_spec(plan.mesh, P(batch, heads, seq), (B, H, T))
    return out, lse


@functools.partial(jax.jit, static_argnums=0)
def _global(plan: Plan, q, k, v, q_seg, kv_seg):
    # Every Explicit axis made Auto inside (the pads, layout reshapes and slices below
    # cannot be typed on Explicit axes), the outputs typed sharded on `plan.mesh`.
    run = sharding.run_on_mesh(
        functools.partial(_attend, plan), plan.mesh, _out_specs(plan, q.shape)
    )
    return run(q, k, v, q_seg, kv_seg)


def _attend(plan: Plan, mesh, q, k, v, q_seg, kv_seg):
    """The global computation on `mesh` (`plan.mesh` with Auto axes)."""
    T, S, Tp, Sp = plan.lengths
    n, layout = plan.seq_size, plan.layout
    if plan.pad_by_segment and q_seg is None:
        q_seg = jnp.zeros((q.shape[0], T), jnp.int32)
        kv_seg = jnp.zeros((k.shape[0], S), jnp.int32)
    q, k, v = _pad_seq(q, Tp), _pad_seq(k, Sp), _pad_seq(v, Sp)
    if q_seg is not None:
        # Pad queries keep a real id (no wider id ranges); pad keys get one no query has.
        q_seg = _pad_seq(q_seg.astype(jnp.int32), Tp, mode="edge")
        kv_seg = _pad_seq(kv_seg.astype(jnp.int32), Sp, value=PAD_SEGMENT_ID)
    batch, seq = plan.batch_axes, plan.seq_spec
    # Move natural-order shards into ring order inside the shard_map (two ppermutes or
    # one all_to_all), where possible; else permute the global arrays. USP: the zigzag of
    # all N devices, ring-major over (ring, ulysses) (see ulysses.py).
    per_shard_relayout = relayout.supported(layout, (Tp // n, Sp // n), n)
    if not per_shard_relayout:
        ring_order = lambda x: x if x is None else layouts.to_ring_layout(x, n, layout)  # noqa: E731
        q, k, v, q_seg, kv_seg = map(ring_order, (q, k, v, q_seg, kv_seg))

    q_spec = P(batch, seq, plan.head_axes, None)
    kv_spec = P(batch, seq, plan.kv_head_axes, None)
    seg_spec = P(batch, seq)
    shard = _SHARD_FNS[plan.strategy]
    has_seg = q_seg is not None

    def per_shard(q, k, v, *segs):
        if per_shard_relayout:
            with jax.named_scope("ring_attention_to_ring_layout"):
                q, k, v, *segs = (relayout.to_ring(x, seq, n, layout) for x in (q, k, v, *segs))
        out, lse = shard(plan, q, k, v, *(segs if has_seg else (None, None)))
        if per_shard_relayout:
            with jax.named_scope("ring_attention_from_ring_layout"):
                out = relayout.from_ring(out, seq, n, layout)
                lse = relayout.from_ring(lse, seq, n, layout, axis=2)
        return out, lse

    # check_vma=False: not every block kernel types its loop carries as varying over the
    # mesh axes (the ring itself does, and is tested under check_vma=True).
    out, lse = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, *((seg_spec, seg_spec) if has_seg else ())),
        out_specs=(q_spec, P(batch, plan.head_axes, seq)),
        check_vma=False,
    )(q, k, v, *((q_seg, kv_seg) if has_seg else ()))
    if not per_shard_relayout:
        out = layouts.from_ring_layout(out, n, layout)
        lse = layouts.from_ring_layout(lse, n, layout, axis=2)
    return out[:, :T], lse[:, :, :T]


def _onto_mesh(x, mesh, spec):
    """A concrete array committed to devices outside `mesh` is moved onto it (sharded as `spec`).

    Traced values and arrays already on the mesh's devices pass through (jit moves them).
    """
    if (
        not isinstance(x, jax.Array)
        or isinstance(x, jax.core.Tracer)
        or not isinstance(mesh, jax.sharding.Mesh)
        or not getattr(x, "committed", False)
        or x.sharding.device_set == set(mesh.devices.flat)
    ):
        return x
    return jax.device_put(x, NamedSharding(mesh, sharding.divisible_spec(mesh, spec, x.shape)))


@renamed_keywords(seq_axis="sequence_axis", batch_axis="data_axis", head_axis="model_axis")
@base.config_options
def ring_attention(
    q,
    k,
    v,
    *,
    mesh,
    sequence_axis: str | tuple = axes.SEQUENCE,
    layout: str = "zigzag",
    strategy: str | None = "ring",
    data_axis=None,
    model_axis=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    return_lse: bool = False,
    implementation: str | None = None,
    **options,
):
    """Context-parallel attention on global arrays, the sequence split over `mesh[sequence_axis]`.

    Same result as `sf.flash_attention(q, k, v, ...)` on one device (default
    positions: bottom-right aligned), computed by ring attention over the
    `sequence_axis` devices: inputs and outputs are natural-order global
    arrays; the layout permutation and any padding happen inside. Lengths
    need not divide the ring: they are padded to a multiple of N (2N for
    zigzag) and the padding is masked. Batch and heads may be split over
    other mesh axes at the same time (`data_axis`, `model_axis`); an MQA kv
    head is then replicated over the model axes.

    Works eagerly and under `jax.jit`, `jax.grad` and `jax.vjp`, on meshes
    with Explicit axes (`jax.make_mesh`'s default) or Auto ones, with or
    without `jax.set_mesh(mesh)` (a context mesh, if any, must be `mesh`).
    Inputs may come sharded any way, or not at all; concrete arrays on
    devices outside the mesh are moved onto it.

    Args:
      q: `[B, T, H, D]` queries, float32, bfloat16 or float16.
      k: `[B, S, K, D]` keys, `H % K == 0`.
      v: `[B, S, K, D]` values.
      mesh: the `jax.sharding.Mesh` to run on.
      sequence_axis: mesh axis of the ring (default "sequence"); for
        strategy="ulysses_ring", two axes `(ulysses_axis, ring_axis)`, and the
        sequence is then sharded ring-major, `P(.., (ring_axis, ulysses_axis))`.
      layout: "zigzag" (default: balanced causal work), "contiguous" or "striped"
        (not with "ulysses_ring"; "ulysses" ignores it: its devices see the whole
        sequence in natural order).
      strategy: "ring" (default: K/V rotate by ppermute under the compute, memory
        O(S / N)); "all_gather" (K/V gathered once: fewer, larger messages for short
        sequences, memory O(S)); "ulysses" (all-to-alls trade the sequence shard for
        H / N heads, one kernel on the whole sequence; H per model shard must divide
        by N; kv heads repeated to lcm(K, N) when N does not divide K);
        "ulysses_ring" (USP: Ulysses over the first axis, the ring over the second);
        or None: chosen by the cost rule of `ring_attention_plan` (logged at DEBUG on
        the "shardfuse" logger).
      data_axis: mesh axis name (or tuple of names) the batch is split over,
        or None (default).
      model_axis: mesh axis name (or tuple) the heads are split over, or None (default).
      causal, q_segment_ids, kv_segment_ids, window, logit_softcap, scale,
        return_lse, implementation, block_sizes: as `sf.flash_attention`
        (segment ids are global `[B, T]` / `[B, S]`; `INT32_MIN` is reserved
        for padding).

    Deprecated keywords (one release, with a DeprecationWarning):
      `seq_axis` -> `sequence_axis`, `batch_axis` -> `data_axis`,
      `head_axis` -> `model_axis`. Passing an old and its new name is a TypeError.

    Returns:
      `out` `[B, T, H, D]` in q's dtype, or `(out, lse)` with lse float32 `[B, H, T]`,
      sharded on `mesh`: out as `P(data_axis, sequence_axis, model_axis, None)`
      (USP: `P(data_axis, (ring_axis, ulysses_axis), model_axis, None)`),
      lse as `P(data_axis, model_axis, sequence_axis)`, whatever the inputs'
      shardings (typed Explicit when the inputs are typed on an Explicit mesh or
      a mesh context is set; plain inputs get a sharded but untyped output, so
      that `jax.grad` of a loss on it needs no `jax.set_mesh`). When the ring size does
      not divide T, the sequence dimension is replicated instead (a `jax.Array`
      cannot hold an uneven split): pad T to a multiple of the ring to keep it
      sharded.

    Raises:
      ValueError: invalid attention inputs (as `sf.flash_attention`), an axis
        not in the mesh (the message lists its axes), the same axis used twice,
        batch or heads not divisible by their axes (Ulysses: heads by its axis
        too), unknown layout or strategy, a strategy that does not fit the axes.
      TypeError: unsupported or mismatched dtypes, `mesh` not a Mesh, or both a
        deprecated keyword and its new name.
      NotImplementedError: the implementation cannot run these inputs here.

    Example:
      >>> import jax, shardfuse as sf
      >>> mesh = jax.make_mesh((4,), ("sequence",), devices=jax.devices()[:4])
      >>> q = jax.random.normal(jax.random.key(0), (1, 100, 4, 32))  # 100: padded to 104
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 100, 1, 32))
      >>> out = jax.jit(lambda q, k, v: sf.ring_attention(q, k, v, mesh=mesh, causal=True))(
      ...     q, k, v)
      >>> out.shape, out.sharding.spec
      ((1, 100, 4, 32), P(None, 'sequence'))
    """
    config, q, k, v = base.validate_arrays(
        q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **options
    )
    plan = make_plan(
        q,
        k,
        config,
        mesh=mesh,
        seq_axis=sequence_axis,
        batch_axis=data_axis,
        head_axis=model_axis,
        layout=layout,
        strategy=strategy,
        impl=implementation,
    )
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):
        return base.empty_result(q, return_lse)
    q_spec = P(plan.batch_axes, plan.seq_spec, plan.head_axes, None)
    kv_spec = P(plan.batch_axes, plan.seq_spec, plan.kv_head_axes, None)
    seg_spec = P(plan.batch_axes, plan.seq_spec)
    args = (
        _onto_mesh(q, mesh, q_spec),
        _onto_mesh(k, mesh, kv_spec),
        _onto_mesh(v, mesh, kv_spec),
        _onto_mesh(q_segment_ids, mesh, seg_spec),
        _onto_mesh(kv_segment_ids, mesh, seg_spec),
    )
    out, lse = _global(plan, *args)
    return (out, lse) if return_lse else out
