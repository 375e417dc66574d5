"""Demo section: the Pallas TPU flash attention kernels vs the reference.

On a TPU the kernels are compiled by Mosaic; on CPU they run in TPU
interpret mode (a simulator: its time says nothing about TPU speed, it is
shown next to the xla path for scale). Forward and forward + backward.
"""

import jax
import jax.numpy as jnp

from shardfuse.demos import time_call
from shardfuse.testing import max_abs_error


def rows(seq_len: int = 512):
    """pallas_tpu (interpret mode on CPU) and xla, causal GQA 4:1, D = 128, vs the reference.

    Example:
      >>> from shardfuse.demos import attention_pallas_tpu
      >>> rows = attention_pallas_tpu.rows(seq_len=128)  # doctest: +SKIP
    """
    from shardfuse.kernels.attention import api

    seq_len = min(seq_len, 256)  # interpret mode simulates every grid step on the CPU
    B, H, K, D = 1, 4, 1, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, seq_len, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, seq_len, K, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, seq_len, K, D), jnp.float32)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)

    def forward_backward(impl):
        def loss_grads(q, k, v):
            out, vjp = jax.vjp(
                lambda q, k, v: api.flash_attention(q, k, v, causal=True, implementation=impl),
                q,
                k,
                v,
            )
            return out, *vjp(d_out)

        return jax.jit(loss_grads)

    expected = forward_backward("reference")(q, k, v)
    shape = f"q {tuple(q.shape)} kv {tuple(k.shape)}"
    result = []
    mode = "TPU interpret mode" if jax.default_backend() != "tpu" else "Mosaic"
    for impl in ("pallas_tpu", "xla"):
        fn = forward_backward(impl)
        try:
            got = fn(q, k, v)
        except NotImplementedError:  # pallas_tpu on a GPU backend
            continue
        result.append(
            dict(
                op="flash_attention fwd+bwd",
                implementation=impl,
                case=f"causal, GQA 4:1{', ' + mode if impl == 'pallas_tpu' else ''}",
                shape=shape,
                error=max(max_abs_error(a, b) for a, b in zip(got, expected, strict=True)),
                seconds=time_call(fn, q, k, v),
            )
        )
    return result
