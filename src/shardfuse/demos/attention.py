"""Demo section: flash attention, each implementation vs the reference."""

import jax
import jax.numpy as jnp

from shardfuse.demos import time_call
from shardfuse.testing import max_abs_error


def rows(seq_len: int = 512):
    """Flash attention (every implementation usable here) vs the reference."""
    from shardfuse.kernels.attention import api

    B, H, K, D = 1, 8, 2, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, seq_len, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, seq_len, K, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, seq_len, K, D), jnp.float32)
    cases = {
        "causal, GQA 8:2": dict(causal=True),
        "causal, window (128, 0), softcap 30": dict(
            causal=True, window=(128, 0), logit_softcap=30.0
        ),
    }
    result = []
    for case, kwargs in cases.items():
        ref = jax.jit(lambda q, k, v, kw=kwargs: api.attention_reference(q, k, v, **kw))
        expected = ref(q, k, v)
        for impl in ("reference", "xla"):
            fn = jax.jit(
                lambda q, k, v, kw=kwargs, i=impl: api.flash_attention(
                    q, k, v, implementation=i, **kw
                )
            )
            out = fn(q, k, v)
            result.append(
                dict(
                    op="flash_attention",
                    implementation=impl,
                    case=case,
                    shape=f"q {tuple(q.shape)} kv {tuple(k.shape)}",
                    error=max_abs_error(out, expected),
                    seconds=time_call(fn, q, k, v),
                )
            )
    return result
