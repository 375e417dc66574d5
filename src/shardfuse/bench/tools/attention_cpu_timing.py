"""CPU time of attention: xla vs reference vs jax.nn.dot_product_attention.

Usage:
    python -m shardfuse.bench.tools.attention_cpu_timing [--seq-len 4096] [--repeats 3] \
        [--block 256 ...]

Forward and forward+backward, B=1, H=8, D=64, causal, float32; median of
`--repeats` calls after a compile call. Timings on shared machines are noisy:
read the ratios of one run, not absolute times across runs.
"""

import argparse

import jax
import jax.numpy as jnp

import shardfuse as sf
from shardfuse.demos import time_call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block", type=int, nargs="*", default=[], help="extra xla block sizes")
    args = parser.parse_args()
    S = args.seq_len
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (1, S, 8, 64), jnp.float32) for key in keys)

    candidates = {
        "xla": lambda q, k, v: sf.flash_attention(q, k, v, causal=True, implementation="xla"),
        "reference": lambda q, k, v: sf.attention_reference(q, k, v, causal=True),
        "jax.nn (xla)": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"
        ),
    }
    for block in args.block:
        candidates[f"xla block {block}"] = lambda q, k, v, b=block: sf.flash_attention(
            q, k, v, causal=True, implementation="xla", block_sizes=sf.BlockSizes(b, b)
        )
    print(f"B=1 S=T={S} H=8 D=64 causal float32 on {jax.devices()[0].device_kind}")
    print(f"{'implementation':>16} {'fwd ms':>10} {'fwd+bwd ms':>12}")
    for name, fn in candidates.items():
        fwd = jax.jit(fn)
        fwd_bwd = jax.jit(jax.grad(lambda q, k, v, f=fn: jnp.sum(f(q, k, v) * q), (0, 1, 2)))
        t_fwd = time_call(fwd, q, k, v, repeats=args.repeats)
        t_bwd = time_call(fwd_bwd, q, k, v, repeats=args.repeats)
        print(f"{name:>16} {t_fwd * 1e3:10.1f} {t_bwd * 1e3:12.1f}", flush=True)


if __name__ == "__main__":
    main()
