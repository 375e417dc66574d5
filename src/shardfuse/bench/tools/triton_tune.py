"""Times candidate launch configs of the Triton attention kernels on this GPU.

`triton_configs.TUNED` was chosen by compiling, without a GPU (no spills,
shared memory within the limit). This tool times each kernel's candidates on
the GPU at hand, one kernel at a time with the others at their tuned configs,
and checks every candidate's output and gradients against the tuned config's
(the same bfloat16 attention summed in another order: a difference above 1e-2
of the largest magnitude marks the candidate `WRONG`). Each line is printed as
it is measured:

    python -m shardfuse.bench.tools.triton_tune --head-dims 64 128 --out tune.md

Kernels: `forward` (time of the forward), `dkdv` and `dq` (time of forward +
backward). Shapes: the FlashAttention-2 paper's, 16k tokens per batch
(B = 16384 / S), hidden 2048 (H = 2048 / D), S = T = `--seq-len`.
"""

import argparse
import dataclasses
import datetime
import sys

import jax
import jax.numpy as jnp
import numpy as np

import shardfuse as sf
from shardfuse.demos import time_call
from shardfuse.kernels.attention import triton_configs
from shardfuse.kernels.triton import launch
from shardfuse.kernels.triton.compile_stats import generation

TOKENS = 16384
HIDDEN = 2048

# (block_m, block_n, num_warps, num_stages); block_m: query rows, block_n: key rows.
CANDIDATES = {
    "forward": [
        (128, 64, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (64, 64, 4, 3),
        (128, 32, 8, 3),
        (64, 128, 4, 3),
    ],
    "dkdv": [
        (32, 64, 8, 2),
        (32, 128, 8, 3),
        (32, 128, 4, 3),
        (64, 64, 4, 2),
        (64, 128, 8, 2),
        (64, 128, 8, 3),
        (16, 128, 4, 3),
        (32, 64, 4, 3),
        (64, 64, 8, 3),
    ],
    "dq": [
        (128, 32, 8, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (64, 32, 4, 3),
        (128, 32, 4, 3),
        (64, 128, 8, 2),
        (128, 128, 8, 2),
    ],
}


def _run(q, k, v, d_out, causal, repeats):
    def attend(q, k, v):
        return sf.flash_attention(q, k, v, causal=causal, implementation="triton")

    forward = jax.jit(attend)

    @jax.jit
    def forward_backward(q, k, v, d_out):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(d_out))

    results = [np.asarray(x, np.float32) for x in forward_backward(q, k, v, d_out)]
    return (
        time_call(forward, q, k, v, repeats=repeats),
        time_call(forward_backward, q, k, v, d_out, repeats=repeats),
        results,
    )


def tune(head_dim, seq_len, causal, dtype, repeats, kernels, emit):
    """Times each kernel's candidates (others tuned); emits one markdown row per candidate."""
    capability = launch.gpu_compute_capability()
    kind = "float32" if jnp.dtype(dtype) == jnp.float32 else "16bit"
    triton_configs_key = (generation(capability), triton_configs.padded_head_dim(head_dim), kind)
    tuned = triton_configs.TUNED[triton_configs_key]
    batch, heads = max(1, TOKENS // seq_len), HIDDEN // head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, d_out = (jax.random.normal(key, shape, dtype) for key in keys)
    base_fwd, base_both, base_results = _run(q, k, v, d_out, causal, repeats)
    for kernel in kernels:
        for candidate in CANDIDATES[kernel]:
            config = triton_configs.AttentionKernelConfig(*candidate)
            trial = dataclasses.replace(tuned, **{kernel: config})
            triton_configs.TUNED[triton_configs_key] = trial
            try:
                fwd, both, results = _run(q, k, v, d_out, causal, repeats)
                worst = max(
                    float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))
                    for a, b in zip(results, base_results, strict=True)
                )
                timed = fwd if kernel == "forward" else both
                baseline = base_fwd if kernel == "forward" else base_both
                verdict = "WRONG" if worst > 1e-2 else f"{baseline / timed:.2f}x"
                row = f"{timed * 1e3:.3f} | {verdict} | {worst:.1e}"
            except Exception as e:  # a candidate the GPU refuses is a result too
                row = f"| {type(e).__name__}: {str(e).splitlines()[0][:70] if str(e) else ''} |"
            finally:
                triton_configs.TUNED[triton_configs_key] = tuned
            mark = " (tuned)" if config == tuned.get(kernel) else ""
            emit(f"| {head_dim} | {seq_len} | {causal} | {kernel} | {candidate}{mark} | {row} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--causal", nargs="+", default=["false", "true"], choices=["false", "true"])
    parser.add_argument(
        "--kernels", nargs="+", default=["dkdv", "dq", "forward"], choices=list(CANDIDATES)
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    if jax.default_backend() not in ("gpu", "cuda"):
        print(f"triton_tune needs an NVIDIA GPU; the JAX backend is {jax.default_backend()!r}")
        return 2
    lines = [
        f"# Triton attention launch configs on {jax.devices()[0].device_kind}",
        "",
        f"`python -m shardfuse.bench.tools.triton_tune` on {datetime.date.today().isoformat()}, "
        f"jax {jax.__version__}, {args.dtype}, {TOKENS} tokens per batch, hidden {HIDDEN}. "
        "ms: forward for `forward`, forward + backward for `dkdv` and `dq`; speedup over "
        "the tuned table's config; max relative difference from the tuned config's results.",
        "",
        "| head dim | S | causal | kernel | (block_m, block_n, warps, stages) | ms | speedup "
        "| max rel diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        print(line, flush=True)

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    for head_dim in args.head_dims:
        for causal in args.causal:
            tune(
                head_dim,
                args.seq_len,
                causal.lower() == "true",
                jnp.dtype(args.dtype),
                args.repeats,
                args.kernels,
                emit,
            )
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
