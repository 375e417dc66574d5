"""What `load_hf` reads from a checkpoint: each read attributed to a parameter's block.

`load_hf(path, mesh=..., on_read=callback)` calls `callback(TensorRead(...))` for every
slice it copies out of a safetensors file, naming the parameter and the block of it (one
device's slice, shared by that slice's replicas on the process) being built. Any layout of
tensors on disk reports the same way, one `TensorRead` per tensor slice: a dense family's
k and v halves of `kv_kernel`, or a block of experts made of one tensor per expert.
`bytes_per_device` turns those reports into the bytes each of this process's devices
needed, to compare with the size of its shard of each parameter.
"""

import dataclasses
import math
from collections import defaultdict

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorRead:
    """One slice copied out of a checkpoint file while `load_hf` built a parameter.

    Attributes:
      parameter: the parameter's path, dot-joined (`"blocks.attention.kv_kernel"`); None for
        a read that builds no parameter (the check that a tied `lm_head.weight` equals the
        embedding).
      block: the parameter's block being built, `((start, stop), ...)` per axis; None with
        `parameter=None`.
      tensor: the checkpoint tensor's name (`"model.layers.0.self_attn.k_proj.weight"`).
      index: the slices of that tensor read, a tuple of `slice`.
      nbytes: bytes copied (in the file's dtype).
    """

    parameter: str | None
    block: tuple | None
    tensor: str
    index: tuple
    nbytes: int


def block_of(index, shape) -> tuple:
    """`((start, stop), ...)` of a device's `index` (a tuple of slices) into `shape`.

    Example:
      >>> block_of((slice(0, 2), slice(None)), (4, 3))
      ((0, 2), (0, 3))
    """
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided slice {s} is not supported")
        out.append((start, stop))
    return tuple(out)


def bytes_per_device(reads, params: dict) -> dict:
    """Bytes read for each parameter's shard on each of this process's devices.

    A device is charged the bytes read for the block it holds; replicas of one block on
    this process share one read, so each is charged the same bytes (the process read them
    once: `sum(r.nbytes for r in reads)` is the process's total).

    Args:
      reads: the `TensorRead`s of one `load_hf` call in this process.
      params: parameter path (dot-joined, as `TensorRead.parameter`) -> the loaded
        `jax.Array`.

    Returns:
      `{device: {parameter: bytes}}` for every addressable device of every parameter
      (0 where nothing was read).

    Example:
      >>> import jax, numpy as np
      >>> x = jax.numpy.zeros((4, 2))
      >>> reads = [TensorRead("w", ((0, 4), (0, 2)), "w", (slice(0, 4),), 32)]
      >>> bytes_per_device(reads, {"w": x})[jax.devices()[0]]
      {'w': 32}
    """
    by_block = defaultdict(int)
    for r in reads:
        if r.parameter is not None:
            by_block[(r.parameter, tuple(r.block))] += r.nbytes
    out = defaultdict(dict)
    for name, value in params.items():
        for device, index in value.sharding.addressable_devices_indices_map(value.shape).items():
            out[device][name] = by_block.get((name, block_of(index, value.shape)), 0)
    return dict(out)


def shard_bytes(value, itemsize: int | None = None) -> int:
    """Bytes of one device's shard of `value` (at `itemsize` bytes an element, default its own).

    Example:
      >>> import jax
      >>> shard_bytes(jax.numpy.zeros((4, 2)), itemsize=2)
      16
    """
    shape = value.sharding.shard_shape(value.shape)
    return math.prod(shape) * (np.dtype(value.dtype).itemsize if itemsize is None else itemsize)


__all__ = ["TensorRead", "block_of", "bytes_per_device", "shard_bytes"]
