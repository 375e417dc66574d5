"""Flash attention on an NVIDIA GPU: shardfuse's default and backends against every peer.

One run on one machine, in the FlashAttention-2 paper's setting (bfloat16, 16k
tokens per batch: B = 16384 / S, hidden 2048: H = 2048 / D, T = S), head dims
64 and 128 (and 256), S = 1k, 4k, 16k, full and causal, plus rows with packed
segment ids and with a sliding window (causal + left window); forward and
forward + backward. Implementations:

- shardfuse: `default` (`implementation=None`: the dispatch table), and each GPU
  backend alone: `mosaic_gpu`, `triton`, `cudnn`;
- peers: `jax.nn` (`jax.nn.dot_product_attention(implementation="cudnn")`: what
  JAX ships), `attention_mgpu` (jax's Hopper example,
  `jax.experimental.pallas.ops.gpu.attention_mgpu`: float16 only, so it runs on
  float16 copies of the inputs; no masks but causal; its backward has no
  causal), `tokamax` (`tokamax.dot_product_attention(implementation="mosaic")`,
  where installed; segment ids as a dense boolean mask, its only way).

A peer that cannot run a case shows why. TFLOP/s count useful FLOPs (4 D per
visible (query, key) pair and head; backward 2.5 x forward), so masked rows
compare per useful FLOP; in brackets % of the dense peak. Each time is the
median of `--repeats` timed batches of back-to-back calls (each batch at least
~20 ms), after a warm-up call; the backward time is (forward + backward) -
forward.

With `--dispatch-out PATH`, the shardfuse backends are timed first, their
order per case written as the dispatch table (`kernels/attention/gpu_dispatch`),
which then takes effect for the `default` rows measured after it: the default
is timed as a user gets it from that table.

    python -m shardfuse.bench.tools.gpu_attention --out-md OUT/gpu_attention.md \\
        --out-json OUT/gpu_attention.json \\
        --dispatch-out src/shardfuse/kernels/attention/gpu_dispatch.json
    python -m shardfuse.bench.tools.gpu_attention --seq-lens 256 --head-dims 64 \\
        --impl default --masks full  # a CPU smoke run
"""

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import shardfuse as sf
from shardfuse import flops
from shardfuse.hardware import compute_capability, current_device

TOKENS = 16384
HIDDEN = 2048
SF_BACKENDS = ("mosaic_gpu", "triton", "cudnn")
PEERS = ("jax.nn", "attention_mgpu", "tokamax")
MASKS = ("full", "causal", "segments", "window")
WINDOW_LEFT = 1024
SEGMENT_FRACTIONS = (0.05, 0.2, 0.1, 0.3, 0.15, 0.2)  # packed documents of uneven lengths


