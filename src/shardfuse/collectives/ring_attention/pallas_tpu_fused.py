"""implementation="pallas_tpu_fused": the whole ring in one Pallas TPU kernel per direction.

`ring(spec, q, k, v, q_seg, kv_seg)` has the contract of `ring.ring` (per
shard, inside `jax.shard_map`, validated inputs in ring order, `(out, lse)`
with a custom VJP), but instead of an XLA loop of `ppermute`s around
single-device attention kernels it runs the fused kernels of
`pallas_tpu_fused_kernels.py`: K/V (and, backward, the float32 dK/dV
accumulators) move by remote DMA issued from the attention kernel itself,
double-buffered with the credit handshake of the fused collective matmuls,
so the next block arrives while the current one computes, with no XLA-level
step boundary.

This wrapper lays the operands out for the kernels (q `[B H, T, D]`, K and V
stacked `[2, B K, S, D]`, positions and segment ids as lane/sublane int32
broadcasts that travel with K/V), builds the ring table (the collective
matmuls' `ring_table`: mesh coordinates of the neighbours) and the per-step
block-state table (`pallas_tpu_blocks.block_states` on the positions of the
block each step holds: SKIP / PARTIAL / FULL), and checks what the kernels
can take, raising NotImplementedError otherwise (the ring dispatch then tries
the next implementation): float32 or bfloat16, head dim 64 or a multiple of
128, a single str ring axis with every mesh axis manual, and per-device
operands that fit `VMEM_BUDGET_BYTES` (the kernels keep everything whole in
VMEM, as the fused collective matmuls do; long shards use the xla ring).

Off TPU the kernels run in TPU interpret mode (`pltpu.InterpretParams`,
chosen by `pallas_interpret.interpret_mode`), which simulates the remote DMAs
and semaphores across the CPU devices; `interpret_mode(False)` emits Mosaic
for `lower(lowering_platforms=("tpu",))`. The collective matmuls'
`without_handshake()` also drops these kernels' credits (the planted race).

Axis glossary: B batch, T / S local query / key length, H query heads, K kv
heads, D head dim, N ring size, R metadata rows (1, or 1 + B with segment ids).
"""

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.collectives.collective_matmul import base as ring_base
from shardfuse.collectives.collective_matmul import pallas_tpu as collective_pallas
from shardfuse.collectives.collective_matmul.pallas_tpu_kernels import ring_table
from shardfuse.collectives.ring_attention import layouts
from shardfuse.collectives.ring_attention import pallas_tpu_fused_kernels as kernels
from shardfuse.kernels import vma
from shardfuse.kernels.attention import pallas_tpu_blocks as tiles
from shardfuse.kernels.attention import pallas_tpu_tiles, protocol
from shardfuse.kernels.attention.pallas_tpu_layout import (
    broadcast_lanes,
    broadcast_sublanes,
    check_supported,
)
from shardfuse.kernels.pallas_interpret import current_interpret_params
from shardfuse.kernels.precision import dot_precision

NAME = "pallas_tpu_fused"
VMEM_BUDGET_BYTES = collective_pallas.VMEM_BUDGET_BYTES
# Barrier semaphores of the fused collectives: 0-2 are the collective matmuls'.
_COLLECTIVE_ID = {"forward": 3, "backward": 4}


@dataclasses.dataclass(frozen=True)
class _Fused:
    """Static description of one fused ring call (the custom_vjp's non-differentiable part)."""

    spec: Hashable  # ring.RingSpec
    mesh_axes: tuple[str, ...]
    interpret: object  # pltpu.InterpretParams, or False (Mosaic)
    handshake: bool

    @property
    def plan(self):
        """The collective matmuls' ring plan (one chunk per device), for `ring_table`."""
        return ring_base.make_plan(self.spec.axis_name, self.spec.ring_size, 0, 1, False)


def _block(length: int, target: int, what: str) -> int:
    """Rows per tile: the whole length up to 128, else the largest multiple of 128 up to
    `target` dividing it (the kernels tile positions over 128 lanes)."""
    if length <= tiles.NUM_LANES:
        return length
    for size in range(target - target % tiles.NUM_LANES, 0, -tiles.NUM_LANES):
        if length % size == 0:
            return size
    raise NotImplementedError(
        f"{NAME}: local {what} length {length} is above {tiles.NUM_LANES} and not a multiple "
        f"of {tiles.NUM_LANES}"
    )


