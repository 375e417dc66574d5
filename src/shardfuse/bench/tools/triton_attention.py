"""Throughput of the Triton flash attention against `jax.nn.dot_product_attention` (cuDNN, XLA).

The FlashAttention-2 paper's setting: bfloat16, 16k tokens per batch
(B = 16384 / S), hidden size 2048 (H = 2048 / D), head dims 64 and 128,
S = T from 1k to 16k, causal and not. FLOPs: `shardfuse.flops.attention_flops`
(forward `4 B H D` per visible pair, about half of `T S` when causal), backward
2.5 x forward (two matmuls recomputed, three for the gradients), as in the
paper; the backward time is (forward + backward) -
forward. Each time is the median of `--repeats` calls after a warm-up call.

    python -m shardfuse.bench.tools.triton_attention --out bench/results/triton_attention_h100.md
    python -m shardfuse.bench.tools.triton_attention --impl xla --seq-lens 256 --head-dims 64
    # (the last: a CPU smoke run)

Implementations: `triton` (`sf.flash_attention(implementation="triton")`),
`cudnn` and `xla` (`jax.nn.dot_product_attention(implementation=...)`), and
`sf-xla` (shardfuse's portable path). A case an implementation cannot run
(out of memory, cuDNN refusing a shape) prints its error in the table.
The header names the device's dense peak from `shardfuse.hardware` (n/a where
the table has no entry, e.g. CPU) and the table gives each time as % of it.
"""

import argparse
import datetime
import sys

import jax
import jax.numpy as jnp

import shardfuse as sf
from shardfuse import flops
from shardfuse.demos import time_call
from shardfuse.hardware import current_device

TOKENS = 16384
HIDDEN = 2048


def attention_fn(impl, causal):
    if impl == "triton":
        return lambda q, k, v: sf.flash_attention(q, k, v, causal=causal, implementation="triton")
    if impl == "sf-xla":
        return lambda q, k, v: sf.flash_attention(q, k, v, causal=causal, implementation="xla")
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation=impl
    )


def run_case(impl, seq_len, head_dim, causal, dtype, repeats):
    batch, heads = max(1, TOKENS // seq_len), HIDDEN // head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, d_out = (jax.random.normal(key, shape, dtype) for key in keys)
    attend = attention_fn(impl, causal)
    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(d_out)

    forward_flops = flops.attention_flops(batch, seq_len, seq_len, heads, head_dim, causal=causal)
    fwd = time_call(forward, q, k, v, repeats=repeats)
    both = time_call(forward_backward, q, k, v, d_out, repeats=repeats)
    bwd = max(both - fwd, 1e-12)
    return dict(
        batch=batch,
        heads=heads,
        fwd_ms=fwd * 1e3,
        bwd_ms=bwd * 1e3,
        fwd_tflops=forward_flops / fwd / 1e12,
        bwd_tflops=flops.BACKWARD_OVER_FORWARD * forward_flops / bwd / 1e12,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["triton", "cudnn", "xla"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    chip = current_device()
    peak = chip.peak_tflops(args.dtype) if chip else None
    peak_text = f"{chip.name} {args.dtype} peak {peak} TFLOP/s" if peak else "peak n/a"

    def of_peak(tflops):
        return f" ({100 * tflops / peak:.0f}%)" if peak else ""

    lines = [
        f"# Flash attention throughput on {device.device_kind}",
        "",
        "`python -m shardfuse.bench.tools.triton_attention` on "
        f"{datetime.date.today().isoformat()}, "
        f"jax {jax.__version__}, {args.dtype}, {TOKENS} tokens per batch, hidden {HIDDEN}; "
        "TFLOP/s as in the FlashAttention-2 paper (backward = 2.5 x forward FLOPs), "
        f"in brackets % of the dense peak ({peak_text}, from shardfuse.hardware).",
        "",
        "| impl | head dim | S | causal | B x H | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        print(line, flush=True)
    for head_dim in args.head_dims:
        for seq_len in args.seq_lens:
            for causal in (False, True):
                for impl in args.impl:
                    try:
                        r = run_case(
                            impl, seq_len, head_dim, causal, jnp.dtype(args.dtype), args.repeats
                        )
                        line = (
                            f"| {impl} | {head_dim} | {seq_len} | {causal} | "
                            f"{r['batch']} x {r['heads']} | {r['fwd_ms']:.3f} | "
                            f"{r['fwd_tflops']:.1f}{of_peak(r['fwd_tflops'])} | "
                            f"{r['bwd_ms']:.3f} | {r['bwd_tflops']:.1f}{of_peak(r['bwd_tflops'])} |"
                        )
                    except Exception as e:  # a baseline refusing a case is a result too
                        message = str(e).splitlines()[0][:80] if str(e) else ""
                        line = (
                            f"| {impl} | {head_dim} | {seq_len} | {causal} | | "
                            f"{type(e).__name__}: {message} | | | |"
                        )
                    lines.append(line)
                    print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