@dataclasses.dataclass(frozen=True)
class Case:
    head_dim: int
    seq_len: int
    mask: str
    dtype: str = "bfloat16"

    @property
    def batch(self):
        return max(1, TOKENS // self.seq_len)

    @property
    def heads(self):
        return HIDDEN // self.head_dim

    @property
    def causal(self):
        return self.mask != "full"

    def segment_ids(self):
        """int32 `[B, S]`: documents of `SEGMENT_FRACTIONS` of the sequence, in order."""
        bounds = np.cumsum([0, *SEGMENT_FRACTIONS])[:-1] * self.seq_len
        ids = np.searchsorted(bounds, np.arange(self.seq_len), side="right").astype(np.int32)
        return np.broadcast_to(ids, (self.batch, self.seq_len))

    def visible_pairs(self) -> int:
        """Visible (query, key) pairs per batch element and head, counted exactly."""
        S = self.seq_len
        if self.mask == "full":
            return S * S
        if self.mask == "causal":
            return S * (S + 1) // 2
        if self.mask == "window":
            pos = np.arange(S)
            return int(
                flops.visible_key_counts(pos, pos, causal=True, window=(WINDOW_LEFT, 0)).sum()
            )
        lengths = np.bincount(self.segment_ids()[0])
        return int(sum(n * (n + 1) // 2 for n in lengths))

    def forward_flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.head_dim * self.visible_pairs()


def _inputs(case: Case):
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (case.batch, case.seq_len, case.heads, case.head_dim)
    dtype = jnp.dtype(case.dtype)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)


class Unsupported(Exception):
    """This implementation cannot run this case (the reason is the message)."""


def attention_fn(impl: str, case: Case):
    """`(q, k, v) -> out` for `impl` on `case`; Unsupported where it cannot run it."""
    window = (WINDOW_LEFT, 0) if case.mask == "window" else None
    segments = case.segment_ids() if case.mask == "segments" else None
    if impl == "default" or impl in SF_BACKENDS:
        options = dict(causal=case.causal, window=window)
        if segments is not None:
            options.update(
                q_segment_ids=jnp.asarray(segments), kv_segment_ids=jnp.asarray(segments)
            )
        name = None if impl == "default" else impl
        return lambda q, k, v: sf.flash_attention(q, k, v, implementation=name, **options)
    if impl == "jax.nn":
        if segments is not None:
            raise Unsupported("jax.nn's cuDNN path has no segment ids")
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=case.causal, local_window_size=window, implementation="cudnn"
        )
    if impl == "attention_mgpu":
        return _attention_mgpu(case)
    if impl == "tokamax":
        return _tokamax(case, window, segments)
    raise ValueError(f"unknown impl {impl!r}")


def _attention_mgpu(case: Case):
    if case.mask not in ("full", "causal"):
        raise Unsupported(f"jax's attention_mgpu has no {case.mask} masks")
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except ImportError as e:
        raise Unsupported(f"jax's attention_mgpu is not importable: {e}") from e
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128 if case.head_dim <= 128 else 64, max_concurrent_steps=2,
        causal=case.causal, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64,
    )  # fmt: skip

    def attend(q, k, v):  # its shared-memory buffers are float16: it runs float16 copies
        out = attention_mgpu.attention(
            q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16), config
        )
        return out.astype(q.dtype)

    return attend


def _tokamax(case: Case, window, segments):
    try:
        import tokamax
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        raise Unsupported(f"tokamax is not importable: {type(e).__name__}: {e}") from e
    mask = None
    if segments is not None:
        ids = jnp.asarray(segments)
        mask = ids[:, None, :, None] == ids[:, None, None, :]  # [B, 1, T, S]

    def attend(q, k, v):
        return tokamax.dot_product_attention(
            q, k, v, mask=mask, is_causal=case.causal, local_window_size=window,
            implementation="mosaic",
        )  # fmt: skip

    return attend


def time_seconds(fn, args, repeats: int) -> float:
    """Median seconds of `fn(*args)`: batches of back-to-back calls of >= ~20 ms each."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    calls = max(1, min(200, int(0.02 / max(once, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def run_case(impl: str, case: Case, repeats: int) -> dict:
    """`{"fwd_ms", "fwd_bwd_ms", ...}` of `impl` on `case`, or `{"error": text}`."""
    try:
        attend = attention_fn(impl, case)
        q, k, v, d_out = _inputs(case)
        forward = jax.jit(attend)

        @jax.jit
        def forward_backward(q, k, v, d_out):
            out, vjp = jax.vjp(attend, q, k, v)
            return vjp(d_out.astype(out.dtype))

        fwd = time_seconds(forward, (q, k, v), repeats)
        try:
            both = time_seconds(forward_backward, (q, k, v, d_out), repeats)
        except Exception as e:  # noqa: BLE001 - a forward-only peer
            return dict(fwd_ms=fwd * 1e3, bwd_error=_short(e))
        return dict(fwd_ms=fwd * 1e3, fwd_bwd_ms=both * 1e3)
    except Unsupported as e:
        return dict(error=str(e))
    except Exception as e:  # noqa: BLE001 - a failure is a result too
        return dict(error=_short(e), traceback=traceback.format_exc(limit=6))


def _short(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:120] if text else ''}"


def dispatch_table(cases, results, generation, source) -> dict:
    """The `gpu_dispatch.json` table from the shardfuse backends' fwd+bwd times."""
    rows, wins = [], {}
    for case in cases:
        timed = {
            name: results[(name, case)]["fwd_bwd_ms"]
            for name in SF_BACKENDS
            if "fwd_bwd_ms" in results.get((name, case), {})
        }
        if not timed:
            continue
        order = sorted(timed, key=timed.get)
        wins[order[0]] = wins.get(order[0], 0) + 1
        rows.append(
            dict(
                generation=generation,
                head_dim=case.head_dim,
                dtype=case.dtype,
                mask=case.mask,
                seq_len=case.seq_len,
                order=order,
                fwd_bwd_ms={n: round(t, 4) for n, t in timed.items()},
            )  # fmt: skip
        )
    general = sorted(wins, key=lambda name: -wins[name])
    general += [name for name in ("mosaic_gpu", "triton") if name not in general]
    fallback = [name for name in general if name != "cudnn"]  # cudnn refuses too much
    return {"source": source, "rows": rows, "fallback": {generation: [*fallback, "xla"]}}


