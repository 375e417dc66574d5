"""Flash attention as Pallas Mosaic GPU kernels for Hopper and newer (sm_90+), forward and
backward.

The kernels (`mosaic_gpu_forward.py`, `mosaic_gpu_backward.py`) use what Hopper
offers and Triton does not apply to attention: warp specialization (a TMA
producer warpgroup, two consumer warpgroups with its registers), `wgmma`
with the consumers in ping-pong, mbarrier-synchronised shared-memory rings.
This wrapper prepares their inputs:

- shapes: head dims are zero-padded to a multiple of 64 (the 128-byte
  swizzle), up to 256; sequences to the tiles; padding is masked by index
  and sliced away;
- the block tables (`masks.block_table`, `masks.visit_ranges`): which key
  blocks each query tile visits and which need no mask, for the forward and
  dQ kernels, and the transpose for dK/dV;
- NaN never meets a zero in a matmul: rows of K and V that no query sees and
  (for the backward) queries that see no key are zeroed first
  (`masks.visibility_flags`, only under masks and only when such rows exist);
- the backward's row statistics (`protocol.backward_row_stats`).

Float16 and bfloat16 only (float32 would run as TF32 on the tensor cores,
short of the float32 tolerance): float32 raises NotImplementedError, and
dispatch falls back. On a CPU the same kernels run in Mosaic GPU interpret mode
(`InterpretGPUParams`, jax >= 0.11: 0.10's interpreter deadlocks on the
warp-specialized kernels), which is how the tests check them without a GPU;
`interpret_mode(False)` emits the GPU kernels instead, for
`lower(lowering_platforms=("cuda",))` from any host.

Axis glossary: B batch, T query length, S key length, H query heads,
K kv heads, D head dim.
"""

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp

from shardfuse import _compat, hardware
from shardfuse.kernels.attention import base, masks, protocol
from shardfuse.kernels.attention import mosaic_gpu_backward as backward_kernels
from shardfuse.kernels.attention import mosaic_gpu_forward as forward_kernel
from shardfuse.kernels.attention.mosaic_gpu_tiles import LOG2E, SWIZZLE_ELEMENTS

MAX_HEAD_DIM = 256
MIN_COMPUTE_CAPABILITY = 90
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_SETTING = contextvars.ContextVar("shardfuse_mosaic_gpu_interpret", default=None)


