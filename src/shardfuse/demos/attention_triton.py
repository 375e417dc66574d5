"""Demo section: the Triton flash attention kernels vs the reference.

On an NVIDIA GPU the kernels run through jax-triton (bfloat16, causal GQA
4:1, D = 128). On CPU, if torch and triton are installed (the `test` extra),
the same kernels run under the Triton interpreter on a tiny float32 case: its
time measures a Python simulator, not a GPU. Forward and forward + backward.
"""

import importlib.util

import jax
import jax.numpy as jnp

from shardfuse.demos import time_call
from shardfuse.testing import max_abs_error


def _inputs(seq_len, D, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, seq_len, 4, D), dtype)
    k = jax.random.normal(keys[1], (1, seq_len, 1, D), dtype)
    v = jax.random.normal(keys[2], (1, seq_len, 1, D), dtype)
    return q, k, v, jax.random.normal(keys[3], q.shape, dtype)


def rows(seq_len: int = 512):
    """triton (jax-triton on GPU, the interpreter on CPU), causal GQA 4:1, vs the reference.

    Example:
      >>> from shardfuse.demos import attention_triton
      >>> rows = attention_triton.rows(seq_len=64)  # doctest: +SKIP
    """
    from shardfuse.kernels.attention import api, base, triton_gpu
    from shardfuse.kernels.triton.launch import InterpretLauncher

    on_gpu = jax.default_backend() in ("gpu", "cuda")
    if not on_gpu and not all(importlib.util.find_spec(m) for m in ("torch", "triton")):
        return []  # nothing to run the kernels with
    if on_gpu:
        q, k, v, d_out = _inputs(seq_len, 128, jnp.bfloat16)
        mode = "jax-triton"

        def attend(q, k, v):
            return api.flash_attention(q, k, v, causal=True, implementation="triton")
    else:
        q, k, v, d_out = _inputs(min(seq_len, 64), 32, jnp.float32)
        mode = "Triton interpreter"
        config = base.AttentionConfig(
            causal=True,
            window=None,
            logit_softcap=None,
            scale=q.shape[-1] ** -0.5,
            block_sizes=base.BlockSizes(16, 16),
        )
        q_pos, kv_pos = base.default_positions(q.shape[1], k.shape[1])

        def attend(q, k, v):
            out, _ = triton_gpu.flash_attention(
                config, q, k, v, q_pos, kv_pos, None, None, launcher=InterpretLauncher()
            )
            return out

    def reference(q, k, v):
        return api.attention_reference(q, k, v, causal=True)

    def with_grads(fn):
        def run(q, k, v):
            out, vjp = jax.vjp(fn, q, k, v)
            return out, *vjp(d_out)

        return jax.jit(run)

    shape = f"q {tuple(q.shape)} kv {tuple(k.shape)}"
    result = []
    for op, fn, expected_fn in (
        ("flash_attention", jax.jit(attend), jax.jit(reference)),
        ("flash_attention fwd+bwd", with_grads(attend), with_grads(reference)),
    ):
        got, expected = fn(q, k, v), expected_fn(q, k, v)
        got, expected = jax.tree.leaves(got), jax.tree.leaves(expected)
        result.append(
            dict(
                op=op,
                implementation="triton",
                case=f"causal, GQA 4:1, {q.dtype.name}, {mode}",
                shape=shape,
                error=max(max_abs_error(a, b) for a, b in zip(got, expected, strict=True)),
                seconds=time_call(fn, q, k, v, repeats=1 if not on_gpu else 3),
            )
        )
    return result