def _write_dispatch(table, path):
    """Writes the dispatch table and makes it the one `implementation=None` reads from now."""
    import pathlib

    from shardfuse.kernels.attention import gpu_dispatch

    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    gpu_dispatch.TABLE_FILE = pathlib.Path(path)
    gpu_dispatch.load_table.cache_clear()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["default", *SF_BACKENDS, *PEERS])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    parser.add_argument(
        "--masked-seq-lens", nargs="+", type=int, default=[4096, 16384],
        help="lengths of the segments and window rows",
    )  # fmt: skip
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-md", help="also write the markdown table here")
    parser.add_argument("--out-json", help="every number, as JSON")
    parser.add_argument("--dispatch-out", help="write the dispatch table (gpu_dispatch.json) here")
    parser.add_argument(
        "--time-budget", type=float, default=None,
        help="seconds: start no new case after this; what was measured is written",
    )  # fmt: skip
    args = parser.parse_args(argv)

    cases = [
        Case(d, s, mask, args.dtype)
        for d in args.head_dims
        for mask in args.masks
        for s in (args.masked_seq_lens if mask in ("segments", "window") else args.seq_lens)
    ]
    # The headline cases first (a run cut short by its budget keeps them): long sequences,
    # full and causal, then the masked rows, then shorter sequences.
    rank = {"full": 0, "causal": 0, "segments": 1, "window": 1}
    cases.sort(key=lambda c: (-c.seq_len, rank[c.mask], -c.head_dim, c.mask))
    device = jax.devices()[0]
    chip = current_device()
    peak = chip.peak_tflops(args.dtype) if chip else None
    capability = compute_capability()
    generation = "sm90" if capability >= 90 else "sm80"
    stamp = datetime.date.today().isoformat()
    header = (
        f"# Flash attention on {device.device_kind}\n\n"
        f"`python -m shardfuse.bench.tools.gpu_attention` on {stamp}, jax {jax.__version__}, "
        f"{args.dtype}, {TOKENS} tokens per batch, hidden {HIDDEN}, T = S; TFLOP/s of useful "
        "FLOPs (FlashAttention-2 convention: 4 D per visible pair and head, backward 2.5 x "
        f"forward), in brackets % of the dense peak "
        f"({f'{chip.name} {peak} TFLOP/s' if peak else 'n/a'}).\n"
    )
    print(header, flush=True)

    results: dict = {}
    sf_impls = [i for i in args.impl if i in SF_BACKENDS]
    others = [i for i in args.impl if i not in SF_BACKENDS]  # default first, then the peers
    source = f"gpu_attention {stamp} on {device.device_kind}, jax {jax.__version__}"
    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    log = open(args.out_json + "l", "w") if args.out_json else None  # one line per result
    measured = []
    for case in cases:  # case-major: a cut-short run keeps every implementation of its cases
        if deadline is not None and time.monotonic() > deadline:
            print(f"time budget spent: {len(cases) - len(measured)} cases not run", flush=True)
            break
        for impl in sf_impls + others:
            if impl == "default" and args.dispatch_out:
                table = dispatch_table([*measured, case], results, generation, source)
                _write_dispatch(table, args.dispatch_out)
            r = run_case(impl, case, args.repeats)
            results[(impl, case)] = r
            print(_line(impl, case, r, peak), flush=True)
            if log:
                log.write(json.dumps(dict(impl=impl, **dataclasses.asdict(case), **r)) + "\n")
                log.flush()
        measured.append(case)
    cases = measured
    if args.dispatch_out:
        _write_dispatch(dispatch_table(cases, results, generation, source), args.dispatch_out)

    lines = [
        header,
        _table(cases, args.impl, results, peak),
        "",
        _ratios(cases, args.impl, results),
    ]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(text + "\n")
    if args.out_json:
        payload = [
            dict(impl=impl, **dataclasses.asdict(case), **r) for (impl, case), r in results.items()
        ]
        with open(args.out_json, "w") as f:
            json.dump(
                dict(device=device.device_kind, jax=jax.__version__, results=payload), f, indent=1
            )
    return 0


