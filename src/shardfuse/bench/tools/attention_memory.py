"""Compiled temp memory of attention forward+backward as S grows (xla path vs reference).

Usage: python -m shardfuse.bench.tools.attention_memory [--seq-lens 4096 8192 16384] [--json]

Sets XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= itself (before JAX
starts), since XLA:CPU's YNNPACK fusion otherwise hides temporaries.
"""

import argparse
import json
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_cpu_experimental_ynn_fusion_type="
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardfuse as sf  # noqa: E402
from shardfuse.testing import compiled_memory  # noqa: E402


def fwd_bwd_temp_bytes(implementation: str, seq_len: int, B=1, H=8, D=64) -> int:
    shape = jax.ShapeDtypeStruct((B, seq_len, H, D), jnp.float32)

    def loss(q, k, v):
        out = sf.flash_attention(q, k, v, causal=True, implementation=implementation)
        return jnp.sum(out * q)

    return compiled_memory(jax.grad(loss, (0, 1, 2)), shape, shape, shape)["temp"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--implementations", nargs="+", default=["xla", "reference"])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    results = {
        impl: {s: fwd_bwd_temp_bytes(impl, s) for s in args.seq_lens}
        for impl in args.implementations
    }
    if args.json:
        print(json.dumps(results))
        return
    print("B=1 H=8 D=64 causal float32, forward+backward temp bytes (MiB)")
    for impl, by_len in results.items():
        cells = "  ".join(f"S={s}: {b / 2**20:9.1f}" for s, b in by_len.items())
        first, last = by_len[args.seq_lens[0]], by_len[args.seq_lens[-1]]
        print(f"{impl:>10}  {cells}  ratio last/first {last / max(first, 1):.2f}")


if __name__ == "__main__":
    main()
