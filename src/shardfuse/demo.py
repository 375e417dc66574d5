"""`shardfuse demo`: runs each op that exists against its reference and prints a table.

Every row is one implementation on one case: the largest absolute error
against the reference and the median time of a few calls after compilation.
"""

import time

import jax
import jax.numpy as jnp

from shardfuse.testing import max_abs_error


def time_call(fn, *args, repeats: int = 3) -> float:
    """Median seconds of `fn(*args)` after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def attention_rows(seq_len: int = 512):
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
    rows = []
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
            rows.append(
                dict(
                    op="flash_attention",
                    implementation=impl,
                    case=case,
                    shape=f"q {tuple(q.shape)} kv {tuple(k.shape)}",
                    error=max_abs_error(out, expected),
                    seconds=time_call(fn, q, k, v),
                )
            )
    return rows


def run(seq_len: int = 512):
    """Runs the demo and prints its table. Returns the rows.

    Example:
      >>> from shardfuse import demo
      >>> rows = demo.run(seq_len=64)  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"jax {jax.__version__} on {jax.default_backend()} with {jax.device_count()} devices"
    )
    rows = []
    with console.status("flash attention: xla vs reference ..."):
        rows += attention_rows(seq_len)
    table = Table(title="shardfuse demo: each implementation vs the reference")
    for column in ("op", "implementation", "case", "shape", "max |err|", "time"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["op"],
            row["implementation"],
            row["case"],
            row["shape"],
            f"{row['error']:.2e}",
            f"{row['seconds'] * 1e3:.1f} ms",
        )
    console.print(table)
    return rows
