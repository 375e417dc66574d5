"""Flash-decoding on NVIDIA GPUs: the Triton kernel of `triton_kernels.py` through jax-triton.

The wrapper picks the tile config (`DecodeKernelConfig`, per GPU generation
and input class), launches one program per (cache split of `block_kv` rows,
batch row, kv head), and merges the splits' partial outputs by lse
(`base.merge_partials`). Without an NVIDIA GPU (compute capability >= 8.0),
triton or jax_triton, `decode_attention` raises NotImplementedError with the
reason, so that dispatch falls back; on CPU the kernel runs under the Triton
interpreter with `launcher=triton.launch.InterpretLauncher()`. Forward only.

Axis glossary: B batch, T queries, S cache length, H query heads, K kv heads,
G = H // K, D head dim, N splits.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse.kernels.attention import triton_configs
from shardfuse.kernels.decode_attention import base
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import generation

KERNELS_MODULE = "shardfuse.kernels.decode_attention.triton_kernels"
KERNEL_NAME = "decode_attention_kernel"
DEFAULT_SPLIT = 512  # cache rows per split (program) by default
MAX_ROWS = 128  # G * T query rows one program holds
MAX_ROWS_WIDE = 64  # ... at head dims above 128 (more spills: 16-bit D=256 at 128 rows)
MAX_HEAD_DIM = 256
_MAX_GRID_Y = 65535  # CUDA's limit on the second grid dimension (B * K programs)


@dataclasses.dataclass(frozen=True)
class DecodeKernelConfig:
    """Tile shape and launch options of the decode kernel.

    Attributes:
      block_n: cache rows per tile of the inner loop (a power of two >= 16).
      num_warps: warps per program.
      num_stages: software-pipelining stages of the inner loop.
    """

    block_n: int
    num_warps: int
    num_stages: int


# (generation, "16bit" | "float32", "small" | "large") -> config, "small" for programs of at
# most 16 query rows (G * T <= 16: the usual decode step), "large" up to MAX_ROWS. No GPU was
# available to time configs: these are the first candidates (larger tiles first) that compiled
# with 0 spills and shared memory within the limit for every head dim (16-bit up to 256,
# float32 up to 64) and both variants; `python -m shardfuse.bench.tools.triton_compile_stats
# --decode` lists them, and the compile tests (tests/kernels/decode_attention/
# test_triton_compile.py) hold every entry to that.
TUNED = {
    ("sm80", "16bit", "small"): DecodeKernelConfig(64, 4, 2),
    ("sm90", "16bit", "small"): DecodeKernelConfig(64, 4, 3),
    ("sm80", "float32", "small"): DecodeKernelConfig(32, 4, 1),
    ("sm90", "float32", "small"): DecodeKernelConfig(32, 4, 1),
    ("sm80", "16bit", "large"): DecodeKernelConfig(64, 8, 2),
    ("sm90", "16bit", "large"): DecodeKernelConfig(64, 8, 2),
    ("sm80", "float32", "large"): DecodeKernelConfig(16, 8, 1),
    ("sm90", "float32", "large"): DecodeKernelConfig(16, 8, 1),
}
MAX_FLOAT32_HEAD_DIM = 64  # exact float32 dots spill above it (as in flash attention)


def default_config(compute_capability: int, head_dim: int, dtype, rows: int = 1):
    """The tuned `DecodeKernelConfig` for `rows = G * T` query rows per program.

    Raises:
      NotImplementedError: a head dim beyond the kernel's (256; float32: 64).

    Example:
      >>> default_config(90, 128, jnp.bfloat16)
      DecodeKernelConfig(block_n=64, num_warps=4, num_stages=3)
    """
    kind = "float32" if np.dtype(dtype) == np.float32 else "16bit"
    limit = MAX_FLOAT32_HEAD_DIM if kind == "float32" else MAX_HEAD_DIM
    if head_dim > limit:
        raise NotImplementedError(
            f"the Triton decode-attention kernel takes {np.dtype(dtype).name} inputs up to head "
            f"dim {limit}; got D={head_dim}"
        )
    size = "small" if rows <= 16 else "large"
    return TUNED[(generation(compute_capability), kind, size)]


def block_rows(G: int, T: int) -> int:
    """`BLOCK_M`: the `G * T` query rows of a program, padded to a power of two >= 16."""
    return max(16, 1 << (G * T - 1).bit_length())


def split_size(S: int, requested: int | None, block_n: int) -> int:
    """Cache rows per split: `requested`, else 512, at most S rounded up to a tile."""
    size = requested or DEFAULT_SPLIT
    return max(1, min(size, -(-S // block_n) * block_n))


def kernel_constexprs(config: base.DecodeConfig, dtype, *, T, S, H, K, D, split, tile):
    """The kernel's `tl.constexpr` keywords."""
    left = config.window_left
    return dict(
        T=T,
        S=S,
        H=H,
        K=K,
        D=D,
        NUM_SPLITS=-(-S // split),
        SPLIT=split,
        BLOCK_M=block_rows(H // K, T),
        BLOCK_N=tile.block_n,
        BLOCK_D=triton_configs.padded_head_dim(D),
        SCALE=float(config.scale),
        SOFTCAP=float(config.logit_softcap or 0.0),
        WINDOW_LEFT=-1 if left is None else int(left),
        IEEE=jnp.dtype(dtype) == jnp.float32,
    )


def _check_supported(q, k):
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    max_rows = MAX_ROWS if D <= 128 else MAX_ROWS_WIDE
    if (H // K) * T > max_rows:
        raise NotImplementedError(
            f"implementation 'triton' holds the G * T = {(H // K) * T} query rows of a kv head "
            f"in one program; at most {max_rows} at D={D} (G = H // K = {H // K}, T = {T})"
        )
    if B * K > _MAX_GRID_Y:
        raise NotImplementedError(
            f"implementation 'triton' launches B * K = {B * K} programs on the second grid "
            f"axis; CUDA allows at most {_MAX_GRID_Y}"
        )
    if max(T * H * D, S * K * D) >= 2**31:
        raise NotImplementedError(
            f"implementation 'triton' indexes one batch row with int32: T * H * D = "
            f"{T * H * D} and S * K * D = {S * K * D} must be < 2**31"
        )


def decode_attention(config: base.DecodeConfig, q, k, v, lengths, *, launcher=None):
    """Triton decode attention on validated inputs: `(out [B, T, H, D], lse [B, H, T])`.

    Args:
      config: the validated `DecodeConfig`; `block_kv` is the split size.
      q: `[B, T, H, D]` float32, bfloat16 or float16.
      k, v: `[B, S, K, D]`, `H % K == 0`.
      lengths: int32 `[B]` in `[0, S]`.
      launcher: None for jax-triton on this machine's GPU, or
        `triton.launch.InterpretLauncher()` to run the kernel on CPU.

    Raises:
      NotImplementedError: no usable NVIDIA GPU, triton or jax_triton (with
        launcher=None), a head dim beyond the kernel's, more than 128 query
        rows per kv head (G * T; 64 above D=128), or sizes beyond its int32 indexing.

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)
      >>> k = v = jnp.ones((1, 4096, 2, 128), jnp.bfloat16)
      >>> out = sf.decode_attention(q, k, v, jnp.array([4000]),  # doctest: +SKIP
      ...                           implementation="triton")
    """
    _check_supported(q, k)
    launcher = launch.resolve(launcher, KERNELS_MODULE)
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    tile = default_config(launcher.compute_capability, D, q.dtype, (H // K) * T)
    split = split_size(S, config.block_kv, tile.block_n)
    N = -(-S // split)
    constexprs = kernel_constexprs(config, q.dtype, T=T, S=S, H=H, K=K, D=D, split=split, tile=tile)
    out_part, lse_part = launcher(
        KERNEL_NAME,
        [q, k, v, lengths.astype(jnp.int32)],
        [
            jax.ShapeDtypeStruct((B, N, T, H, D), jnp.float32),
            jax.ShapeDtypeStruct((B, N, T, H), jnp.float32),
        ],
        (N, B * K),
        tile,
        constexprs,
    )
    return base.merge_partials(out_part, lse_part, q.dtype)
