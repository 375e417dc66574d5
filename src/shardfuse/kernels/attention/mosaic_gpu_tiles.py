"""Pieces every Pallas Mosaic GPU attention kernel body shares: tiles, masks, matmuls.

The kernels (`mosaic_gpu_forward.py`, `mosaic_gpu_backward.py`) run one
warpgroup (128 threads) per consumer and keep every tile of scores in the
`WGMMA` register layout: a `[rows, cols]` float32 tile as the tensor cores
produce it, its row vectors in `ROW` (`WGMMA.reduce(1)`: one value per row)
and its column vectors in `COL` (`WGMMA.reduce(0)`).

- `mma`: `a @ b` on the tensor cores (`wgmma`), with an optional accumulator
  it adds into. On a GPU the accumulator lives in registers and the
  tensor cores add into it (`pl.run_state`); JAX's Mosaic GPU interpret mode
  does not implement `run_state`, so there (`interpret=True`) the product is
  formed in a fresh accumulator and added: the same sum, one rounding apart;
  and since its `wgmma` reads both operands from shared memory, a register
  operand is multiplied there with `lax.dot` on the same values.
- `tile_mask`: which (query, key) pairs of a tile are visible, from absolute
  positions and segment ids (the rule of `masks.visible`, the one definition)
  and the padding of the last key block.

Axis glossary: bq query rows of a warpgroup's tile, bk key rows, D head dim.
"""

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from shardfuse import _compat
from shardfuse.kernels.attention import masks

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Each tile row of a swizzled operand is 128 bytes: 64 elements of a 16-bit dtype.
SWIZZLE_BYTES = 128
SWIZZLE_ELEMENTS = 64
WARPGROUP_ROWS = 64  # rows of one wgmma M tile per warpgroup

WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)


