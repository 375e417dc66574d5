"""The grouped (MoE) matmul side by side with its peers and a dense matmul of the same FLOPs.

One run times, interleaved (every contender once per round, at least `--rounds` rounds
and the fast ones until they have run `--seconds`; the minimum over rounds kept, so that
load on a shared machine hits them all alike), the wall time and the
process CPU time (all threads) of `shardfuse.bench.moe`'s contenders: `shardfuse`
(`sf.grouped_matmul` as a user calls it: the platform's default), `jax.lax.ragged_dot`,
`tokamax.ragged_dot` (`pip install -e ".[peers]"`; skipped with a note without it),
`one_hot_dense`, and `dense_matmul`, one `[M, K] @ [K, N]` of the same FLOPs (the
roofline: `% dense` is its time over ours, the fraction of its rate we reach). Cases:
{mixtral-8x7b, olmoe-1b-7b} (widths / `--divisor`) x {balanced, skewed} x {float32,
bfloat16} x {fwd, fwd+bwd}. Each contender's compiled temp memory (`memory_analysis`)
is printed beside its time; forward outputs are checked against `jax.lax.ragged_dot`.

    python -m shardfuse.bench.tools.grouped_matmul_peers              # the whole matrix
    python -m shardfuse.bench.tools.grouped_matmul_peers --tokens 512 --rounds 3 \\
        --json bench/results/grouped_matmul_peers.json
"""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from shardfuse.bench import moe
from shardfuse.bench.harness import with_backward
from shardfuse.bench.tools.peers import save_run, seconds
from shardfuse.flops import FWD, FWD_BWD, MODES, grouped_matmul_flops

OURS = "shardfuse"
CONTENDERS = (OURS, *moe.PEERS, moe.DENSE)


def contenders(names=CONTENDERS):
    """`{name: fn}` for the contenders that import here, and `{name: why not}` for the rest."""
    table, missing = {}, {}
    for name in names:
        try:
            table[name] = moe.contender(name)
        except ImportError as e:
            missing[name] = f"not installed ({e}); pip install -e '.[peers]'"
    return table, missing


def compile_case(fn, name, mode, lhs, rhs, sizes, cotangent):
    """`(compiled, args, temp_bytes)` of one contender in one mode."""
    args = (lhs, rhs[0]) if name == moe.DENSE else (lhs, rhs, sizes)
    if mode == FWD_BWD:
        fn, args = with_backward(fn), (*args, cotangent)
    compiled = jax.jit(fn).lower(*args).compile()
    memory = compiled.memory_analysis()
    return compiled, args, getattr(memory, "temp_size_in_bytes", None)


def run_case(table, shape, tokens, routing, dtype, mode, rounds, budget=1.0):
    lhs, rhs, sizes, cotangent = moe.inputs(shape, tokens, routing, jnp.dtype(dtype))
    fns, errors, temp = {}, {}, {}
    for name, fn in table.items():
        try:
            compiled, args, temp[name] = compile_case(fn, name, mode, lhs, rhs, sizes, cotangent)
            jax.block_until_ready(compiled(*args))  # warm up
            fns[name] = (compiled, args)
        except Exception as e:  # a peer that cannot run this case: reported, not fatal
            errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
    best = {name: float("inf") for name in fns}
    best_cpu, spent, done = dict(best), dict.fromkeys(fns, 0.0), dict.fromkeys(fns, 0)
    # Interleaved: each contender once per round, `rounds` at least, and the quick ones
    # (the G x FLOPs peers take seconds) again until they have run `budget` seconds: the
    # minimum of a 10 ms kernel over 3 rounds is a draw on a loaded machine.
    while active := [n for n in fns if done[n] < rounds or (spent[n] < budget and done[n] < 50)]:
        for name in active:
            fn, args = fns[name]
            wall, cpu = seconds(fn, args)
            best[name], best_cpu[name] = min(best[name], wall), min(best_cpu[name], cpu)
            spent[name] += wall
            done[name] += 1
    check = None
    if mode == FWD and OURS in fns and "jax.lax.ragged_dot" in fns:
        ours, theirs = (
            np.asarray(fns[n][0](*fns[n][1]), np.float32) for n in (OURS, "jax.lax.ragged_dot")
        )
        check = float(np.max(np.abs(ours - theirs)))
    M, K = lhs.shape
    return dict(
        shape=shape.name, routing=routing, dtype=dtype, mode=mode,
        M=M, K=K, N=shape.expert_hidden, G=shape.experts, top_k=shape.top_k,
        largest_group=int(sizes.max()),
        flops=grouped_matmul_flops(M, K, shape.expert_hidden, mode=mode),
        seconds=best, cpu_seconds=best_cpu, rounds=done, temp_bytes=temp, errors=errors,
        max_abs_diff_vs_ragged_dot=check,
    )  # fmt: skip


