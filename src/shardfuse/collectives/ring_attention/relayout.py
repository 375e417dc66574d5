"""Per-shard conversion between natural order and ring order (inside `shard_map`).

`to_ring_layout` on a global array is a reshape the SPMD partitioner may
implement with extra copies or an all-gather. Here each device holds its
natural-order shard (positions `[d L, (d + 1) L)`) and the data moves with
the fewest collectives:

- zigzag: the local shard is natural chunks 2d and 2d + 1 of size L / 2;
  chunk j belongs to device j (j < N) or 2N-1-j. Even chunks go to distinct
  devices, and so do odd ones, so two `ppermute`s of half a shard each do it.
- striped: position p belongs to device p mod N at slot p // N; with L a
  multiple of N that is one `all_to_all` of the shard split N ways.
- contiguous: nothing moves.

`supported` says when these apply; otherwise the caller permutes the global
array (`layouts.to_ring_layout`) and lets the partitioner move it.

`axis_name` may be a tuple of mesh axes (USP: `(ring, ulysses)`, ring-major):
device d is then `lax.axis_index(axis_name)`, the linear index over the axes
in the order given, as a PartitionSpec entry `(ring, ulysses)` shards the
sequence. `lax.ppermute` numbers the devices of several axes in the MESH's
axis order instead, whatever order it is given (its replica groups are sorted
by device), so `_ppermute` translates the permutation (see there).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def supported(layout: str, local_lengths, ring_size: int) -> bool:
    """Whether the per-shard conversion handles shards of these local lengths."""
    if layout == "striped":
        return all(length % ring_size == 0 for length in local_lengths)
    if layout == "zigzag":
        return all(length % 2 == 0 for length in local_lengths)
    return True


def _ppermute(x, axis_name, perm):
    """`lax.ppermute(x, axis_name, perm)` with `perm` in `lax.axis_index(axis_name)` numbering.

    Over a tuple of axes listed in another order than the mesh's (mesh
    `("ulysses", "ring")`, axes `("ring", "ulysses")`), `lax.ppermute` would read
    `perm` in mesh-order numbering and send each chunk to the wrong device. The
    permutation is rewritten in mesh order and the axes passed in mesh order, where
    the two numberings agree.
    """
    if isinstance(axis_name, str) or len(axis_name) == 1:
        return lax.ppermute(x, axis_name, perm)
    names = tuple(axis_name)
    mesh_names = jax.sharding.get_abstract_mesh().axis_names
    if not set(names) <= set(mesh_names):  # no mesh to read the order from: as given
        return lax.ppermute(x, names, perm)
    ordered = tuple(sorted(names, key=mesh_names.index))
    if ordered == names:
        return lax.ppermute(x, names, perm)
    sizes = dict(zip(names, (lax.axis_size(a) for a in names), strict=True))
    # mesh_index[i]: device i of the given order, numbered in mesh order.
    coords = np.unravel_index(np.arange(np.prod(list(sizes.values()))), list(sizes.values()))
    by_name = dict(zip(names, coords, strict=True))
    mesh_index = np.ravel_multi_index([by_name[a] for a in ordered], [sizes[a] for a in ordered])
    perm = [(int(mesh_index[src]), int(mesh_index[dst])) for src, dst in perm]
    return lax.ppermute(x, ordered, perm)


def _zigzag_owner(chunk: int, n: int) -> int:
    return chunk if chunk < n else 2 * n - 1 - chunk


def _halves(x, axis):
    half = x.shape[axis] // 2
    return lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, None, axis=axis)


def to_ring(x, axis_name, n: int, layout: str, axis: int = 1):
    """This device's natural-order shard -> its ring-order shard (same shape)."""
    if layout == "contiguous" or n == 1 or x.shape[axis] == 0:
        return x
    length = x.shape[axis]
    if layout == "zigzag":
        first, second = _halves(x, axis)  # natural chunks 2d and 2d + 1
        even = _ppermute(first, axis_name, [(d, _zigzag_owner(2 * d, n)) for d in range(n)])
        odd = _ppermute(second, axis_name, [(d, _zigzag_owner(2 * d + 1, n)) for d in range(n)])
        # Device r holds chunks r and 2N-1-r, of opposite parity: r's parity says which is early.
        r_even = lax.axis_index(axis_name) % 2 == 0
        early, late = jnp.where(r_even, even, odd), jnp.where(r_even, odd, even)
        return jnp.concatenate([early, late], axis=axis)
    # striped: slot i = j N + t holds position d L + j N + t, for device t (L % N == 0).
    lead, tail = x.shape[:axis], x.shape[axis + 1 :]
    x = x.reshape(*lead, length // n, n, *tail)  # [.., j, t, ..]
    x = lax.all_to_all(x, axis_name, axis + 1, axis + 1)  # [.., j, d (source), ..]
    return jnp.swapaxes(x, axis, axis + 1).reshape(*lead, length, *tail)  # slot d L/N + j


def from_ring(x, axis_name, n: int, layout: str, axis: int = 1):
    """The exact inverse of `to_ring`: this device's ring-order shard -> natural order."""
    if layout == "contiguous" or n == 1 or x.shape[axis] == 0:
        return x
    length = x.shape[axis]
    if layout == "zigzag":
        early, late = _halves(x, axis)  # chunks r and 2N-1-r
        r_even = lax.axis_index(axis_name) % 2 == 0
        even_chunk, odd_chunk = jnp.where(r_even, early, late), jnp.where(r_even, late, early)

        def even_of(r):
            return r if r % 2 == 0 else 2 * n - 1 - r

        def odd_of(r):
            return 2 * n - 1 - r if r % 2 == 0 else r

        first = _ppermute(even_chunk, axis_name, [(r, even_of(r) // 2) for r in range(n)])
        second = _ppermute(odd_chunk, axis_name, [(r, odd_of(r) // 2) for r in range(n)])
        return jnp.concatenate([first, second], axis=axis)
    lead, tail = x.shape[:axis], x.shape[axis + 1 :]
    x = x.reshape(*lead, n, length // n, *tail)  # [.., d, j, ..]
    x = jnp.swapaxes(x, axis, axis + 1)  # [.., j, d, ..]
    x = lax.all_to_all(x, axis_name, axis + 1, axis + 1)  # [.., j, t (source), ..]
    return x.reshape(*lead, length, *tail)
