"""CPU attention side by side with its peers, and against the machine's matmul roofline.

One run times, interleaved (every contender once per round, the minimum over
rounds kept, so that load on a shared machine hits them all alike), both the
wall time and the process CPU time (all threads: the work done, which other
processes' load does not inflate, but which also counts threads that spin):

- `shardfuse`: `sf.flash_attention` as a user calls it (`implementation=None`, CPU's
  default: the C++ kernels where the extension is built, else `xla`);
- `shardfuse.xla`: the portable blockwise JAX backend;
- `tokamax.xla`, `tokamax.xla_chunked`: `tokamax.dot_product_attention`
  (`pip install -e ".[peers]"`; skipped with a note without it);
- `jax.nn`: `jax.nn.dot_product_attention(implementation="xla")`;

on {causal, full} x {MHA 8:8 D64, GQA 8:2 D128} x {S 2048, 4096} x {fwd,
fwd+bwd}, float32, B=1, H=8, T=S. The roofline is the float32 rate of one
large matmul (`jnp.dot`, 4096^3 by default); every shardfuse case is also
given as a fraction of it. FLOPs: `shardfuse.flops.attention_flops` (masks
counted exactly, backward 2.5 x forward). Forward outputs are checked against
`jax.nn` (max abs difference printed).

    python -m shardfuse.bench.tools.peers         # the whole matrix, 3 rounds
    python -m shardfuse.bench.tools.peers --seq 2048 --rounds 2 --json bench/results/peers.json
"""

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import shardfuse as sf
from shardfuse.flops import attention_flops

SHAPES = {"MHA 8:8 D64": (8, 8, 64), "GQA 8:2 D128": (8, 2, 128)}
MASKS = {"causal": True, "full": False}
MODES = ("fwd", "fwd+bwd")


def contenders():
    """`{name: attention(q, k, v, causal) -> out}`, and `{name: why not}` for those absent."""
    table = {
        "shardfuse": lambda q, k, v, causal: sf.flash_attention(q, k, v, causal=causal),
        "shardfuse.xla": lambda q, k, v, causal: sf.flash_attention(
            q, k, v, causal=causal, implementation="xla"
        ),
        "jax.nn": lambda q, k, v, causal: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"
        ),
    }
    missing = {}
    try:
        tokamax = import_tokamax()
        for impl in ("xla", "xla_chunked"):
            table[f"tokamax.{impl}"] = lambda q, k, v, causal, impl=impl: (
                tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
            )
    except ImportError as e:
        missing["tokamax"] = f"not installed ({e}); pip install -e '.[peers]'"
    return table, missing


def import_tokamax():
    """The `tokamax` module, its absl flags marked parsed (it reads them, and would otherwise
    parse the calling script's own argv). ImportError when it is not installed
    (`pip install -e ".[peers]"`)."""
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def save_run(path, tool: str, argv, **fields) -> None:
    """Writes a tool's run to `path` as JSON: the date, machine, the command that made it
    (`python -m TOOL ARGS`, `argv` None for this process's own), the jax version, `fields`."""
    record = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=platform.processor() or platform.machine(),
        command=f"python -m {tool} " + " ".join(sys.argv[1:] if argv is None else argv),
        jax=jax.__version__,
        **fields,
    )
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"results written to {path}")


def compiled(attention, mode, causal, q, k, v, d_out):
    """The jitted, compiled function of one contender in one mode."""
    if mode == "fwd":
        fn = jax.jit(lambda q, k, v: attention(q, k, v, causal))
        return fn.lower(q, k, v).compile(), (q, k, v)

    def loss(q, k, v, d_out):
        return jnp.sum(attention(q, k, v, causal) * d_out)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fn.lower(q, k, v, d_out).compile(), (q, k, v, d_out)


def seconds(fn, args):
    """`(wall, cpu)` seconds of one call: cpu is this process's CPU time over all threads,
    the work done, which load from other processes on a shared machine does not inflate."""
    start, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, time.process_time() - cpu