def _static(fz: _Fused, q, k, q_seg, *, backward: bool) -> kernels.FusedStatic:
    B, T, H, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    sizes = check_supported(q, fz.spec.config.block_sizes)
    block_q = _block(T, sizes.block_q_bwd if backward else sizes.block_q, "query")
    block_kv = _block(S, sizes.block_kv_bwd if backward else sizes.block_kv, "key")
    block = pallas_tpu_tiles.Static(
        fz.spec.config, T, S, block_q, block_kv, dot_precision(q.dtype), T // block_q
    )
    return kernels.FusedStatic(
        block=block, ring_size=fz.spec.ring_size, num_axes=len(fz.mesh_axes), batch=B,
        num_heads=H, group=H // K, segments=q_seg is not None, handshake=fz.handshake,
    )  # fmt: skip


def _metadata(fz: _Fused, q, k, q_seg, kv_seg):
    """int32 `(q positions, kv positions [S])` and the mask metadata of queries and keys:
    `[R, L, 128]` lanes and `[R, 8, L]` rows (row 0 positions, 1 + b segment ids)."""
    spec = fz.spec
    index = lax.axis_index(spec.axis_name)
    q_pos = layouts.shard_positions(index, q.shape[1], spec.ring_size, spec.layout)
    q_pos = q_pos + spec.q_offset
    kv_pos = layouts.shard_positions(index, k.shape[1], spec.ring_size, spec.layout)
    q_meta, kv_meta = q_pos[None], kv_pos[None]
    if q_seg is not None:
        q_meta = jnp.concatenate([q_meta, q_seg.astype(jnp.int32)])
        kv_meta = jnp.concatenate([kv_meta, kv_seg.astype(jnp.int32)])
    return (
        q_pos,
        kv_pos,
        (
            broadcast_lanes(q_meta),
            broadcast_sublanes(q_meta),
            broadcast_lanes(kv_meta),
            broadcast_sublanes(kv_meta),
        ),
    )


def _step_states(fz: _Fused, st: kernels.FusedStatic, q_pos):
    """int32 `[N nq nk]`: SKIP / PARTIAL / FULL of each (query block, key block) in each
    step, from the positions of the K/V block held then (that of device i - s)."""
    spec, n = fz.spec, fz.spec.ring_size
    S = st.block.length_kv
    sources = (lax.axis_index(spec.axis_name) - jnp.arange(n)) % n
    kv_pos = layouts.shard_positions(sources, S, n, spec.layout)  # [N, S]

    def states(kv_pos):
        return tiles.block_states(
            spec.config, q_pos, kv_pos, None, None, length_q=st.block.length_q, length_kv=S,
            block_q=st.block.block_q, block_kv=st.block.block_kv,
        )[0]  # fmt: skip

    table = jax.vmap(states)(kv_pos)  # [N, nq, nk]
    if st.segments:  # segment ids are only known in the kernel: mask every visible block
        table = jnp.minimum(table, tiles.PARTIAL)
    return table.reshape(-1)


def _ring_scratch(kv, kv_lanes, kv_rows):
    """The K/V ring's scratch: receive buffers `[2, ...]`, 6 DMA semaphores, a credit."""
    buffers = [pltpu.VMEM((2, *x.shape), x.dtype) for x in (kv, kv_lanes, kv_rows)]
    return [*buffers, *[pltpu.SemaphoreType.DMA((2,))] * 6, pltpu.SemaphoreType.REGULAR]


def _call(fz: _Fused, kernel, st, args, out_shape, scratch, direction: str):
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.pallas_call(
        functools.partial(kernel, st=st),
        out_shape=out_shape,
        in_specs=[smem, smem] + [vmem] * (len(args) - 2),
        out_specs=[vmem] * len(out_shape),
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=_COLLECTIVE_ID[direction]),
        interpret=fz.interpret,
        name=f"shardfuse_ring_attention_fused_{direction}",
    )(*args)


def _heads_first(x):
    """`[B, L, N, D]` -> `[B N, L, D]`."""
    B, L, N, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * N, L, D)


