"""`ring_attention`, per shard: validation, then the ring over the requested implementation.

Called inside `jax.shard_map` on this device's shard of a sequence that is
already in ring order (`to_ring_layout`). The algorithm is in `ring.py`; the
global wrapper that pads, reorders and calls `shard_map` is in `sharded.py`.
"""

import jax
from jax import lax

from shardfuse.collectives.ring_attention import blocks, layouts, ring
from shardfuse.kernels import registry
from shardfuse.kernels.attention import base


def ring_size(axis_name) -> int:
    """Devices on `axis_name` where this is traced, or a ValueError naming the axes bound here."""
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        try:
            bound = list(jax.sharding.get_abstract_mesh().axis_names)
        except Exception:  # no abstract mesh in this context
            bound = []
        raise ValueError(
            f"axis_name={axis_name!r} is not a mesh axis bound here (axes bound: {bound}); "
            "ring_attention is per shard: call it inside jax.shard_map over a mesh with that "
            "axis, or use sf.ring_attention(..., mesh=...) on global arrays"
        ) from None


FUSED = "pallas_tpu_fused"
_RING_MODULE = "shardfuse.collectives.ring_attention."


def _register():
    """Declares the `ring_attention` op: the ppermute ring over each attention backend's
    blocks, and the fused Pallas TPU ring (`pallas_tpu_fused.py`)."""
    attention = registry.get("attention")
    per_step = [
        registry.Backend(
            name,
            _RING_MODULE + "ring",
            "ring",
            f"ppermute ring (lax loop) running the {name} attention blocks each step",
            backend.status,
        )
        for name, backend in attention.backends.items()
        # A backend that may return no lse (cudnn) cannot run ring steps: they merge lse.
        if "need_lse" not in backend.call_keywords
    ]
    fused = registry.Backend(
        FUSED,
        _RING_MODULE + "pallas_tpu_fused",
        "ring",
        "one Pallas TPU kernel per direction: K/V and dK/dV by remote DMA, double-buffered",
        registry.pallas_tpu_status,
    )
    return registry.register(
        "ring_attention",
        description="context-parallel flash attention: K/V rotate around a mesh axis",
        backends=[*per_step, fused],
        preference=dict(attention.preference),
        default=attention.default,
    )


RING_ATTENTION = _register()


def run(make_spec, implementation, q, k, v, q_seg, kv_seg):
    """Runs the ring with the implementation(s) asked for (`kernels/registry.py`).

    `make_spec(name) -> RingSpec`; `implementation` is None (the attention
    op's platform preference), a name, or a sequence of names tried in order: a
    backend raising NotImplementedError hands over to the next, unless it was
    named alone. An attention backend's name runs `ring.ring` over its blocks;
    "pallas_tpu_fused" runs the fused kernels (`pallas_tpu_fused.ring`, with
    the pallas_tpu blocks' spec). The fallback happens while the forward is
    traced; a backend that refuses only in its backward fails there.
    """

    def call(name):
        if name == FUSED:
            return RING_ATTENTION.load(FUSED)(make_spec("pallas_tpu"), q, k, v, q_seg, kv_seg)
        blocks.load(name)
        return ring.ring(make_spec(name), q, k, v, q_seg, kv_seg)

    if implementation is None:  # the attention op's preference (tests patch that dict)
        implementation = registry.candidates("attention", None)
    return RING_ATTENTION.run(implementation, call)