@dataclasses.dataclass(frozen=True)
class MosaicGpuTiles:
    """Tile rows of the three kernels (per consumer warpgroup) and their ring depths.

    A CTA holds two consumers (the backward's: `backward_consumers`): the forward and
    dQ kernels cover `2 * block_q` query rows, the dK/dV kernel `2 * dkdv_block_kv` key
    rows.
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    dq_block_q: int = 64
    dq_block_kv: int = 128
    dkdv_block_q: int = 64
    dkdv_block_kv: int = 64
    backward_stages: int = 2
    backward_consumers: int = 2  # consumer warpgroups of the backward kernels' CTAs
    split_dkdv: bool = False  # dK and dV in two launches (their accumulators do not fit one)

    @property
    def q_multiple(self) -> int:
        return _lcm(2 * self.block_q, self.backward_consumers * self.dq_block_q, self.dkdv_block_q)

    @property
    def kv_multiple(self) -> int:
        return _lcm(self.block_kv, self.dq_block_kv, self.backward_consumers * self.dkdv_block_kv)


def _lcm(*values):
    out = 1
    for v in values:
        out = out * v // _gcd(out, v)
    return out


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


# By padded head dim. Bounds: registers per consumer (the float32 accumulators of its
# 64-row tile and its scores), shared memory (227 KiB per CTA), and wgmma's contraction
# (a multiple of 64 elements of a 16-bit dtype: key tiles for P V and dS K, query tiles
# for P^T dO and dS^T Q). Above head dim 128 the dK and dV accumulators do not fit one
# consumer together (two launches), and at 256 a backward CTA holds one consumer.
TILES = {
    64: MosaicGpuTiles(),
    128: MosaicGpuTiles(),
    192: MosaicGpuTiles(block_kv=64, dq_block_kv=64, split_dkdv=True),
    256: MosaicGpuTiles(block_kv=64, dq_block_kv=64, backward_consumers=1, split_dkdv=True),
}


def default_tiles(head_dim: int, block_sizes: base.BlockSizes) -> MosaicGpuTiles:
    """The tiles for `head_dim` (padded to 64), with the user's `BlockSizes` applied to the
    forward and dQ kernels; NotImplementedError for sizes these kernels cannot tile."""
    padded = -(-head_dim // SWIZZLE_ELEMENTS) * SWIZZLE_ELEMENTS
    tiles = TILES[padded]
    block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
    if block_q is not None and block_q != 64:
        raise NotImplementedError(
            f"implementation 'mosaic_gpu' tiles queries by 64 rows per warpgroup; "
            f"got BlockSizes.block_q={block_q}"
        )
    if block_kv is not None:
        if block_kv not in (64, 128) or (padded > 128 and block_kv != 64):
            valid = "64 or 128" if padded <= 128 else "64"
            raise NotImplementedError(
                f"implementation 'mosaic_gpu' at head dim {head_dim} takes BlockSizes.block_kv "
                f"{valid}; got {block_kv}"
            )
        tiles = dataclasses.replace(tiles, block_kv=block_kv, dq_block_kv=block_kv)
    return tiles


@contextlib.contextmanager
def interpret_mode(params):
    """How the Mosaic GPU kernels traced inside the block run.

    Args:
      params: an `InterpretGPUParams` (Mosaic GPU interpret mode, any backend),
        False (emit the GPU kernels: run on a GPU, or lower for one from any host),
        or None (the default: compiled on a GPU, interpreted elsewhere).
    """
    token = _SETTING.set(params)
    try:
        yield
    finally:
        _SETTING.reset(token)


def _interpret_params():
    """None (compile for the GPU) or the `InterpretGPUParams` to run the kernels with.

    Raises:
      NotImplementedError: the kernels can neither compile nor be interpreted here.
    """
    setting = _SETTING.get()
    if setting is False:
        return None
    if setting is not None:
        return setting
    if jax.default_backend() in ("gpu", "cuda"):
        _gpu_capability()
        return None
    if jax.default_backend() != "cpu":
        raise NotImplementedError(status(jax.default_backend())[1])
    return _compat.mosaic_gpu_interpret_params()


def status(platform: str):
    """`(can_run_here, why)`: compiled on an sm_90+ GPU, interpreted on CPU (jax >= 0.11)."""
    if platform in ("gpu", "cuda"):
        try:
            capability = _gpu_capability()
        except NotImplementedError as e:
            return False, str(e)
        return True, f"sm_{capability}: Pallas Mosaic GPU kernels (warp-specialized, wgmma)"
    if platform == "cpu":
        try:
            _compat.mosaic_gpu_interpret_params()
        except NotImplementedError as e:
            return False, str(e)
        return True, "no GPU: runs in Mosaic GPU interpret mode on cpu (slow)"
    return False, f"runs on NVIDIA GPUs of compute capability >= 9.0; the backend is {platform!r}"


def _gpu_capability() -> int:
    capability = hardware.compute_capability()
    if capability < MIN_COMPUTE_CAPABILITY:
        kind = jax.devices()[0].device_kind
        raise NotImplementedError(
            f"implementation 'mosaic_gpu' needs an NVIDIA GPU of compute capability >= 9.0 "
            f"(Hopper: wgmma, TMA); {kind} has {capability / 10:.1f} (triton runs on sm_80)"
        )
    return capability


def _check_supported(q):
    """The interpret params (None: compile); NotImplementedError for valid inputs these
    kernels cannot run, before tracing."""
    D = q.shape[3]
    if jnp.dtype(q.dtype) not in _DTYPES:
        raise NotImplementedError(
            f"implementation 'mosaic_gpu' runs bfloat16 and float16 (tensor cores); got {q.dtype}"
        )
    if D > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"implementation 'mosaic_gpu' supports head dims up to {MAX_HEAD_DIM}; got D={D}"
        )
    return _interpret_params()


def _pad(x, axis, size):
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


@dataclasses.dataclass(frozen=True)
class _Padded:
    """The kernels' view of one call: padded sizes and the tiles."""

    tiles: MosaicGpuTiles
    T: int
    S: int
    D: int

    @classmethod
    def of(cls, config, q, k):
        D = q.shape[3]
        tiles = default_tiles(D, config.block_sizes)
        T, S = q.shape[1], k.shape[1]
        round_up = lambda n, m: -(-max(n, 1) // m) * m  # noqa: E731
        D_pad = round_up(D, SWIZZLE_ELEMENTS)
        return cls(tiles, round_up(T, tiles.q_multiple), round_up(S, tiles.kv_multiple), D_pad)

    def queries(self, x):  # [B, T, H, D] or [B, H, T] (lse, delta)
        if x.ndim == 3:
            return _pad(x, 2, self.T)
        return _pad(_pad(x, 1, self.T), 3, self.D)

    def keys(self, x):
        return _pad(_pad(x, 1, self.S), 3, self.D)


def _zero_rows(x, keep):
    """`x [B, L, N, D]` with rows where `keep [B | 1, L]` is False zeroed, if there are any."""
    keep = keep[:, :, None, None]
    return jax.lax.cond(
        jnp.all(keep), lambda x: x, lambda x: jnp.where(keep, x, jnp.zeros_like(x)), x
    )


def forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """`(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])`; see `protocol.AttentionBackend`."""
    interpret = _check_supported(q)
    return _forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, interpret=interpret)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("interpret",))