def _rates(case, r):
    fwd_flops = case.forward_flops()
    out = {}
    if "fwd_ms" in r:
        out["fwd"] = fwd_flops / (r["fwd_ms"] * 1e-3) / 1e12
    if "fwd_bwd_ms" in r:
        bwd_ms = max(r["fwd_bwd_ms"] - r["fwd_ms"], 1e-9)
        out["bwd"] = flops.BACKWARD_OVER_FORWARD * fwd_flops / (bwd_ms * 1e-3) / 1e12
        out["fwd+bwd"] = (
            (1 + flops.BACKWARD_OVER_FORWARD) * fwd_flops / (r["fwd_bwd_ms"] * 1e-3) / 1e12
        )
    return out


def _line(impl, case, r, peak):
    if "error" in r:
        return f"{impl:>14} {case} -- {r['error']}"
    rates = " ".join(f"{k} {v:.0f}" for k, v in _rates(case, r).items())
    times = f"{r['fwd_ms']:.3f} ms fwd, {r.get('fwd_bwd_ms', float('nan')):.3f} ms fwd+bwd"
    return f"{impl:>14} {case} {times}: {rates} TFLOP/s {r.get('bwd_error', '')}"


def _table(cases, impls, results, peak):
    pct = lambda x: f" ({100 * x / peak:.0f}%)" if peak else ""  # noqa: E731
    rows = [
        "| D | S | mask | impl | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for impl in impls:
            r = results.get((impl, case), {})
            head = f"| {case.head_dim} | {case.seq_len} | {case.mask} | {impl} |"
            if "error" in r:
                rows.append(f"{head} {r['error']} | | | | |")
                continue
            rates = _rates(case, r)
            fwd = f"{head} {r['fwd_ms']:.3f} | {rates['fwd']:.0f}{pct(rates['fwd'])} |"
            if "fwd_bwd_ms" not in r:
                rows.append(f"{fwd} {r.get('bwd_error', '')} | | |")
                continue
            bwd_ms = r["fwd_bwd_ms"] - r["fwd_ms"]
            bwd = f"{bwd_ms:.3f} | {rates['bwd']:.0f}{pct(rates['bwd'])} | {rates['fwd+bwd']:.0f} |"
            rows.append(f"{fwd} {bwd}")
    return "\n".join(rows)


def _ratios(cases, impls, results):
    """The default's speed over every peer's, per case (> 1: shardfuse faster)."""
    others = [i for i in impls if i != "default"]
    rows = [
        "Speed of `default` over each other implementation (its time / default's; fwd, fwd+bwd):",
        "",
        "| D | S | mask | " + " | ".join(others) + " |",
        "|---|---|---|" + "---|" * len(others),
    ]
    for case in cases:
        mine = results.get(("default", case), {})
        cells = []
        for other in others:
            theirs = results.get((other, case), {})
            parts = []
            for key in ("fwd_ms", "fwd_bwd_ms"):
                if key in mine and key in theirs:
                    parts.append(f"{theirs[key] / mine[key]:.2f}")
                else:
                    parts.append("-")
            cells.append(" / ".join(parts))
        rows.append(
            f"| {case.head_dim} | {case.seq_len} | {case.mask} | " + " | ".join(cells) + " |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
