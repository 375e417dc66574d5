"""Expert-parallel dispatch and combine: routed rows to their experts' devices and back.

Per shard (inside `jax.shard_map`, over the expert axis `axis_name` of size EP; device
d holds experts `[d * E / EP, (d + 1) * E / EP)`). Each device starts from its `A`
routed rows (`A = tokens x k` slots), sorted by expert, the rows dropped by a capacity
last with the sentinel expert `E`:

1. `dispatch` sends each row to the device of its expert. Every device receives into a
   buffer of `EP` chunks of `A` rows, chunk s holding what device s sent (its rows
   still sorted by expert), then zeros (`pad_value`), with expert id `E` past them.
2. The caller runs its local experts on the received rows (`sf.grouped_matmul` with
   `group_offset`), returning a result per received row.
3. `combine` sends each result back to the row it came from: `[A, F]` in the order of
   the dispatched rows (zero for dropped rows).

Two implementations, identical results:

- "ragged": `lax.ragged_all_to_all`, sized by the routing: each row crosses the
  network once each way, `2 x A x F x bytes x (EP - 1) / EP` per device on balanced
  routing (plus the `[EP]` counts and offsets exchanged by a small `all_to_all`). The
  receive buffer is still `EP x A` rows (a device may receive every row of every
  device). GPUs and TPUs.
- "dense": a dense `lax.all_to_all` of per-destination buffers padded to the static
  worst case, `A` rows per destination (dropless: all of a device's rows may go to one
  device). It moves `EP` times the ragged bytes, `2 x A x F x bytes x (EP - 1)` per
  device, plus the expert ids as two more columns of the rows' dtype (exact up to
  E = 64 x 256 in bfloat16; beyond, an `EP x A` int32 all-to-all of their own); its send
  and receive buffers are `EP x A x F`. XLA:CPU, which cannot run `ragged_all_to_all`
  (jax#34755); the tests check it against the ragged version's definition and against
  one device.

Neither ever builds a tokens x experts x F or tokens x experts x capacity x F tensor:
the buffers are `EP x A x F` with `A = tokens x k`.

The dense dispatch also takes a smaller `chunk` per destination (`dense_chunk`: twice a
destination's balanced share, `ceil(2 x A / EP)`, where that is below `A`): its buffers
and traffic are then `EP x chunk` rows, `min(EP, 2)` times the ragged bytes instead of
`EP` times. A row past its destination's chunk is not sent; `overflows` says whether any
would be, and the caller (`sf.layers.ParallelMoE`) then runs the full-size dispatch
instead (the same result: dropless either way).
"""

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("ragged", "dense")
_RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def default_implementation(platform: str | None = None) -> str:
    """ "ragged" where `lax.ragged_all_to_all` runs (GPU, TPU), else "dense" (CPU)."""
    platform = jax.default_backend() if platform is None else platform
    return "ragged" if platform in _RAGGED_PLATFORMS else "dense"


def check_implementation(implementation) -> str:
    """`implementation` (None: the platform's), checked; ValueError naming it."""
    if implementation is None:
        return default_implementation()
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dispatch_implementation={implementation!r} must be None (the platform's) or one "
            f"of {IMPLEMENTATIONS}"
        )
    return implementation


def _routing(experts, num_experts: int, ep: int):
    """Destination, position in its chunk, per-destination counts and starts of each row."""
    per_device = num_experts // ep
    dest = experts // per_device  # [A], sorted; the sentinel E gives ep (dropped)
    # Rows bound for the devices before each device, and up to it: one compare-and-count
    # fusion each (a scatter-add and a cumsum, which XLA:CPU runs as several ops, before).
    devices = jnp.arange(ep, dtype=dest.dtype)[:, None]
    starts = jnp.sum(dest[None, :] < devices, axis=1, dtype=jnp.int32)
    counts = jnp.sum(dest[None, :] <= devices, axis=1, dtype=jnp.int32) - starts
    pos = jnp.arange(experts.shape[0], dtype=jnp.int32) - take_rows(
        starts, jnp.minimum(dest, ep - 1)
    )
    return dest, pos, counts, starts


# The dense dispatch's capped chunk: this many times a destination's balanced share.
DENSE_CHUNK_FACTOR = 2


