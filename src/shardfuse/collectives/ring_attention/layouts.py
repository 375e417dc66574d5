"""Sequence layouts of a ring: which global positions each device holds.

A ring of N devices splits a sequence of length L into N shards of L / N
positions. For causal attention the split decides the load balance, since a
query sees only earlier keys:

- "contiguous": device r holds positions `[r * L/N, (r + 1) * L/N)`. Simple,
  but under a causal mask device N-1 does about N times the work of device 0
  (max / mean about 2).
- "zigzag": the sequence is cut into 2N chunks of `c = L / 2N` and device r
  holds chunks r and 2N-1-r (an early and a late one), so every device does
  the same causal work (Brandon et al. 2023, "Striped Attention" appendix;
  the "zigzag" ring of ring-flash-attention and Llama 3 context parallelism).
- "striped": device r holds positions `r, r + N, r + 2N, ...` (Brandon et al.
  2023, "Striped Attention: Faster Ring Attention for Causal Transformers").

`to_ring_layout` permutes a natural-order array into ring order (the
concatenation of the shards, device 0 first), so that sharding the result
evenly over the ring gives each device its shard; `from_ring_layout` is the
exact inverse and `ring_positions` says which position each slot holds.
Both are reshapes, flips and transposes, never gathers, so they partition
well when the sequence axis is sharded. On a mesh with Explicit axes (the
default of `jax.make_mesh`), where those reshapes cannot be typed, they run
with the axes made Auto and hand back `x`'s sharding.
"""

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

LAYOUTS = ("contiguous", "zigzag", "striped")


