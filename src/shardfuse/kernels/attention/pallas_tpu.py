"""Flash attention as Pallas kernels lowered by Mosaic for TPU, forward and backward.

FlashAttention-2 (Dao 2023; FlashAttention, Dao et al. 2022): the forward
kernel streams K/V blocks past a resident query block with an online softmax
and writes the output and the float32 lse; the backward recomputes the
probabilities from lse in two kernels, one for dQ and one for dK and dV
(kernel bodies in pallas_tpu_kernels, tiling in pallas_tpu_blocks).

The wrapper lays q out as `[B, H, T, D]` and k, v as `[B, K, S, D]`, pads the
sequences to block multiples (the padding is masked by index, so the kernels
never read out of bounds), and passes per-block tables as scalar prefetch: a
block that no query of the tile can see (causal, window, disjoint segment
ids, padding) does no MXU work, and its K/V are not copied: the index map
clamps it to the next computed block, as splash attention does. GQA/MQA read
kv head `h // G` through the index map; K/V are never repeated.

On a CPU backend the kernels run in TPU interpret mode (`pltpu.InterpretParams`),
so the TPU path can be debugged and tested on a laptop;
`shardfuse.kernels.pallas_interpret.interpret_mode` picks the mode explicitly
(tests use it to pass stricter params, and to emit
Mosaic for `lower(lowering_platforms=("tpu",))` from a CPU host). JAX's TPU
interpreter (jax 0.10) runs JAX operations inside its host callbacks: wait
for an interpreted call's results (`jax.block_until_ready`) before
dispatching other work to the CPU device, or the two can deadlock.

Axis names: as in the glossary of pallas_tpu_layout.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.kernels.attention import base, protocol
from shardfuse.kernels.attention import pallas_tpu_blocks as blocks
from shardfuse.kernels.attention import pallas_tpu_kernels as kernels
from shardfuse.kernels.attention.pallas_tpu_blocks import NUM_LANES, PallasTPUBlockSizes
from shardfuse.kernels.attention.pallas_tpu_bwd import backward
from shardfuse.kernels.attention.pallas_tpu_layout import (
    Layout,
    check_supported,
    checked_call,
)
from shardfuse.kernels.pallas_interpret import current_interpret_params

__all__ = ["PallasTPUBlockSizes", "backward", "flash_attention", "forward"]


def forward(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, interpret=None):
    """Forward kernel on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`.

    Positions are int32 `[T]` / `[S]`, segment ids None or `[B, T]` / `[B, S]`;
    `interpret` is the pallas_call `interpret=` value: a `pltpu.InterpretParams`,
    False (Mosaic), or None (`pallas_interpret.current_interpret_params`). Used by
    `flash_attention` and by collectives that merge partial results.

    Example:
      >>> from jax.experimental.pallas import tpu as pltpu
      >>> q = k = v = jnp.ones((1, 100, 2, 64))
      >>> config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=0.125)
      >>> pos = jnp.arange(100, dtype=jnp.int32)
      >>> mode = pltpu.InterpretParams()  # on a TPU: False
      >>> out, lse = forward(config, q, k, v, pos, pos, None, None, interpret=mode)
      >>> out.shape, lse.shape
      ((1, 100, 2, 64), (1, 2, 100))
    """
    interpret = current_interpret_params(interpret)
    return _forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, interpret=interpret)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("interpret",))
def _forward(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, interpret):
    sizes = check_supported(q, config.block_sizes)
    lay = Layout(config, q, k, q_pos, kv_pos, q_seg, kv_seg, sizes.block_q, sizes.block_kv)
    B, H, D, bq = lay.B, lay.H, lay.D, lay.block_q
    q_t, k_t, v_t = (
        lay.heads_first(q, lay.Tp),
        lay.heads_first(k, lay.Sp),
        lay.heads_first(v, lay.Sp),
    )
    q_spec, kv_spec, mask_specs = lay.query_major_specs()
    in_specs = [q_spec, kv_spec, kv_spec, *mask_specs]
    out_shape = [
        jax.ShapeDtypeStruct(q_t.shape, q.dtype),
        jax.ShapeDtypeStruct((B, H, lay.Tp, NUM_LANES), jnp.float32),
    ]
    out_specs = [
        q_spec,
        pl.BlockSpec((None, None, bq, NUM_LANES), lambda b, h, i, j, *_: (b, h, i, 0)),
    ]
    scratch = [
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),
        pltpu.VMEM((bq, NUM_LANES), jnp.float32),
        pltpu.VMEM((bq, D), jnp.float32),
    ]
    args = (lay.states, blocks.fetch_indices(lay.states), q_t, k_t, v_t, *lay.mask_arrays)
    out, lse = checked_call(
        kernels.forward_kernel,
        lay,
        config,
        matmuls=2,
        name="shardfuse_flash_attention_fwd",
        grid=(B, H, lay.nq, lay.nk),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=scratch,
        args=args,
        interp=interpret,
    )
    out = out[:, :, : lay.T].transpose(0, 2, 1, 3)
    return out, lse[:, :, : lay.T, 0]


_flash = protocol.differentiable(forward, backward)


def flash_attention(config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg):
    """Pallas TPU flash attention on validated inputs: `(out [B, T, H, D], lse float32 [B, H, T])`.

    Differentiable (`protocol.differentiable`: the FlashAttention-2 backward kernels). Called by
    `shardfuse.flash_attention(..., implementation="pallas_tpu")`, which
    validates the inputs first; the kernels run as Mosaic on TPU and in TPU
    interpret mode on CPU (see `pallas_interpret.interpret_mode`).

    Args:
      config: the validated `AttentionConfig` (masks, softcap, scale, block sizes).
      q: `[B, T, H, D]` float32 or bfloat16.
      k, v: `[B, S, K, D]`, `H % K == 0`.
      q_pos, kv_pos: int32 `[T]`, `[S]` absolute positions.
      q_seg, kv_seg: None or int `[B, T]`, `[B, S]` segment ids.

    Returns:
      `out` `[B, T, H, D]` in q's dtype and `lse` float32 `[B, H, T]` (-inf
      for rows without a visible key, whose output is 0).

    Raises:
      NotImplementedError: float16, a head dim other than 64 or a multiple of
        128, block sizes that are not multiples of 128, or a backend that is
        neither TPU nor CPU.

    Example:
      >>> import jax, shardfuse as sf
      >>> q = jax.random.normal(jax.random.key(0), (1, 128, 4, 128))
      >>> k = v = jax.random.normal(jax.random.key(1), (1, 128, 2, 128))
      >>> out = sf.flash_attention(q, k, v, causal=True, implementation="pallas_tpu")
      >>> out.shape
      (1, 128, 4, 128)
    """
    check_supported(q, config.block_sizes)  # NotImplementedError before any tracing
    interpret = current_interpret_params(None)
    return _flash(config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, interpret=interpret)
