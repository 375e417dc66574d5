"""The tile schedule of the tiled grouped matmul kernels (pallas_tpu, triton), and their tiles.

A tiled kernel walks row tiles of `block_m` rows. A group that starts or ends
inside a tile shares that tile with its neighbour, so a tile may be visited
more than once, once per group in it: the megablox scheme (Gale et al.,
MegaBlocks, arXiv:2211.15841), which visits at most one partial tile per group
boundary. `visits` lists the visits in row order as flat int32 arrays of a
static length, computed on the device from (possibly traced) sizes, so one
compiled kernel serves every routing.

- `forward=True` (the forward and the inputs' gradient): the rows are cut into
  segments that cover `[0, M)` exactly: the rows before the local groups, each
  local group, the rows after them. Rows of the first and last segments (other
  shards' groups, rows past the sizes' sum) are written as zeros (group -1), so
  every output row is written by exactly one visit. At most `tiles_m + G + 1`
  visits.
- `forward=False` (the weights' gradient): one segment per local group, an
  empty group visited once (its gradient is written as zeros). At most
  `tiles_m + G` visits.

Visits past the last are padding (`valid == 0`): they repeat the last tile and
group and touch nothing.
"""

import contextlib
import contextvars
import dataclasses
import typing

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of a tiled grouped matmul kernel: rows, contracted elements and columns.

    `None` fields take the backend's default.
    """

    block_m: int | None = None
    block_k: int | None = None
    block_n: int | None = None

    def resolve(self, default: "BlockSizes") -> "BlockSizes":
        """These sizes, each missing one from `default`."""
        return BlockSizes(
            *(getattr(self, f) or getattr(default, f) for f in ("block_m", "block_k", "block_n"))
        )


_BLOCK_SIZES = contextvars.ContextVar("shardfuse_grouped_matmul_block_sizes", default=None)


@contextlib.contextmanager
def block_sizes(sizes: BlockSizes):
    """Tiles for the tiled kernels traced inside the block (tests: several tiles on tiny shapes).

    Example:
      >>> with block_sizes(BlockSizes(block_m=16)):
      ...     current_block_sizes().block_m
      16
    """
    if not isinstance(sizes, BlockSizes):
        raise TypeError(f"sizes must be a BlockSizes, got {type(sizes).__name__}")
    token = _BLOCK_SIZES.set(sizes)
    try:
        yield
    finally:
        _BLOCK_SIZES.reset(token)


def current_block_sizes() -> BlockSizes:
    """The sizes `block_sizes` set, else all None (the backends' defaults)."""
    return _BLOCK_SIZES.get() or BlockSizes()


class Visits(typing.NamedTuple):
    """The row-tile visits of one call, each an int32 `[V]` array (V static).

    Attributes:
      tile: the row tile visited.
      group: the local group whose rows it computes, -1 for rows written as zeros.
      begin, end: that segment's rows `[begin, end)` (the visit's rows are their
        intersection with the tile).
      first: 1 on the first visit of a tile (forward) or of a group (transposed).
      last: 1 on the last visit of a tile or of a group.
      valid: 0 for padding visits.
    """

    tile: jnp.ndarray
    group: jnp.ndarray
    begin: jnp.ndarray
    end: jnp.ndarray
    first: jnp.ndarray
    last: jnp.ndarray
    valid: jnp.ndarray


def max_visits(M: int, G: int, block_m: int, *, forward: bool) -> int:
    """The static number of visits `visits` returns (an upper bound on the real ones)."""
    return -(-M // block_m) + G + (1 if forward else 0)


def visits(sizes, start, M: int, block_m: int, *, forward: bool) -> Visits:
    """The visits of row tiles of `block_m` rows, in row order (see the module docstring).

    Args:
      sizes: `[G]` int32 local group sizes (`base.local_groups`: >= 0, within M).
      start: the local groups' first row (int32 scalar), or None for 0.
      M: rows.
      block_m: rows per tile.
      forward: cover every row (forward) or only the local groups (transposed).

    Example:
      >>> v = visits(jnp.array([3, 0, 6]), None, M=12, block_m=4, forward=True)
      >>> v.tile.tolist(), v.group.tolist()  # rows 9-11 (past the sum) are zeros: group -1
      ([0, 0, 1, 2, 2, 2, 2], [0, 2, 2, 2, -1, -1, -1])
      >>> v.first.tolist(), v.valid.tolist()  # tiles 0 and 2 hold a group boundary
      ([1, 0, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0])
    """
    G = sizes.shape[0]
    tiles_m = -(-M // block_m)
    start = jnp.zeros((), jnp.int32) if start is None else start.astype(jnp.int32)
    ends = start + jnp.cumsum(sizes.astype(jnp.int32))  # [G]
    begins = ends - sizes
    groups = jnp.arange(G, dtype=jnp.int32)
    if forward:  # the rows before, each group, the rows after: [0, M) exactly
        last_row = ends[-1] if G else start
        begins = jnp.concatenate([jnp.zeros((1,), jnp.int32), begins, last_row[None]])
        ends = jnp.concatenate([start[None], ends, jnp.full((1,), M, jnp.int32)])
        groups = jnp.concatenate([jnp.full((1,), -1), groups, jnp.full((1,), -1)]).astype(jnp.int32)
    first_tile = jnp.minimum(begins // block_m, tiles_m - 1)
    end_tile = -(-ends // block_m)  # one past the last tile
    count = jnp.where(ends > begins, end_tile - first_tile, 0 if forward else 1)
    count = count.astype(jnp.int32)
    bounds = jnp.cumsum(count)  # [S]
    total = bounds[-1]
    V = max_visits(M, G, block_m, forward=forward)
    v = jnp.arange(V, dtype=jnp.int32)
    segment = jnp.minimum(jnp.searchsorted(bounds, v, side="right"), count.shape[0] - 1)
    valid = v < total
    last_valid = jnp.maximum(total - 1, 0)
    segment = jnp.where(valid, segment, jnp.searchsorted(bounds, last_valid, side="right"))
    segment = jnp.minimum(segment, count.shape[0] - 1)
    step = jnp.where(valid, v, last_valid) - (bounds[segment] - count[segment])
    tile = (first_tile[segment] + step).astype(jnp.int32)
    group = groups[segment]
    key = tile if forward else group  # what a first / last visit is of
    previous = jnp.concatenate([jnp.full((1,), -2, jnp.int32), key[:-1]])
    following = jnp.concatenate([key[1:], jnp.full((1,), -2, jnp.int32)])
    first = valid & (key != previous)
    last = valid & ((key != following) | (v == last_valid))
    zero = jnp.zeros((), jnp.int32)
    return Visits(
        tile=tile,
        group=jnp.where(valid, group, -1 if forward else group),
        begin=jnp.where(valid, begins[segment], zero),
        end=jnp.where(valid, ends[segment], zero),
        first=first.astype(jnp.int32),
        last=last.astype(jnp.int32),
        valid=valid.astype(jnp.int32),
    )