def _row(r, names):
    t, cpu = r["seconds"], r["cpu_seconds"]
    label = f"{r['shape']} {r['routing']} {r['dtype']} {r['mode']}"
    row = f"{label:38s}" + "".join(
        f"{t[n] * 1e3:17.1f}ms" if n in t else f"{'-':>19s}" for n in names
    )
    ours = t.get(OURS)
    peers = [t[p] / ours for p in moe.PEERS if p in t] if ours else []
    rate = r["flops"] / ours / 1e9 if ours else float("nan")
    dense = t[moe.DENSE] / ours if ours and moe.DENSE in t else float("nan")
    row += f"{rate:9.1f}{dense:8.0%}" + (f"{min(peers):10.2f}x" if peers else f"{'-':>11s}")
    lines = [row]
    cpu_dense = cpu[moe.DENSE] / cpu[OURS] if OURS in cpu and moe.DENSE in cpu else float("nan")
    cpu_peers = [cpu[p] / cpu[OURS] for p in moe.PEERS if p in cpu and OURS in cpu]
    line = ", ".join(f"{n} {cpu[n] * 1e3:.0f} ms" for n in cpu)
    line += f"; {cpu_dense:.0%} of dense per cpu-s"
    if cpu_peers:
        line += f"; min speedup {min(cpu_peers):.2f}x"
    lines.append(f"    cpu time: {line}")
    memory = ", ".join(f"{n} {b / 2**20:.1f}" for n, b in r["temp_bytes"].items() if b is not None)
    lines.append(f"    compiled temp MiB: {memory}")
    for name, error in r["errors"].items():
        lines.append(f"    {name} failed: {error}")
    if r["max_abs_diff_vs_ragged_dot"] is not None:
        lines.append(f"    max |shardfuse - ragged_dot| = {r['max_abs_diff_vs_ragged_dot']:.2e}")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=list(moe.MOE_SHAPES), choices=moe.MOE_SHAPES)
    parser.add_argument("--routing", nargs="+", default=list(moe.ROUTINGS), choices=moe.ROUTINGS)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--mode", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tokens", type=int, default=moe.TOKENS["cpu"], help="tokens routed")
    parser.add_argument("--divisor", type=int, default=8, help="widths divided by it")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, at least")
    parser.add_argument(
        "--seconds",
        type=float,
        default=1.0,
        help="time each contender this long (50 rounds at most)",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    table, missing = contenders()
    from shardfuse.kernels.grouped_matmul.api import GROUPED_MATMUL

    default = GROUPED_MATMUL.candidates(None)
    runs = [name for name in default if GROUPED_MATMUL.backends[name].available()[0]][:1]
    load_before = os.getloadavg()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()[0]}")
    print(f"the shardfuse column runs {runs or default}; load average {load_before}")
    for name, why in missing.items():
        print(f"skipped {name}: {why}")
    names = list(table)
    print(f"{'case':38s}" + "".join(f"{n:>19s}" for n in names) + "  GFLOP/s  % dense  min peer")
    results = []
    for shape_name in args.shape:
        shape = moe.MOE_SHAPES[shape_name].scaled(args.divisor)
        for routing in args.routing:
            for dtype in args.dtype:
                for mode in args.mode:
                    r = run_case(
                        table, shape, args.tokens, routing, dtype, mode, args.rounds, args.seconds
                    )
                    results.append(r)
                    print("\n".join(_row(r, names)), flush=True)
    load_after = os.getloadavg()
    print(f"load average at the end: {load_after}")
    if args.json:
        save_run(
            args.json,
            "shardfuse.bench.tools.grouped_matmul_peers",
            argv,
            backend=jax.default_backend(),
            default_implementation=runs[0] if runs else None,
            load_average=dict(start=load_before, end=load_after),
            missing=missing,
            cases=results,
        )


if __name__ == "__main__":
    main()