def _heads_last(x, batch):
    """`[B N, L, D]` -> `[B, L, N, D]`."""
    BN, L, D = x.shape
    return x.reshape(batch, BN // batch, L, D).transpose(0, 2, 1, 3)


def _common(fz: _Fused, *arrays):
    axes = vma.common_axes(*arrays) | {fz.spec.axis_name}
    return [None if x is None else vma.to_varying(x, axes) for x in arrays]


def _forward(fz: _Fused, q, k, v, q_seg, kv_seg):
    """`(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])` by the fused forward kernel."""
    B, T, H, D = q.shape
    st = _static(fz, q, k, q_seg, backward=False)
    q_pos, _, metadata = _metadata(fz, q, k, q_seg, kv_seg)
    kv = jnp.stack([_heads_first(k), _heads_first(v)])  # [2, B K, S, D]
    args = [ring_table(fz.plan, fz.mesh_axes, 1, scatter=False), _step_states(fz, st, q_pos)]
    args = _common(fz, *args, _heads_first(q), metadata[0], metadata[1], kv, *metadata[2:])
    out_shape = [
        vma.shape_dtype_struct((B * H, T, D), q.dtype, args[2]),
        vma.shape_dtype_struct((B * H, T, tiles.NUM_LANES), jnp.float32, args[2]),
    ]
    stats = [pltpu.VMEM((B * H, T, tiles.NUM_LANES), jnp.float32)] * 2
    scratch = [*_ring_scratch(*args[5:]), *stats, pltpu.VMEM((B * H, T, D), jnp.float32)]
    out, lse = _call(fz, kernels.forward_kernel, st, args, out_shape, scratch, "forward")
    return _heads_last(out, B), lse[..., 0].reshape(B, H, T)


def _backward(fz: _Fused, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse):
    """`(dq, dk, dv)`, float32, by the fused backward kernel."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    st = _static(fz, q, k, q_seg, backward=True)
    q_pos, _, metadata = _metadata(fz, q, k, q_seg, kv_seg)
    lse, delta = protocol.backward_row_stats(out, lse, d_out, d_lse)  # [B, H, T] each
    lse, delta = (broadcast_lanes(x.reshape(B * H, T)) for x in (lse, delta))
    kv = jnp.stack([_heads_first(k), _heads_first(v)])
    args = [ring_table(fz.plan, fz.mesh_axes, 1, scatter=False), _step_states(fz, st, q_pos)]
    args += [_heads_first(q), _heads_first(d_out.astype(q.dtype)), lse, delta]
    args = _common(fz, *args, metadata[0], metadata[1], kv, *metadata[2:])
    like = args[2]
    out_shape = [
        vma.shape_dtype_struct((B * H, T, D), jnp.float32, like),
        vma.shape_dtype_struct((2, B * K, S, D), jnp.float32, like),
    ]
    dkv = (2, B * K, S, D)
    scratch = _ring_scratch(*args[8:]) + [
        pltpu.VMEM(dkv, jnp.float32),  # this step's share
        pltpu.VMEM((2, *dkv), jnp.float32),  # send slots
        pltpu.VMEM((2, *dkv), jnp.float32),  # receive slots
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.DMA((2,)),
        pltpu.SemaphoreType.REGULAR,
    ]
    dq, dkv = _call(fz, kernels.backward_kernel, st, args, out_shape, scratch, "backward")
    return _heads_last(dq, B), _heads_last(dkv[0], B), _heads_last(dkv[1], B)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(fz: _Fused, q, k, v, q_seg, kv_seg):
    return _forward(fz, q, k, v, q_seg, kv_seg)


def _fused_fwd(fz, q, k, v, q_seg, kv_seg):
    out, lse = _forward(fz, q, k, v, q_seg, kv_seg)
    return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _fused_bwd(fz, residuals, cotangents):
    q, k, v, q_seg, kv_seg, out, lse = residuals
    d_out, d_lse = cotangents
    with jax.named_scope("ring_attention_fused_bwd"):
        dq, dk, dv = _backward(fz, q, k, v, q_seg, kv_seg, out, lse, d_out, d_lse)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def working_set_bytes(q, k, segments: bool) -> int:
    """Per-device VMEM bytes the fused kernels hold (an upper bound of both directions):
    operands, outputs, receive slots, row statistics and the float32 dK/dV ring buffers.

    Example:
      >>> import jax.numpy as jnp
      >>> working_set_bytes(jnp.zeros((1, 128, 4, 128)), jnp.zeros((1, 128, 2, 128)), False)
      4280320
    """
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    item = jnp.dtype(q.dtype).itemsize
    rows = 1 + (B if segments else 0)
    metadata = rows * (T + S) * (tiles.NUM_LANES + tiles.NUM_SUBLANES) * 4
    kv_ring = 3 * (2 * B * K * S * D * item + rows * S * (tiles.NUM_LANES + tiles.NUM_SUBLANES) * 4)
    # q and out (or d_out); three [B H, T, 128] float32 row statistics (m, l, lse or lse,
    # delta); the float32 accumulator (or dQ).
    queries = 2 * B * H * T * D * item + 3 * B * H * T * tiles.NUM_LANES * 4 + B * H * T * D * 4
    dkv_ring = 6 * 2 * B * K * S * D * 4  # output, share, two send and two receive slots
    return metadata + kv_ring + queries + dkv_ring


def check_supported_here(spec, q, k, q_seg, interpret) -> tuple[str, ...]:
    """The mesh axes for the remote DMAs, or NotImplementedError for what the kernels cannot
    take (dtype, head dim, tiling, ring axis, VMEM budget)."""
    if not isinstance(spec.axis_name, str):
        raise NotImplementedError(
            f"{NAME}: the ring runs over one mesh axis; axis_name={spec.axis_name!r}"
        )
    sizes = check_supported(q, spec.config.block_sizes)  # dtype, head dim, block sizes
    for length, what in ((q.shape[1], "query"), (k.shape[1], "key")):
        _block(length, max(sizes.block_q, sizes.block_kv), what)
    if interpret is False and (q.shape[1] % tiles.NUM_SUBLANES or k.shape[1] % tiles.NUM_SUBLANES):
        raise NotImplementedError(
            f"{NAME} on TPU needs local lengths that are multiples of {tiles.NUM_SUBLANES}; "
            f"got T={q.shape[1]}, S={k.shape[1]}"
        )
    needed = working_set_bytes(q, k, q_seg is not None)
    if needed > VMEM_BUDGET_BYTES:
        raise NotImplementedError(
            f"{NAME} keeps the shard in VMEM: {needed} bytes per device exceed "
            f"{VMEM_BUDGET_BYTES}; the xla ring takes longer shards"
        )
    plan = ring_base.make_plan(spec.axis_name, spec.ring_size, 0, 1, False)
    return collective_pallas.manual_mesh_axes(plan)


def ring(spec, q, k, v, q_seg, kv_seg):
    """Fused ring attention on validated per-shard inputs: `(out, lse)`, with the fused backward.

    The contract of `ring.ring` (`spec` a `ring.RingSpec`, inputs in ring
    order, `lse` float32 `[B, H, T]`); `spec.implementation` is ignored.

    Raises:
      NotImplementedError: inputs the kernels cannot take (see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(jax.devices()[:2], ("sequence",))
      >>> q = k = v = jax.random.normal(jax.random.key(0), (1, 16, 2, 64))
      >>> f = jax.shard_map(
      ...     lambda q, k, v: sf.collectives.ring_attention(
      ...         q, k, v, "sequence", layout="zigzag", causal=True,
      ...         implementation="pallas_tpu_fused"),
      ...     mesh=mesh, in_specs=P(None, "sequence"), out_specs=P(None, "sequence"))
      >>> jax.block_until_ready(jax.jit(f)(q, k, v)).shape
      (1, 16, 2, 64)
    """
    interpret = current_interpret_params()
    mesh_axes = check_supported_here(spec, q, k, q_seg, interpret)
    handshake = collective_pallas.handshake()
    fz = _Fused(spec, mesh_axes, interpret, handshake)
    q, k, v, q_seg, kv_seg = _common(fz, q, k, v, q_seg, kv_seg)
    with jax.named_scope("ring_attention_fused"):
        return _fused(fz, q, k, v, q_seg, kv_seg)