def check_layout(layout) -> str:
    """Returns `layout` if it is one of `LAYOUTS`, else raises ValueError."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {list(LAYOUTS)}")
    return layout


def shards_per_device(layout: str) -> int:
    """Equal chunks each device holds: 2 for zigzag, else 1 (the length must divide N times it)."""
    return 2 if layout == "zigzag" else 1


def _check_ring(seq_len, ring_size, layout, *, what="seq_len"):
    check_layout(layout)
    if isinstance(ring_size, bool) or not isinstance(ring_size, numbers.Integral) or ring_size < 1:
        raise ValueError(f"ring_size={ring_size!r} must be an int >= 1")
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0:
        raise ValueError(f"{what}={seq_len!r} must be an int >= 0")
    multiple = ring_size * shards_per_device(layout)
    if seq_len % multiple:
        how = "2 x ring_size" if layout == "zigzag" else "ring_size"
        raise ValueError(
            f"{what}={seq_len} must be a multiple of {how} = {multiple} for layout={layout!r} "
            f"(pad it, or use the global sf.ring_attention, which pads)"
        )


def shard_positions(index, local_len: int, ring_size: int, layout: str):
    """Global positions held by device `index` of the ring: int32 `[..., local_len]`.

    Args:
      index: device index in the ring, an int or int32 array (traced inside
        `shard_map`, e.g. `lax.axis_index`); its shape broadcasts in front.
      local_len: positions per device (even for zigzag).
      ring_size: N, devices in the ring.
      layout: "contiguous", "zigzag" or "striped".
    """
    index = jnp.asarray(index, jnp.int32)[..., None]
    slot = jnp.arange(local_len, dtype=jnp.int32)  # [L] slot on the device
    if layout == "contiguous":
        return index * local_len + slot
    if layout == "striped":
        return slot * ring_size + index
    chunk = local_len // 2  # zigzag: chunks index and 2N-1-index
    first = slot < chunk
    chunk_index = jnp.where(first, index, 2 * ring_size - 1 - index)
    return chunk_index * chunk + jnp.where(first, slot, slot - chunk)


def ring_positions(seq_len: int, ring_size: int, layout: str):
    """Which global position each device's slots hold: int32 `[ring_size, seq_len // ring_size]`.

    Row r lists the positions device r holds, in its local order; flattened,
    it is the permutation `to_ring_layout` applies (`ring[i] = natural[pos[i]]`).

    Args:
      seq_len: global sequence length, a multiple of `ring_size` (of
        `2 * ring_size` for zigzag).
      ring_size: N, devices in the ring.
      layout: "contiguous", "zigzag" or "striped".

    Returns:
      int32 array `[N, seq_len // N]`.

    Raises:
      ValueError: unknown layout, or `seq_len` not divisible as above.

    Example:
      >>> import shardfuse as sf
      >>> sf.ring_positions(8, 2, "zigzag").tolist()
      [[0, 1, 6, 7], [2, 3, 4, 5]]
      >>> sf.ring_positions(8, 2, "striped").tolist()
      [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    _check_ring(seq_len, ring_size, layout)
    return shard_positions(np.arange(ring_size), seq_len // ring_size, ring_size, layout)


def _check_axis(x, axis):
    if not hasattr(x, "ndim"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis={axis!r} must be an int")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for x of rank {x.ndim}")
    return axis % x.ndim


def _keeping_sharding(permute, x):
    """`permute(x)`, on Explicit mesh axes run as Auto, the result sharded as `x`."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        sharding = x.sharding  # concrete: its mesh has the devices, no context needed
    else:
        sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, NamedSharding) or mesh.empty or not mesh.explicit_axes:
        return permute(x)
    out = NamedSharding(mesh, sharding.spec)
    return jax.sharding.auto_axes(permute, axes=mesh.explicit_axes, out_sharding=out)(x)


def to_ring_layout(x, ring_size: int, layout: str, axis: int = 1):
    """Permutes the sequence axis from natural order into ring order.

    Ring order is the concatenation of the devices' shards (device 0 first),
    each in its local order, so `x` sharded evenly over the ring axis after
    this call gives every device the positions `ring_positions` lists.

    Args:
      x: array with the sequence on `axis` (e.g. `[B, T, H, D]`).
      ring_size: N, devices in the ring.
      layout: "contiguous" (identity), "zigzag" or "striped".
      axis: the sequence axis (default 1).

    Returns:
      An array of `x`'s shape and dtype: `out[..., i, ...] = x[..., pos[i], ...]`
      with `pos = ring_positions(L, ring_size, layout).reshape(-1)`.

    Raises:
      ValueError: unknown layout, bad axis, or a length not divisible by
        `ring_size` (by `2 * ring_size` for zigzag).

    Example:
      >>> import jax.numpy as jnp, shardfuse as sf
      >>> sf.to_ring_layout(jnp.arange(8)[None], 2, "zigzag").tolist()
      [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return _relayout(x, ring_size, layout, axis, _to_ring)


def _relayout(x, ring_size, layout, axis, permute):
    """Checks, then `permute(x, ring_size, layout, axis)` keeping x's sharding (contiguous and
    empty sequences are returned as they are)."""
    axis = _check_axis(x, axis)
    length = x.shape[axis]
    _check_ring(length, ring_size, layout, what=f"x.shape[{axis}]")
    if layout == "contiguous" or length == 0:
        return x
    return _keeping_sharding(lambda x: permute(x, ring_size, layout, axis), x)


def _to_ring(x, n, layout, axis):
    length = x.shape[axis]
    lead, tail = x.shape[:axis], x.shape[axis + 1 :]
    if layout == "striped":  # natural [L/N, N] (slot, device) -> [N, L/N]
        x = x.reshape(*lead, length // n, n, *tail)
        return jnp.swapaxes(x, axis, axis + 1).reshape(*lead, length, *tail)
    # zigzag: natural [2, N, c] -> [N, 2, c] with the second half's chunks reversed.
    x = x.reshape(*lead, 2, n, length // (2 * n), *tail)
    early = jnp.take(x, 0, axis=axis)  # chunks 0 .. N-1
    late = jnp.flip(jnp.take(x, 1, axis=axis), axis=axis)  # chunks 2N-1 .. N
    return jnp.stack([early, late], axis=axis + 1).reshape(*lead, length, *tail)


def from_ring_layout(x, ring_size: int, layout: str, axis: int = 1):
    """The exact inverse of `to_ring_layout`: ring order back to natural order.

    Args:
      x: array with the sequence in ring order on `axis`.
      ring_size: N, devices in the ring.
      layout: "contiguous", "zigzag" or "striped".
      axis: the sequence axis (default 1; 2 for an lse `[B, H, T]`).

    Returns:
      `y` with `to_ring_layout(y, ring_size, layout, axis) == x`, bit for bit.

    Raises:
      ValueError: as `to_ring_layout`.

    Example:
      >>> import jax.numpy as jnp, shardfuse as sf
      >>> x = jnp.arange(12.0).reshape(1, 12)
      >>> y = sf.to_ring_layout(x, 3, "striped")
      >>> bool((sf.from_ring_layout(y, 3, "striped") == x).all())
      True
    """
    return _relayout(x, ring_size, layout, axis, _from_ring)


def _from_ring(x, n, layout, axis):
    length = x.shape[axis]
    lead, tail = x.shape[:axis], x.shape[axis + 1 :]
    if layout == "striped":  # [N, L/N] (device, slot) -> natural [L/N, N]
        x = x.reshape(*lead, n, length // n, *tail)
        return jnp.swapaxes(x, axis, axis + 1).reshape(*lead, length, *tail)
    x = x.reshape(*lead, n, 2, length // (2 * n), *tail)
    early = jnp.take(x, 0, axis=axis + 1)
    late = jnp.flip(jnp.take(x, 1, axis=axis + 1), axis=axis)
    return jnp.stack([early, late], axis=axis).reshape(*lead, length, *tail)