@base.config_options
def ring_attention(
    q,
    k,
    v,
    axis_name,
    *,
    layout: str = "zigzag",
    q_segment_ids=None,
    kv_segment_ids=None,
    return_lse: bool = False,
    implementation=None,
    **options,
):
    """Context-parallel flash attention over the ring `axis_name`, per shard (inside `shard_map`).

    Each of the N devices on `axis_name` holds a shard of a global sequence
    in ring order (`sf.to_ring_layout(x, N, layout)`, sharded evenly over the
    axis). K/V rotate N steps around the ring, sent while the current block
    computes; partial results merge through a float32 lse. The backward is a
    second ring (`jax.custom_vjp`) in which float32 dK/dV accumulators travel
    with K/V; nothing per step is saved, memory stays O(local length). With
    `causal`, steps that no query of the shard can see skip their compute.

    The result equals `sf.flash_attention` on the gathered global sequence:
    with global lengths `T_g = N * T`, `S_g = N * S`, positions are those of
    `sf.ring_positions` (queries shifted by `S_g - T_g`, bottom-right aligned).

    Args:
      q: `[B, T, H, D]` this device's query shard, float32, bfloat16 or float16.
      k: `[B, S, K, D]` this device's key shard, `H % K == 0`; only the K heads travel.
      v: `[B, S, K, D]` this device's value shard.
      axis_name: the mesh axis of the ring (bound by the enclosing `shard_map`).
      layout: "zigzag" (default), "contiguous" or "striped": how the global
        sequence was laid out (see `sf.to_ring_layout`).
      causal: mask keys after the query's global position.
      q_segment_ids: int `[B, T]` this shard's query segment ids (with `kv_segment_ids`).
      kv_segment_ids: int `[B, S]`; they travel with K/V.
      window: `(left, right)` on global positions, ints >= 0 or None.
      logit_softcap: `softcap * tanh(logits / softcap)`.
      scale: logit scale; default `1 / sqrt(D)`.
      return_lse: also return the float32 lse `[B, H, T]` of the global softmax.
      implementation: the single-device attention of each step (the attention
        backends of `sf.flash_attention`): None (the platform's preference),
        "xla", "reference", "pallas_tpu", "triton"; or "pallas_tpu_fused", the
        whole ring in one Pallas TPU kernel per direction (K/V and dK/dV moved
        by remote DMA from inside the kernel; TPU, or TPU interpret mode on
        CPU; per-device shards that fit in VMEM); or a sequence of them tried
        in order (e.g. `("pallas_tpu_fused", "pallas_tpu")`).
      block_sizes: tile sizes passed to that implementation; default: its own
        (for zigzag on xla, tiles aligned to the two chunks of a shard).

    Returns:
      `out` `[B, T, H, D]` in q's dtype, or `(out, lse)` with `return_lse=True`.

    Raises:
      ValueError: invalid shapes, heads, window, softcap, scale, layout or
        implementation; an `axis_name` not bound here; zigzag with an odd
        local length (the global length must be a multiple of 2N).
      TypeError: unsupported or mismatched dtypes.
      NotImplementedError: the named implementation cannot run these inputs
        here (with None or a sequence: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(jax.devices()[:4], ("sequence",))
      >>> q = jax.random.normal(jax.random.key(0), (1, 64, 4, 32))
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 64, 2, 32))
      >>> to_ring = lambda x: jax.device_put(
      ...     sf.to_ring_layout(x, 4, "zigzag"), NamedSharding(mesh, P(None, "sequence")))
      >>> f = jax.shard_map(
      ...     lambda q, k, v: sf.collectives.ring_attention(
      ...         q, k, v, "sequence", layout="zigzag", causal=True),
      ...     mesh=mesh, in_specs=P(None, "sequence"), out_specs=P(None, "sequence"))
      >>> out = sf.from_ring_layout(jax.jit(f)(to_ring(q), to_ring(k), to_ring(v)), 4, "zigzag")
      >>> out.shape
      (1, 64, 4, 32)
    """
    config, q, k, v = base.validate_arrays(
        q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, **options
    )
    layouts.check_layout(layout)
    RING_ATTENTION.candidates(implementation)  # an unknown name fails before tracing
    n = ring_size(axis_name)
    B, T, H, D = q.shape
    S = k.shape[1]
    if layout == "zigzag" and (T % 2 or S % 2):
        raise ValueError(
            f"layout='zigzag' needs even local lengths (global lengths multiples of 2 x ring "
            f"size = {2 * n}); got local q length T={T} and kv length S={S}. Pad the sequence, "
            "or use sf.ring_attention(..., mesh=...), which pads"
        )
    if B == 0 or T == 0 or S == 0:
        return base.empty_result(q, return_lse)

    def make_spec(name):
        cfg = ring.aligned_block_sizes(config, layout, name, T, S)
        return ring.RingSpec(axis_name, n, layout, cfg, n * S - n * T, name)

    out, lse = run(make_spec, implementation, q, k, v, q_segment_ids, kv_segment_ids)
    return (out, lse) if return_lse else out