def dense_chunk(rows: int, ep: int) -> int:
    """The dense dispatch's rows per destination for `rows` routed rows a device over an
    expert axis of `ep`: `min(rows, ceil(DENSE_CHUNK_FACTOR x rows / ep))`, twice a
    destination's share on balanced routing (all `rows` where `ep <= 2`).

    Example:
      >>> dense_chunk(128, 4), dense_chunk(128, 2), dense_chunk(5, 8)
      (64, 128, 2)
    """
    return min(rows, -(-DENSE_CHUNK_FACTOR * rows // ep))


def overflows(experts, *, num_experts: int, ep: int, chunk: int):
    """int32 1 if some destination device would get more than `chunk` of the rows whose
    sorted experts are `experts` `[A]` (as `dispatch` takes them), else 0. Per device: the
    caller agrees on it over the expert axis before choosing the dispatch's size."""
    counts = _routing(experts, num_experts, ep)[2]
    return (jnp.max(counts) > chunk).astype(jnp.int32)


def take_rows(x, index):
    """`x[index]` for indices known to be in bounds: a bare gather (no wrapping of
    negative indices, no clamping: each an op of its own on XLA:CPU)."""
    return x.at[index].get(mode="promise_in_bounds", wrap_negative_indices=False)


# The dense dispatch sends each row's expert id as two extra columns of the rows' own
# dtype, `id // 64` and `id % 64` (small integers, exact in every float type up to E =
# 64 x 256 in bfloat16): one all-to-all instead of two (each collective is a rendezvous
# of the group; the ids' own all-to-all was a fifth of the MoE layer's).
_ID_BASE = 64


def _ids_fit(num_experts: int, dtype) -> bool:
    """Whether ids up to `num_experts` survive as `_id_columns` of `dtype` exactly."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    return num_experts // _ID_BASE <= 2 ** (jnp.finfo(dtype).nmant + 1)  # E itself too


def _id_columns(ids, like):
    """`[..., 2]` of `like`'s dtype: the int ids as `(id // 64, id % 64)`, no gradient."""
    ids = ids.astype(jnp.int32)
    cols = jnp.stack([ids // _ID_BASE, ids % _ID_BASE], -1).astype(like.dtype)
    return lax.stop_gradient(cols)


def _read_ids(cols):
    """The int32 ids from `_id_columns`."""
    cols = jnp.round(lax.stop_gradient(cols).astype(jnp.float32)).astype(jnp.int32)
    return cols[..., 0] * _ID_BASE + cols[..., 1]


def _exchange(values, axis_name):
    """`[EP]` per-destination ints -> `[EP]` per-source: what each source has for me."""
    return lax.all_to_all(values[:, None], axis_name, 0, 0, tiled=True)[:, 0]


def dispatch(rows, experts, *, num_experts: int, axis_name, implementation=None, pad_value=0.0,
             chunk: int | None = None):  # fmt: skip
    """Sends each routed row to the device holding its expert.

    Args:
      rows: `[A, F]` this device's routed rows, sorted by expert (dropped rows last).
      experts: `[A]` int32, each row's expert in `[0, E)`, sorted; `E` for a dropped row.
      num_experts: E, divisible by the size EP of `axis_name`.
      axis_name: the expert-parallel mesh axis.
      implementation: "ragged", "dense" or None (`default_implementation`).
      pad_value: the value of the receive buffer's unused rows ("dense": of the send
        buffer's too); the tests poison it with NaN.
      chunk: "dense" only: rows per destination (None: `A`, every row fits); a row past
        its destination's first `chunk` is not sent (`overflows` says whether any is).

    Returns:
      `(received [EP * C, F], received_experts [EP * C] int32, plan)` with `C = chunk`
      (`A` where None): chunk s (`[s * C, (s + 1) * C)`) holds device s's rows for this
      device, sorted by expert, then padding whose expert is `E`; `plan` is `combine`'s.
    """
    implementation = check_implementation(implementation)
    ep = lax.axis_size(axis_name)
    A, F = rows.shape
    dest, pos, counts, starts = _routing(experts, num_experts, ep)
    plan = dict(dest=dest, counts=counts, starts=starts)
    if chunk is not None and implementation != "dense":
        raise ValueError(f"chunk={chunk!r} needs implementation='dense' (got {implementation!r})")
    if implementation == "dense":
        C = A if chunk is None else int(chunk)
        with jax.named_scope("expert_dispatch_dense"):
            fold = _ids_fit(num_experts, rows.dtype)  # the ids ride in the rows' all-to-all
            # Row i goes to flat row `dest * C + pos` of the [EP * C] send buffer (unique
            # positions; a dropped row's, or one past its chunk, lies past the end and is
            # dropped).
            flat = dest * C + pos
            if C < A:  # every row that is not sent at a unique place past the end
                unsent = (pos >= C) | (dest >= ep)
                flat = jnp.where(unsent, ep * C + jnp.arange(A, dtype=flat.dtype), flat)
            plan.update(flat=flat, chunk=C)
            payload, send = rows, jnp.full((ep * C, F), pad_value, rows.dtype)
            if fold:
                payload = jnp.concatenate([rows, _id_columns(experts, rows)], -1)
                padding = _id_columns(jnp.full((ep * C,), num_experts), send)
                send = jnp.concatenate([send, padding], -1)
            send = send.at[flat].set(payload, mode="drop", unique_indices=True)
            send = send.reshape(ep, C, -1)
            received = lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [EP, C, F (+ 2)]
            if fold:
                received_ids, received = _read_ids(received[..., F:]), received[..., :F]
            else:
                ids = jnp.full((ep * C,), num_experts, jnp.int32)
                ids = ids.at[flat].set(experts, mode="drop", unique_indices=True)
                received_ids = lax.all_to_all(ids.reshape(ep, C), axis_name, 0, 0, tiled=True)
        return received.reshape(ep * C, F), received_ids.reshape(ep * C), plan
    recv_counts = plan["recv_counts"] = _exchange(counts, axis_name)
    me = lax.axis_index(axis_name)
    plan["recv_starts"] = _exchange(starts, axis_name)
    with jax.named_scope("expert_dispatch_ragged"):
        out_offsets = jnp.full((ep,), me * A, jnp.int32)  # my chunk in every receiver
        received = lax.ragged_all_to_all(
            rows, jnp.full((ep * A, F), pad_value, rows.dtype), starts, counts, out_offsets,
            recv_counts, axis_name=axis_name,
        )  # fmt: skip
        received_ids = lax.ragged_all_to_all(
            experts[:, None], jnp.full((ep * A, 1), num_experts, jnp.int32), starts, counts,
            out_offsets, recv_counts, axis_name=axis_name,
        )[:, 0]  # fmt: skip
    return received, received_ids, plan


def combine(results, plan: dict, *, axis_name, implementation=None):
    """Sends each received row's result back to where `dispatch` took the row from.

    Args:
      results: `[EP * C, F]`, a result per row of `dispatch`'s receive buffer (those of
        padding rows are never read).
      plan: `dispatch`'s plan.
      axis_name, implementation: as `dispatch` was given.

    Returns:
      `[A, F]`: row i the result of the dispatched row i; zero for dropped rows.
    """
    implementation = check_implementation(implementation)
    ep = lax.axis_size(axis_name)
    A = plan["dest"].shape[0]
    F = results.shape[-1]
    if implementation == "dense":
        C = plan["chunk"]
        with jax.named_scope("expert_combine_dense"):
            back = lax.all_to_all(results.reshape(ep, C, F), axis_name, 0, 0, tiled=True)
            valid = plan["flat"] < ep * C  # not dropped, and inside its chunk
            rows = take_rows(back.reshape(ep * C, F), jnp.where(valid, plan["flat"], 0))
        return jnp.where(valid[:, None], rows, jnp.zeros((), results.dtype))
    with jax.named_scope("expert_combine_ragged"):
        in_offsets = jnp.arange(ep, dtype=jnp.int32) * A
        return lax.ragged_all_to_all(
            results, jnp.zeros((A, F), results.dtype), in_offsets, plan["recv_counts"],
            plan["recv_starts"], plan["counts"], axis_name=axis_name,
        )  # fmt: skip


def combine_transpose(values, plan: dict, *, axis_name):
    """The transpose of the dense `combine`: `values` `[A, F]`, one per dispatched row, to
    the receive buffer's layout `[EP * C, F]` on the rows' expert devices (zeros at the
    padding and for dropped rows): how the combine's cotangent reaches the experts, one
    all-to-all, for callers that write their own VJP."""
    ep = lax.axis_size(axis_name)
    C, F = plan["chunk"], values.shape[-1]
    flat = plan["flat"]
    with jax.named_scope("expert_combine_dense_transpose"):
        valid = (flat < ep * C)[:, None]
        send = jnp.zeros((ep * C, F), values.dtype)
        send = send.at[flat].set(jnp.where(valid, values, 0), mode="drop", unique_indices=True)
        received = lax.all_to_all(send.reshape(ep, C, F), axis_name, 0, 0, tiled=True)
    return received.reshape(ep * C, F)


__all__ = [
    "DENSE_CHUNK_FACTOR",
    "IMPLEMENTATIONS",
    "combine",
    "combine_transpose",
    "dense_chunk",
    "default_implementation",
    "dispatch",
    "overflows",
    "take_rows",
]