def _forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, interpret):
    B, T, H, D = q.shape
    S = k.shape[1]
    pad = _Padded.of(config, q, k)
    tiles = pad.tiles
    _, seen = masks.visibility_flags(config, q_pos, kv_pos, q_seg, kv_seg)
    v = _zero_rows(v, seen)  # 0 * NaN in P V would reach visible rows
    visible, full = masks.block_table(
        config, q_pos, kv_pos, q_seg, kv_seg, 2 * tiles.block_q, tiles.block_kv
    )
    ranges = masks.visit_ranges(visible, full, B)
    out, lse = forward_kernel.forward(
        pad.queries(q), pad.keys(k), pad.keys(v),
        _pad(q_pos, 0, pad.T), _pad(kv_pos, 0, pad.S),
        _pad(q_seg, 1, pad.T), _pad(kv_seg, 1, pad.S), ranges,
        config=config, block_q=tiles.block_q, block_kv=tiles.block_kv, stages=tiles.stages,
        length_kv=S, interpret=interpret,
    )  # fmt: skip
    return out[:, :T, :, :D], lse[:, :, :T]


def backward(
    config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse, *, grad_dtype=jnp.float32
):
    """`(dq, dk, dv)` in `grad_dtype` from the (possibly global) `out` and `lse`."""
    interpret = _check_supported(q)
    return _backward(
        config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
        grad_dtype=jnp.dtype(grad_dtype), interpret=interpret,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("grad_dtype", "interpret"))
def _backward(
    config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse, *, grad_dtype, interpret
):
    B, T, H, D = q.shape
    S = k.shape[1]
    pad = _Padded.of(config, q, k)
    tiles = pad.tiles
    lse, delta = protocol.backward_row_stats(out, lse, d_out, d_lse)
    sees, seen = masks.visibility_flags(config, q_pos, kv_pos, q_seg, kv_seg)
    q, k, v = _zero_rows(q, sees), _zero_rows(k, seen), _zero_rows(v, seen)
    table = functools.partial(masks.block_table, config, q_pos, kv_pos, q_seg, kv_seg)
    dkdv_visible, dkdv_full = table(
        tiles.dkdv_block_q, tiles.backward_consumers * tiles.dkdv_block_kv
    )
    dkdv_ranges = masks.visit_ranges(dkdv_visible.swapaxes(1, 2), dkdv_full.swapaxes(1, 2), B)
    dq_ranges = masks.visit_ranges(
        *table(tiles.backward_consumers * tiles.dq_block_q, tiles.dq_block_kv), B
    )
    args = (
        pad.queries(q), pad.keys(k), pad.keys(v), pad.queries(d_out.astype(q.dtype)),
        pad.queries(lse * LOG2E), pad.queries(delta),
        _pad(q_pos, 0, pad.T), _pad(kv_pos, 0, pad.S),
        _pad(q_seg, 1, pad.T), _pad(kv_seg, 1, pad.S),
    )  # fmt: skip
    common = dict(
        config=config, length_kv=S, grad_dtype=grad_dtype, consumers=tiles.backward_consumers,
        interpret=interpret,
    )  # fmt: skip
    dkdv = functools.partial(
        backward_kernels.dkdv, *args, dkdv_ranges, block_q=tiles.dkdv_block_q,
        block_kv=tiles.dkdv_block_kv, stages=tiles.backward_stages, **common,
    )  # fmt: skip
    if tiles.split_dkdv:
        ((dk,), (dv,)) = dkdv(compute=("dk",)), dkdv(compute=("dv",))
    else:
        dk, dv = dkdv()

    dq = backward_kernels.dq(
        *args, dq_ranges, block_q=tiles.dq_block_q, block_kv=tiles.dq_block_kv,
        stages=tiles.backward_stages, **common,
    )  # fmt: skip
    return dq[:, :T, :, :D], dk[:, :S, :, :D], dv[:, :S, :, :D]


_flash = protocol.differentiable(forward, backward)


def flash_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Flash attention with Pallas Mosaic GPU kernels on validated inputs.

    Args:
      config: the validated `AttentionConfig`; `config.block_sizes` may set
        `block_q=64` and `block_kv` (64 or 128; 64 above head dim 128) of the
        forward and dQ kernels.
      q: `[B, T, H, D]` bfloat16 or float16, D <= 256.
      k, v: `[B, S, K, D]`, `H % K == 0` (GQA/MQA read kv head `h // (H // K)`).
      q_pos, kv_pos: int32 `[T]`, `[S]` absolute positions.
      q_seg, kv_seg: None or int `[B, T]`, `[B, S]` segment ids.

    Returns:
      `(out [B, T, H, D] in q's dtype, lse float32 [B, H, T])`, differentiable.

    Raises:
      NotImplementedError: no sm_90+ GPU (and no interpret mode here), float32,
        head dim > 256, or block sizes these kernels cannot tile.

    Example:
      On an H100, through the public API:

      >>> import jax, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (1, 1024, 8, 128), jax.numpy.bfloat16)
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 1024, 2, 128), jax.numpy.bfloat16)
      >>> out = sf.flash_attention(  # doctest: +SKIP
      ...     q, k, v, causal=True, implementation="mosaic_gpu")
    """
    _check_supported(q)  # NotImplementedError before tracing
    default_tiles(q.shape[3], config.block_sizes)
    return _flash(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg)