def swizzled(shape, dtype):
    """A shared-memory buffer tiled (8, 64) and swizzled 128 bytes: what TMA and wgmma read."""
    transforms = (
        plgpu.TilingTransform((8, SWIZZLE_ELEMENTS)),
        plgpu.SwizzleTransform(SWIZZLE_BYTES),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def in_layout(x, layout, *, interpret=False):
    """`x` given `layout` in registers; a no-op in interpret mode, which keeps logical values
    (and on older JAX has no rule for the cast)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def iota(shape, dimension, *, interpret=False):
    """int32 `broadcasted_iota` in the WGMMA layout (plain in interpret mode)."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=WGMMA)


def _is_ref(x) -> bool:
    """A ref (a kernel argument or a view of one), as opposed to an array in registers."""
    return hasattr(x, "transforms") or hasattr(getattr(x, "aval", None), "inner_aval")


def mma(a, b, shape, *, acc=None, interpret=False):
    """float32 `acc + a @ b` (or `a @ b`) on the tensor cores; `shape` is the result's.

    `a` is a shared-memory ref or a 16-bit register array in the WGMMA layout;
    `b` a shared-memory ref (transposed views allowed). Waits for the result.
    """
    if interpret and not _is_ref(a):
        # The interpreter's wgmma reads both operands from shared memory; a register
        # operand is multiplied by reading the shared one (same operands, float32 sum).
        out = lax.dot(a, b[...], preferred_element_type=jnp.float32)
        return out if acc is None else acc + out
    if acc is None or interpret:

        def product(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        out = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
        return out if acc is None else acc + out

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


@dataclasses.dataclass(frozen=True)
class MaskRefs:
    """The global refs a tile mask reads: positions, segment ids (or None), true lengths."""

    q_pos: object  # int32 [T_pad]
    kv_pos: object  # int32 [S_pad]
    q_seg: object  # int32 [B, T_pad] or None
    kv_seg: object  # int32 [B, S_pad] or None
    length_kv: int  # S before padding
    interpret: bool = False


def mask_refs(q_pos, kv_pos, q_seg, kv_seg, *, segments, length_kv, interpret):
    """The `MaskRefs` of a kernel: segment refs only when the call has segment ids
    (`segments`; the kernel's segment arguments are placeholders otherwise)."""
    segs = (q_seg, kv_seg) if segments else (None, None)
    return MaskRefs(q_pos, kv_pos, *segs, length_kv, interpret)


PRODUCER_REGISTERS = 40  # per thread: the producer warpgroup only issues copies
CONSUMER_REGISTERS = 232  # the consumers hold the accumulators and the softmax


def consumer(wg, consumers):
    """Decorator: the body runs on the consumer warpgroups (`wg < consumers`), their
    register budget raised to `CONSUMER_REGISTERS`."""

    def wrap(body):
        @pl.when(wg < consumers)
        def run():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            body()

        return body

    return wrap


def producer(wg, consumers):
    """Decorator: the body runs on the producer warpgroup (`wg == consumers`), its
    register budget lowered to `PRODUCER_REGISTERS`."""

    def wrap(body):
        @pl.when(wg == consumers)
        def run():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            body()

        return body

    return wrap


def cta(ranges_ref, tile):
    """`(batch, wg, block_range)` of this CTA's warpgroup: the batch row and warpgroup
    indices of the grid, and the tile's range of blocks to visit (`block_range`)."""
    batch = lax.axis_index("batch")
    return batch, lax.axis_index("wg"), block_range(ranges_ref, batch, tile)


def query_cta(ranges_ref, config, group):
    """`(head, kv_head, tile, batch, wg, block_range)` of a query-tile CTA (the forward's,
    dQ's): its query head and the key/value head it reads (`group` query heads per key
    head), its query tile (heaviest first, `heavy_first`), and `cta`'s values."""
    head = lax.axis_index("heads")
    tile = heavy_first(lax.axis_index("q_tiles"), ranges_ref.shape[1], config)
    kv_head = lax.div(head, jnp.array(group, head.dtype))
    return (head, kv_head, tile, *cta(ranges_ref, tile))


def bind(kernel, q, k, q_seg, kv_seg, *, interpret, **options):
    """`(kernel, q_seg, kv_seg)`: the kernel with its static options bound (`group` =
    query heads per key head, `segments`, `interpret` as a flag) and the segment ids,
    int32 placeholders the kernel never reads when the call has none."""
    kernel = functools.partial(
        kernel,
        group=q.shape[2] // k.shape[2],
        segments=q_seg is not None,
        interpret=interpret is not None,
        **options,
    )
    if q_seg is None:
        q_seg = kv_seg = jnp.zeros((1, 1), jnp.int32)
    return kernel, q_seg, kv_seg


def launch(kernel, args, *, grid, names, out_type, scratch, consumers, interpret):
    """`kernel(*args)` on a grid of CTAs of `consumers` consumer warpgroups and one
    producer (`wg` names the warpgroup), compiled with approximate math, or in Mosaic
    GPU interpret mode when `interpret` is an `InterpretGPUParams`."""
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=scratch,
        grid=grid,
        grid_names=names,
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else {"interpret": interpret}),
    )(*args)


def vector(ref, start, size, layout, *, interpret=False):
    """`ref[start:start+size]` (a global or shared ref) in registers, in `layout` (ROW: one
    value per tile row; COL: per column). Interpret mode keeps values in their logical
    layout and reads with a plain index."""
    if interpret:
        return ref[pl.ds(start, size)]
    return _compat.mosaic_gpu_load(ref, (pl.ds(start, size),), layout=layout)


def tile_mask(config, refs: MaskRefs, batch, q_start, kv_start, shape, *, transposed=False):
    """bool `shape`: query `q_start + r` sees key `kv_start + c` (`[bq, bk]`).

    With `transposed`, the tile is `[bk, bq]` (keys by queries), as the dK/dV
    kernel holds its scores. Keys past the true length (block padding) are never
    visible.
    """
    rows, cols = shape
    bq, bk = (cols, rows) if transposed else (rows, cols)
    q_dim, kv_dim = (1, 0) if transposed else (0, 1)
    q_layout, kv_layout = (COL, ROW) if transposed else (ROW, COL)

    def q_vector(ref, dim=q_dim):
        x = vector(ref, q_start, bq, q_layout, interpret=refs.interpret)
        return lax.broadcast_in_dim(x, shape, [dim])

    def kv_vector(ref, dim=kv_dim):
        x = vector(ref, kv_start, bk, kv_layout, interpret=refs.interpret)
        return lax.broadcast_in_dim(x, shape, [dim])

    q_pos, kv_pos = q_vector(refs.q_pos), kv_vector(refs.kv_pos)
    kv_index = kv_start + iota(shape, kv_dim, interpret=refs.interpret)
    q_seg = kv_seg = None
    if refs.q_seg is not None:
        q_seg, kv_seg = q_vector(refs.q_seg.at[batch]), kv_vector(refs.kv_seg.at[batch])
    return masks.visible(config, q_pos, kv_pos, q_seg, kv_seg, valid=kv_index < refs.length_kv)


