"""Ulysses and Ulysses x ring (USP) context parallelism, per shard (inside `jax.shard_map`).

DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System
Optimizations for Enabling Training of Extreme Long Sequence Transformer
Models"): each of the N devices of a mesh axis holds a sequence shard of
q, k, v. One `all_to_all` per tensor trades the sequence shard for a head
shard (`[B, L, H, D]` -> `[B, N L, H / N, D]`), every device runs the
single-device flash attention on the WHOLE sequence for its H / N heads, and
one `all_to_all` per output (out and its float32 lse) trades back. The
sequence after the exchange is the concatenation of the N shards in device
order, so masks are those of the shards' absolute positions; the backward
is the transpose (all-to-alls again, around the kernel's own backward).

GQA: the K kv heads must be split N ways too. When `K % N == 0` they are
scattered like the query heads; otherwise each kv head is repeated
`lcm(K, N) / K` times first (`expand_kv_heads`), so that device j receives
exactly the kv heads its query heads `[j H/N, (j+1) H/N)` read; the repeat's
transpose sums their gradients. H must be a multiple of N.

USP (Fang and Zhao 2024, "USP: A Unified Sequence Parallelism Approach for
Long Context Generative AI"): the sequence is split over two mesh axes, Nr
ring groups of Nu Ulysses devices (device `(r, u)` holds natural shard
`r Nu + u`: ring-major). Ulysses over the Nu devices of a group gives each
a head slice of the group's `Nu L` positions; the ring (`ring.py`) then runs
over the Nr groups. For the zigzag layout the shards are first placed as the
zigzag of all N devices (`relayout.to_ring` over both axes: device i holds
chunks i and 2N-1-i); a group's Nu devices then together hold chunks
`r Nu .. r Nu + Nu - 1` (early) and their mirror images (late): exactly the
group's shard of a zigzag over Nr groups once the gathered chunks are put
in order (`_group_to_ring_order`, a local reshape): no extra communication.
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from shardfuse.collectives.ring_attention import api, blocks, ring


def kv_heads_after_expansion(kv_heads: int, ulysses_size: int) -> int:
    """kv heads once repeated so that `ulysses_size` devices can split them: `lcm(K, N)`.

    Example usage::

      >>> from shardfuse.collectives.ring_attention import ulysses
      >>> [ulysses.kv_heads_after_expansion(k, n) for k, n in ((8, 4), (2, 8), (4, 6))]
      [8, 8, 12]
    """
    return math.lcm(kv_heads, ulysses_size)


def expand_kv_heads(x, ulysses_size: int):
    """`[B, S, K, D]` -> `[B, S, lcm(K, N), D]`, each kv head repeated consecutively.

    Query head h reads kv head `h // (H / K)`, which is expanded head
    `h // (H / lcm(K, N))` (both H and lcm(K, N) are multiples of N and K).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from shardfuse.collectives.ring_attention.ulysses import expand_kv_heads
      >>> k = jnp.arange(2.0).reshape(1, 1, 2, 1)  # kv heads 0 and 1
      >>> expand_kv_heads(k, 4)[0, 0, :, 0].tolist()
      [0.0, 0.0, 1.0, 1.0]
    """
    repeats = kv_heads_after_expansion(x.shape[2], ulysses_size) // x.shape[2]
    return x if repeats == 1 else jnp.repeat(x, repeats, axis=2)


def sequence_to_heads(x, axis_name, *, seq_axis: int = 1, head_axis: int = 2):
    """This device's sequence shard, all heads -> the whole sequence, its 1/N of the heads.

    `[B, L, H, D]` -> `[B, N L, H / N, D]` (inside `jax.shard_map` over `axis_name`);
    the sequence comes in device order, device j gets heads `[j H/N, (j+1) H/N)`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from shardfuse.collectives.ring_attention.ulysses import sequence_to_heads
      >>> mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.shard_map(lambda x: sequence_to_heads(x, "sequence"), mesh=mesh,
      ...                   in_specs=P(None, "sequence"), out_specs=P(None, None, "sequence"))
      >>> x = jnp.zeros((1, 16, 8, 2))
      >>> bool((jax.jit(f)(x) == x).all())  # the same global array, sharded over heads
      True
    """
    return lax.all_to_all(x, axis_name, head_axis, seq_axis, tiled=True)


def heads_to_sequence(x, axis_name, *, seq_axis: int = 1, head_axis: int = 2):
    """The exact inverse of `sequence_to_heads`: `[B, N L, H / N, D]` -> `[B, L, H, D]`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from shardfuse.collectives.ring_attention import ulysses
      >>> mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> def there_and_back(x):
      ...     return ulysses.heads_to_sequence(ulysses.sequence_to_heads(x, "sequence"), "sequence")
      >>> f = jax.shard_map(there_and_back, mesh=mesh, in_specs=P(None, "sequence"),
      ...                   out_specs=P(None, "sequence"))
      >>> x = jax.random.normal(jax.random.key(0), (1, 16, 8, 2))
      >>> bool((jax.jit(f)(x) == x).all())
      True
    """
    return lax.all_to_all(x, axis_name, seq_axis, head_axis, tiled=True)


def _across_heads(axis_name, n, attend, q, k, v, q_seg, kv_seg):
    """Ulysses around `attend(q, k, v, q_seg, kv_seg) -> (out, lse)` on the gathered sequence."""
    with jax.named_scope("ulysses_sequence_to_heads"):
        k, v = expand_kv_heads(k, n), expand_kv_heads(v, n)
        q, k, v = (sequence_to_heads(x, axis_name) for x in (q, k, v))
        if q_seg is not None:  # int32 [B, L]: gathered (no head axis to split)
            q_seg, kv_seg = (
                lax.all_gather(x, axis_name, axis=1, tiled=True) for x in (q_seg, kv_seg)
            )
    out, lse = attend(q, k, v, q_seg, kv_seg)
    with jax.named_scope("ulysses_heads_to_sequence"):
        out = heads_to_sequence(out, axis_name)
        lse = heads_to_sequence(lse, axis_name, seq_axis=2, head_axis=1)  # [B, H, L]
    return out, lse


def ulysses_attention(q, k, v, q_seg, kv_seg, *, axis_name, config, implementation, q_offset: int):
    """Ulysses over `axis_name` on natural-order (contiguous) shards: `(out, lse)` per shard.

    Args:
      q: `[B, T/N, H, D]` this device's query shard (shard i holds `[i T/N, (i+1) T/N)`).
      k, v: `[B, S/N, K, D]`.
      q_seg, kv_seg: int32 `[B, T/N]`, `[B, S/N]` or both None.
      axis_name: the mesh axis (N devices, N dividing H).
      config: the validated `AttentionConfig`.
      implementation: the attention implementation(s), as `sf.flash_attention`.
      q_offset: added to the query positions (`S - T` of the global lengths).

    Returns:
      `(out [B, T/N, H, D], lse f32 [B, H, T/N])`.

    Example usage::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> from shardfuse.kernels.attention import base
      >>> from shardfuse.collectives.ring_attention.ulysses import ulysses_attention
      >>> mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> q = jax.random.normal(jax.random.key(0), (1, 32, 4, 16))
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 32, 2, 16))
      >>> config = base.validate(q, k, v, causal=True, q_positions=None, kv_positions=None,
      ...     q_segment_ids=None, kv_segment_ids=None, window=None, logit_softcap=None,
      ...     scale=None)
      >>> f = jax.shard_map(
      ...     lambda q, k, v: ulysses_attention(q, k, v, None, None, axis_name="sequence",
      ...                                       config=config, implementation=None, q_offset=0),
      ...     mesh=mesh, in_specs=P(None, "sequence"), out_specs=(P(None, "sequence"),
      ...     P(None, None, "sequence")), check_vma=False)
      >>> out, lse = jax.jit(f)(q, k, v)
      >>> bool(jnp.allclose(out, sf.flash_attention(q, k, v, causal=True), atol=1e-5))
      True
    """
    n = lax.axis_size(axis_name)

    def attend(q, k, v, q_seg, kv_seg):
        q_pos = jnp.arange(q.shape[1], dtype=jnp.int32) + q_offset
        kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
        return blocks.attend_whole(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, implementation)

    return _across_heads(axis_name, n, attend, q, k, v, q_seg, kv_seg)


def _group_to_ring_order(x, nu: int, axis: int):
    """Gathered zigzag chunks `[e_0, l_0, e_1, l_1, ..]` -> `[e_0 .. e_{Nu-1}, l_{Nu-1} .. l_0]`.

    `e_u`, `l_u`: the early and late chunk device u of the group held (chunks
    `r Nu + u` and `2N - 1 - r Nu - u`); the result is the group's shard of a
    zigzag over the ring of groups (chunks r and 2 Nr - 1 - r of size Nu c).
    """
    lead, tail, length = x.shape[:axis], x.shape[axis + 1 :], x.shape[axis]
    x = x.reshape(*lead, nu, 2, length // (2 * nu), *tail)
    early = jnp.take(x, 0, axis=axis + 1)  # [.., Nu, c, ..]
    late = jnp.flip(jnp.take(x, 1, axis=axis + 1), axis=axis)
    return jnp.concatenate([early, late], axis=axis).reshape(*lead, length, *tail)


def _ring_order_to_group(x, nu: int, axis: int):
    """The exact inverse of `_group_to_ring_order`."""
    lead, tail, length = x.shape[:axis], x.shape[axis + 1 :], x.shape[axis]
    x = x.reshape(*lead, 2, nu, length // (2 * nu), *tail)
    early = jnp.take(x, 0, axis=axis)
    late = jnp.flip(jnp.take(x, 1, axis=axis), axis=axis)
    return jnp.stack([early, late], axis=axis + 1).reshape(*lead, length, *tail)


def ulysses_ring_attention(
    q,
    k,
    v,
    q_seg,
    kv_seg,
    *,
    ulysses_axis,
    ring_axis,
    layout: str,
    config,
    implementation,
    q_offset: int,
):
    """USP: Ulysses over `ulysses_axis`, then the ring over `ring_axis`: `(out, lse)` per shard.

    The shards are ring-major over `(ring_axis, ulysses_axis)`: for
    layout="contiguous" device `(r, u)` holds natural shard `r Nu + u`; for
    "zigzag", chunks i and 2N-1-i of the 2N-chunk zigzag with
    `i = r Nu + u` (`relayout.to_ring` over both axes). Shapes and arguments
    as `ulysses_attention`; the ring runs `implementation` per step.

    Example usage::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> from shardfuse.kernels.attention import base
      >>> from shardfuse.collectives.ring_attention.ulysses import ulysses_ring_attention
      >>> mesh = jax.make_mesh((2, 4), ("ring", "ulysses"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> q = jax.random.normal(jax.random.key(0), (1, 32, 4, 16))
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 32, 2, 16))
      >>> config = base.validate(q, k, v, causal=True, q_positions=None, kv_positions=None,
      ...     q_segment_ids=None, kv_segment_ids=None, window=None, logit_softcap=None,
      ...     scale=None)
      >>> spec = P(None, ("ring", "ulysses"))  # contiguous: device (r, u) holds shard r * 4 + u
      >>> f = jax.shard_map(
      ...     lambda q, k, v: ulysses_ring_attention(
      ...         q, k, v, None, None, ulysses_axis="ulysses", ring_axis="ring",
      ...         layout="contiguous", config=config, implementation=None, q_offset=0),
      ...     mesh=mesh, in_specs=spec, out_specs=(spec, P(None, None, ("ring", "ulysses"))),
      ...     check_vma=False)
      >>> out, lse = jax.jit(f)(q, k, v)
      >>> bool(jnp.allclose(out, sf.flash_attention(q, k, v, causal=True), atol=1e-5))
      True
    """
    nu, nr = lax.axis_size(ulysses_axis), lax.axis_size(ring_axis)
    zigzag = layout == "zigzag"

    def attend(q, k, v, q_seg, kv_seg):
        if zigzag:
            q, k, v = (_group_to_ring_order(x, nu, 1) for x in (q, k, v))
            if q_seg is not None:
                q_seg, kv_seg = (_group_to_ring_order(x, nu, 1) for x in (q_seg, kv_seg))

        def make_spec(name):
            cfg = ring.aligned_block_sizes(config, layout, name, q.shape[1], k.shape[1])
            return ring.RingSpec(ring_axis, nr, layout, cfg, q_offset, name)

        out, lse = api.run(make_spec, implementation, q, k, v, q_seg, kv_seg)
        if zigzag:
            out, lse = _ring_order_to_group(out, nu, 1), _ring_order_to_group(lse, nu, 2)
        return out, lse

    return _across_heads(ulysses_axis, nu, attend, q, k, v, q_seg, kv_seg)
