"""Backward of the Pallas TPU flash attention: the dQ and the dK/dV pallas_calls.

FlashAttention-2 backward (Dao 2023): recompute `p = exp(s - lse)` block by
block from the saved float32 lse; `delta = rowsum(dO * O) - dlse` is one XLA
reduction here. The dQ kernel walks the key blocks of each query block
(grid `(B, H, nq, nk)`); the dK/dV kernel walks, per kv head and key block,
every query head of its group and every query block (grid
`(B, K, nk, G * nq)`), so GQA gradients are summed in VMEM and K/V are never
repeated. Both skip blocks by the tables of pallas_tpu_blocks; the dK/dV
kernel uses the transposed table (and clamps the q, dO, lse and delta
block indices of skipped steps).

Axis names: as in the glossary of pallas_tpu_layout.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from shardfuse.kernels.attention import base, protocol
from shardfuse.kernels.attention import pallas_tpu_blocks as blocks
from shardfuse.kernels.attention import pallas_tpu_kernels as kernels
from shardfuse.kernels.attention.pallas_tpu_blocks import NUM_SUBLANES
from shardfuse.kernels.attention.pallas_tpu_layout import (
    Layout,
    check_supported,
    checked_call,
    pad,
)
from shardfuse.kernels.pallas_interpret import current_interpret_params


def _dq(config, lay: Layout, q_t, k_t, v_t, do_t, lse, delta, interpret, grad_dtype):
    """dQ `[B, H, Tp, D]` by the dq kernel; lse and delta are `[B, H, 1, Tp]`."""
    B, H, D, bq = lay.B, lay.H, lay.D, lay.block_q
    q_spec, kv_spec, mask_specs = lay.query_major_specs()
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda b, h, i, j, *_: (b, h, 0, i))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec, *mask_specs]
    out_shape = [jax.ShapeDtypeStruct(q_t.shape, grad_dtype)]
    args = (lay.states, blocks.fetch_indices(lay.states), q_t, k_t, v_t, do_t, lse, delta)
    args += tuple(lay.mask_arrays)
    (dq,) = checked_call(
        kernels.dq_kernel,
        lay,
        config,
        matmuls=3,
        name="shardfuse_flash_attention_bwd_dq",
        grid=(B, H, lay.nq, lay.nk),
        in_specs=in_specs,
        out_specs=[q_spec],
        out_shape=out_shape,
        scratch=[pltpu.VMEM((bq, D), jnp.float32)],
        args=args,
        interp=interpret,
    )
    return dq


def _dkv(config, lay: Layout, q_t, k_t, v_t, do_t, lse, delta, interpret, grad_dtype):
    """dK, dV `[B, K, Sp, D]` by the dkv kernel; lse and delta are `[B, H, 8, Tp]`."""
    B, K, G, D, bq, bk, nq = lay.B, lay.K, lay.G, lay.D, lay.block_q, lay.block_kv, lay.nq
    states = lay.states.transpose(0, 2, 1)  # [B, nk, nq]

    def q_block(b, kh, j, t, states_ref, fetch_ref):
        return fetch_ref[b, j, lax.rem(t, nq)]

    def kv_block(b, kh, j, t, *_):
        return j

    def q_head(kh, t):
        return kh * G + lax.div(t, nq)

    q_spec = pl.BlockSpec(
        (None, None, bq, D), lambda b, kh, j, t, *r: (b, q_head(kh, t), q_block(b, kh, j, t, *r), 0)
    )
    kv_spec = pl.BlockSpec((None, None, bk, D), lambda b, kh, j, t, *_: (b, kh, j, 0))
    row_spec = pl.BlockSpec(
        (None, None, NUM_SUBLANES, bq),
        lambda b, kh, j, t, *r: (b, q_head(kh, t), 0, q_block(b, kh, j, t, *r)),
    )
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    in_specs += lay.mask_specs(q_block, kv_block)
    out_shape = [jax.ShapeDtypeStruct(k_t.shape, grad_dtype)] * 2
    args = (states, blocks.fetch_indices(states), q_t, k_t, v_t, do_t, lse, delta)
    args += tuple(lay.mask_arrays)
    dk, dv = checked_call(
        kernels.dkv_kernel,
        lay,
        config,
        matmuls=4,
        name="shardfuse_flash_attention_bwd_dkv",
        grid=(B, K, lay.nk, G * nq),
        in_specs=in_specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=out_shape,
        scratch=[pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, D), jnp.float32)],
        args=args,
        interp=interpret,
    )
    return dk, dv


def backward(
    config: base.AttentionConfig, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
    *, interpret=None, grad_dtype=jnp.float32,
):  # fmt: skip
    """Gradients `(dq, dk, dv)` in `grad_dtype` from the saved `out` and float32 `lse`.

    `out` and `lse` may be those of a larger attention that this call is one
    block of (ring attention): `delta = rowsum(d_out * out) - d_lse` and
    `p = exp(s - lse)` then give this block's share of the gradients.

    Args:
      config: the validated `AttentionConfig`.
      q, k, v, q_pos, kv_pos, q_seg, kv_seg: as for `pallas_tpu.forward`.
      out: `[B, T, H, D]` attention output; lse: float32 `[B, H, T]`.
      d_out: `[B, T, H, D]` cotangent of out; d_lse: float32 `[B, H, T]`.
      interpret: the pallas_call `interpret=` value: a `pltpu.InterpretParams`, False
        (Mosaic) or None (chosen by `pallas_interpret.current_interpret_params`).
      grad_dtype: dtype of the returned gradients (float32 by default).

    Returns:
      `dq [B, T, H, D]`, `dk [B, S, K, D]`, `dv [B, S, K, D]`.

    Example:
      >>> from jax.experimental.pallas import tpu as pltpu
      >>> from shardfuse.kernels.attention import base, pallas_tpu
      >>> q = k = v = jnp.ones((1, 128, 1, 128))
      >>> config = base.AttentionConfig(causal=True, window=None, logit_softcap=None, scale=0.1)
      >>> pos = jnp.arange(128, dtype=jnp.int32)
      >>> mode = pltpu.InterpretParams()  # on a TPU: False
      >>> out, lse = pallas_tpu.forward(config, q, k, v, pos, pos, None, None, interpret=mode)
      >>> dq, dk, dv = backward(config, q, k, v, pos, pos, None, None, out, lse,
      ...                       jnp.ones_like(out), jnp.zeros_like(lse), interpret=mode)
      >>> dq.shape, dk.dtype
      ((1, 128, 1, 128), dtype('float32'))
    """
    return _backward(
        config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse,
        interpret=current_interpret_params(interpret), grad_dtype=grad_dtype,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("interpret", "grad_dtype"))
def _backward(
    config, q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse, d_out, d_lse, *, interpret, grad_dtype
):
    sizes = check_supported(q, config.block_sizes)
    lay = Layout(config, q, k, q_pos, kv_pos, q_seg, kv_seg, sizes.block_q_bwd, sizes.block_kv_bwd)
    lse, delta = protocol.backward_row_stats(out, lse, d_out, d_lse)
    delta = pad(delta, 2, lay.Tp)[:, :, None, :]  # [B, H, 1, Tp]
    lse = pad(lse, 2, lay.Tp)[:, :, None, :]
    q_t, do_t = lay.heads_first(q, lay.Tp), lay.heads_first(d_out.astype(q.dtype), lay.Tp)
    k_t, v_t = lay.heads_first(k, lay.Sp), lay.heads_first(v, lay.Sp)
    dq = _dq(config, lay, q_t, k_t, v_t, do_t, lse, delta, interpret, grad_dtype)
    sublanes = (lay.B, lay.H, NUM_SUBLANES, lay.Tp)
    lse8, delta8 = jnp.broadcast_to(lse, sublanes), jnp.broadcast_to(delta, sublanes)
    dk, dv = _dkv(config, lay, q_t, k_t, v_t, do_t, lse8, delta8, interpret, grad_dtype)
    dq = dq[:, :, : lay.T].transpose(0, 2, 1, 3)
    dk = dk[:, :, : lay.S].transpose(0, 2, 1, 3)
    dv = dv[:, :, : lay.S].transpose(0, 2, 1, 3)
    return dq, dk, dv