def logits_log2(config, s):
    """Scores `s` (float32 `q . k`) as base-2 logits `x * c`: `(x, c, tanh)`.

    `cap(scale * s) * log2(e) = x * c` with `c > 0` a Python float, so that a
    kernel takes row maxima on `x` (scaled once per row, not per element) and forms
    `exp2(x * c - m)` as one fused multiply-add per element. Without a softcap
    `x = s`; with one, `x = tanh(scale * s / cap)`, which the backward needs too
    (`d logits / d s = scale * (1 - tanh^2)`; `tanh` is None without a softcap).
    """
    if config.logit_softcap is None:
        c = config.scale * LOG2E
        return (s, c, None) if c > 0 else (s * c, 1.0, None)
    cap = config.logit_softcap
    t = jnp.tanh(s * (config.scale / cap))
    return t, cap * LOG2E, t


def heavy_first(tile, tiles, config):
    """The query tile a CTA takes: under a causal mask the last (most keys) first, so the
    longest CTAs start first and the short ones fill the tail (FlashAttention-3's order)."""
    return tiles - 1 - tile if config.causal else tile


def safe_max(m):
    """The running maximum with -inf (no visible key yet) read as 0, so exp2 stays finite."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def block_range(ranges_ref, batch, tile):
    """`(lo, full_lo, full_hi, hi)` of one tile from its block table (`masks.visit_ranges`)."""
    return tuple(ranges_ref[batch, tile, i] for i in range(4))


def walk(step, block_range, carry, *, offset=0):
    """`step(j, carry, masked=...)` for j in `[lo, hi)` (plus `offset`): masked outside the
    fully visible run `[full_lo, full_hi)`, unmasked inside it."""
    lo, full_lo, full_hi, hi = (offset + x for x in block_range)
    masked, unmasked = (functools.partial(step, masked=b) for b in (True, False))
    carry = lax.fori_loop(lo, full_lo, masked, carry)
    carry = lax.fori_loop(full_lo, full_hi, unmasked, carry)
    return lax.fori_loop(full_hi, hi, masked, carry)


def wait_when(predicate, barrier):
    """Waits on `barrier` where `predicate` (a traced bool) holds."""

    @pl.when(predicate)
    def _():
        plgpu.barrier_wait(barrier)


def stream(load, steps, stages, free):
    """The producer's loop: `load(s, slot, reuse)` for s in `[0, steps)`, slot `s % stages`.

    `reuse` (traced bool) says the slot held step `s - stages`: `load` waits on that
    slot's release (its `free` barriers) before overwriting it. The last `stages`
    releases are waited for at the end: every phase of a barrier is observed before
    the CTA frees it (interpret mode checks this; on a GPU it costs nothing).
    """

    @pl.loop(0, steps)
    def _(s):
        load(s, lax.rem(s, stages), s >= stages)

    @pl.loop(lax.max(0, steps - stages), steps)
    def _(s):
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(s, stages)])


def store(x, gmem, stage=None, *, interpret=False):
    """Writes float32 `x` to the global view `gmem` in its dtype; doesn't wait.

    With `stage` (a free shared buffer of `gmem`'s dtype and shape), through it
    and TMA; without (float32 results, say), straight from registers.
    """
    if stage is None:
        gmem[...] = x.astype(gmem.dtype)
        return
    stage[...] = x.astype(stage.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(stage, gmem)