def matmul_roofline(n, rounds):
    """Attained float32 rate of one `[n, n] @ [n, n]` (the best of `rounds`): `(FLOP per
    wall second, FLOP per CPU second)`; the second, the work rate, is what load from other
    processes on a shared machine does not lower."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    fn = jax.jit(lambda a, b: jnp.dot(a, b, precision="highest")).lower(a, b).compile()
    jax.block_until_ready(fn(a, b))
    times = [seconds(fn, (a, b)) for _ in range(rounds)]
    return 2.0 * n**3 / min(t[0] for t in times), 2.0 * n**3 / min(t[1] for t in times)


def run_case(table, shape, mask, S, mode, rounds):
    H, K, D = SHAPES[shape]
    causal = MASKS[mask]
    keys = jax.random.split(jax.random.key(S + D), 4)
    q = jax.random.normal(keys[0], (1, S, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (1, S, K, D), jnp.float32)
    v = jax.random.normal(keys[2], (1, S, K, D), jnp.float32)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    fns, errors = {}, {}
    for name, attention in table.items():
        try:
            fns[name] = compiled(attention, mode, causal, q, k, v, d_out)
            jax.block_until_ready(fns[name][0](*fns[name][1]))  # warm up
        except Exception as e:  # a peer that cannot run this case: reported, not fatal
            errors[name] = f"{type(e).__name__}: {str(e)[:120]}"
            fns.pop(name, None)
    best = {name: float("inf") for name in fns}
    best_cpu = dict(best)
    for _ in range(rounds):  # interleaved: each contender once per round
        for name, (fn, args) in fns.items():
            wall, cpu = seconds(fn, args)
            best[name], best_cpu[name] = min(best[name], wall), min(best_cpu[name], cpu)
    check = None
    if mode == "fwd" and "shardfuse" in fns and "jax.nn" in fns:
        ours, theirs = (np.asarray(fns[n][0](*fns[n][1])) for n in ("shardfuse", "jax.nn"))
        check = float(np.max(np.abs(ours - theirs)))
    flops = attention_flops(1, S, S, H, D, causal=causal, mode=mode)
    return dict(shape=shape, mask=mask, S=S, mode=mode, flops=flops, seconds=best,
                cpu_seconds=best_cpu, errors=errors, max_abs_diff_vs_jax_nn=check)  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--shape", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--mask", nargs="+", default=list(MASKS), choices=list(MASKS))
    parser.add_argument("--mode", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--matmul", type=int, default=4096, help="roofline matmul size")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    table, missing = contenders()
    from shardfuse.kernels.attention import native_cpu

    info = native_cpu.build_info()
    # what the "shardfuse" column runs: ("native_cpu", "xla") takes the first that is built
    ours = "native_cpu" if native_cpu.status(jax.default_backend())[0] else "xla"
    load_before = os.getloadavg()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, native: {info or 'absent'}")
    print(f"the shardfuse column runs {ours}; load average {load_before}")
    for name, why in missing.items():
        print(f"skipped {name}: {why}")
    roof, roof_cpu = matmul_roofline(args.matmul, args.rounds)
    print(
        f"roofline: float32 matmul {args.matmul}^3: {roof / 1e9:.1f} GFLOP/s wall, "
        f"{roof_cpu / 1e9:.1f} GFLOP per CPU second"
    )
    names = list(table)
    peers = [n for n in names if not n.startswith("shardfuse")]
    header = f"{'case':38s}" + "".join(f"{n:>20s}" for n in names)
    print(header + f"{'GFLOP/s':>9s}{'roof':>6s}{'min speedup':>12s}")
    results = []
    for mask in args.mask:
        for shape in args.shape:
            for S in args.seq:
                for mode in args.mode:
                    r = run_case(table, shape, mask, S, mode, args.rounds)
                    results.append(r)
                    t = r["seconds"]
                    ours = t.get("shardfuse", float("nan"))
                    rate = r["flops"] / ours
                    speedups = [t[p] / ours for p in peers if p in t]
                    cpu = r["cpu_seconds"]
                    cpu_speedups = [cpu[p] / cpu["shardfuse"] for p in peers if p in cpu]
                    row = f"{mask + ' ' + shape + f' S={S} ' + mode:38s}"
                    row += "".join(f"{t[n] * 1e3:18.1f}ms" if n in t else f"{'-':>20s}"
                                   for n in names)  # fmt: skip
                    row += f"{rate / 1e9:9.1f}{rate / roof:6.0%}"
                    row += f"{min(speedups):11.2f}x" if speedups else f"{'-':>12s}"
                    print(row, flush=True)
                    line = ", ".join(f"{n} {cpu[n] * 1e3:.0f} ms" for n in cpu)
                    if cpu_speedups:
                        line += f"; min speedup {min(cpu_speedups):.2f}x"
                    rate_cpu = r["flops"] / cpu["shardfuse"] if "shardfuse" in cpu else float("nan")
                    line += (
                        f"; shardfuse {rate_cpu / 1e9:.1f} GFLOP/cpu-s, {rate_cpu / roof_cpu:.0%}"
                    )
                    print(f"    cpu time: {line} of the matmul's rate per cpu-s")
                    for name, error in r["errors"].items():
                        print(f"    {name} failed: {error}")
                    if r["max_abs_diff_vs_jax_nn"] is not None:
                        print(f"    max |shardfuse - jax.nn| = {r['max_abs_diff_vs_jax_nn']:.2e}")
    load_after = os.getloadavg()
    print(f"load average at the end: {load_after}")
    if args.json:
        save_run(
            args.json,
            "shardfuse.bench.tools.peers",
            argv,
            native=info,
            default_implementation=ours,  # the key of the committed results
            load_average=dict(start=load_before, end=load_after),
            roofline_flops_per_s=roof,
            roofline_flops_per_cpu_s=roof_cpu,
            missing=missing,
            cases=results,
        )


if __name__ == "__main__":
    main()
