"""Flash-decoding as a Pallas kernel lowered by Mosaic for TPU.

Grid `(B, N)`: one step per batch row and cache chunk of `block_kv` rows, both
axes parallel (the chunks are flash-decoding's splits). A step reads the
row's queries `[H, Tp, D]` (q is tiny: T padded to a multiple of 8 sublanes)
and one chunk of the cache viewed as `[B, S, K * D]` (a free reshape: the
cache is never transposed), so each kv head is a lane-aligned slice
`[C, D]`; for each of its G query heads it computes the chunk's scores
`[Tp, C]`, masks them (positions from the row's length, read from scalar
prefetch), and writes the chunk's normalised output and lse. The wrapper
merges the chunks by lse (`base.merge_partials`).

Chunks that hold no visible key (beyond the row's length, or before its
window) do no work and copy nothing: the K/V index map clamps them to the
nearest chunk that is computed, and Pallas skips a copy whose block index
did not change. Values of cache rows nobody sees are zeroed before the PV
product, so garbage (NaN) in the unused cache never leaks.

On CPU the kernel runs in TPU interpret mode (`pallas_interpret`). Forward only.

Axis glossary: B batch, T queries (Tp padded), S cache length (Sp padded),
H query heads, K kv heads, G = H // K, D head dim, N chunks, C rows per chunk.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.kernels import vma
from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.base import apply_softcap
from shardfuse.kernels.attention.pallas_tpu_blocks import NUM_LANES, NUM_SUBLANES
from shardfuse.kernels.attention.pallas_tpu_layout import TPU_DTYPES, pad
from shardfuse.kernels.decode_attention import base
from shardfuse.kernels.pallas_interpret import current_interpret_params
from shardfuse.kernels.precision import dot_precision

DEFAULT_BLOCK_KV = 512
NT_DIMS = (((1,), (1,)), ((), ()))  # a @ b.T
NN_DIMS = (((1,), (0,)), ((), ()))  # a @ b


@dataclasses.dataclass(frozen=True)
class _Static:
    config: base.DecodeConfig
    T: int
    K: int
    G: int
    D: int
    block_kv: int
    precision: lax.Precision


def chunk_size(S: int, requested: int | None) -> int:
    """Cache rows per chunk: a multiple of 128 (the scores' lane dim), at most the padded S.

    Raises:
      NotImplementedError: a requested size that is not a multiple of 128.

    Example:
      >>> chunk_size(100, None), chunk_size(4096, None), chunk_size(4096, 256)
      (128, 512, 256)
    """
    if requested is not None and requested % NUM_LANES:
        raise NotImplementedError(
            f"pallas_tpu decode attention needs block_kv to be a multiple of {NUM_LANES} "
            f"(the lane width); got block_kv={requested}"
        )
    size = requested or DEFAULT_BLOCK_KV
    return min(size, -(-S // NUM_LANES) * NUM_LANES)


def check_supported(q, k):
    """NotImplementedError for valid inputs this kernel cannot run (dtype, head dim)."""
    D = q.shape[-1]
    if jnp.dtype(q.dtype) not in TPU_DTYPES:
        raise NotImplementedError(
            f"pallas_tpu supports float32 and bfloat16 inputs, got {q.dtype} "
            "(TPUs have no float16 MXU path: use bfloat16)"
        )
    if D % NUM_LANES:
        raise NotImplementedError(
            f"pallas_tpu decode attention needs head dim D to be a multiple of {NUM_LANES}: "
            f"each kv head is a lane-aligned slice of the [B, S, K * D] cache; got D={D}"
        )


def _kernel(lengths_ref, first_ref, last_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *, st):
    b, chunk = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]
    computed = (chunk >= first_ref[b]) & (chunk <= last_ref[b])
    Tp, C, D = q_ref.shape[1], st.block_kv, st.D

    @pl.when(computed)
    def _():
        start = chunk * C
        rows = lax.broadcasted_iota(jnp.int32, (Tp, C), 0)
        cols = start + lax.broadcasted_iota(jnp.int32, (Tp, C), 1)
        q_pos = length - st.T + rows
        valid = (cols < length) & (rows < st.T)
        mask = masks.visible(st.config.attention, q_pos, cols, valid=valid)  # [Tp, C]
        # Cache rows some query sees: [length - T - left, length - 1].
        key_rows = start + lax.broadcasted_iota(jnp.int32, (C, D), 0)
        seen = key_rows < length
        if st.config.window_left is not None:
            seen = seen & (key_rows >= length - st.T - st.config.window_left)
        for kv_head in range(st.K):
            lanes = slice(kv_head * D, (kv_head + 1) * D)
            k = k_ref[:, lanes]  # [C, D]
            v = jnp.where(seen, v_ref[:, lanes], 0)
            for g in range(st.G):
                h = kv_head * st.G + g
                s = lax.dot_general(
                    q_ref[h], k, NT_DIMS, preferred_element_type=jnp.float32,
                    precision=st.precision,
                )  # fmt: skip
                s = apply_softcap(s * st.config.scale, st.config.logit_softcap)
                s = jnp.where(mask, s, -jnp.inf)
                m = jnp.max(s, axis=1, keepdims=True)  # [Tp, 1]
                m_safe = jnp.where(m == -jnp.inf, 0.0, m)
                p = jnp.exp(s - m_safe)  # masked: exp(-inf) = 0
                denom = jnp.sum(p, axis=1, keepdims=True)
                o = lax.dot_general(
                    p.astype(v.dtype), v, NN_DIMS, preferred_element_type=jnp.float32,
                    precision=st.precision,
                )  # fmt: skip
                has_key = denom > 0
                safe = jnp.where(has_key, denom, 1.0)
                out_ref[h] = o / safe
                lse = jnp.where(has_key, m_safe + jnp.log(safe), -jnp.inf)
                lse_ref[h] = jnp.broadcast_to(lse, (Tp, NUM_LANES))

    @pl.when(jnp.logical_not(computed))
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)
        lse_ref[...] = jnp.full(lse_ref.shape, -jnp.inf, lse_ref.dtype)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("interpret",))
def _partials(config, q, k, v, lengths, *, interpret):
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    C = chunk_size(S, config.block_kv)
    N = -(-S // C)
    Sp, Tp = N * C, -(-T // NUM_SUBLANES) * NUM_SUBLANES
    q_t = pad(q.transpose(0, 2, 1, 3), 2, Tp)  # [B, H, Tp, D]: q is tiny
    k_flat = pad(k.reshape(B, S, K * D), 1, Sp)  # [B, Sp, K * D]: a view unless S % C
    v_flat = pad(v.reshape(B, S, K * D), 1, Sp)
    first, last = base.chunk_bounds(config, lengths, T, C, N)

    def kv_block(b, c, lengths_ref, first_ref, last_ref):
        # Skipped chunks re-use the block already in VMEM: no copy.
        return b, jnp.minimum(jnp.maximum(c, first_ref[b]), jnp.maximum(last_ref[b], 0)), 0

    st = _Static(config, T, K, G, D, C, dot_precision(q.dtype))
    out, lse = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, N),
            in_specs=[
                pl.BlockSpec((None, H, Tp, D), lambda b, c, *_: (b, 0, 0, 0)),
                pl.BlockSpec((None, C, K * D), kv_block),
                pl.BlockSpec((None, C, K * D), kv_block),
            ],
            out_specs=[
                pl.BlockSpec((None, None, H, Tp, D), lambda b, c, *_: (b, c, 0, 0, 0)),
                pl.BlockSpec((None, None, H, Tp, NUM_LANES), lambda b, c, *_: (b, c, 0, 0, 0)),
            ],
        ),
        out_shape=[  # inside shard_map: varying like the inputs
            vma.shape_dtype_struct((B, N, H, Tp, D), jnp.float32, like=q_t),
            vma.shape_dtype_struct((B, N, H, Tp, NUM_LANES), jnp.float32, like=q_t),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=pl.CostEstimate(
            flops=int(4 * B * H * Tp * Sp * D),
            transcendentals=int(B * H * Tp * Sp),
            bytes_accessed=int(2 * k.size * k.dtype.itemsize + 2 * q.size * q.dtype.itemsize),
        ),
        interpret=interpret,
        name="shardfuse_decode_attention",
    )(lengths, first, last, q_t, k_flat, v_flat)
    out_part = out[:, :, :, :T].transpose(0, 1, 3, 2, 4)  # [B, N, T, H, D]
    lse_part = lse[:, :, :, :T, 0].transpose(0, 1, 3, 2)  # [B, N, T, H]
    return base.merge_partials(out_part, lse_part, q.dtype)


def decode_attention(config: base.DecodeConfig, q, k, v, lengths, *, interpret=None):
    """Pallas TPU decode attention on validated inputs: `(out [B, T, H, D], lse [B, H, T])`.

    Called by `shardfuse.decode_attention(..., implementation="pallas_tpu")`,
    which validates first; Mosaic on TPU, TPU interpret mode on CPU
    (`interpret`: a `pltpu.InterpretParams`, False, or None for
    `pallas_interpret.current_interpret_params`).

    Raises:
      NotImplementedError: float16, a head dim that is not a multiple of 128,
        a block_kv that is not a multiple of 128, or a backend that is neither
        TPU nor CPU.

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (1, 2, 4, 128))
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 300, 2, 128))
      >>> out = sf.decode_attention(q, k, v, jnp.array([200]), implementation="pallas_tpu")
      >>> out.shape
      (1, 2, 4, 128)
    """
    check_supported(q, k)
    chunk_size(k.shape[1], config.block_kv)  # NotImplementedError before any tracing
    interpret = current_interpret_params(interpret)
    return _partials(config, q, k, v, lengths.astype(jnp.int32), interpret=interpret)
