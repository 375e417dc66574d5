"""`shardfuse demo`: runs each op that exists against its reference and prints a table.

Every row is one implementation on one case: the largest absolute error
against the reference and the median time of a few calls after compilation.
"""

import importlib
import sys
import time

import jax


def time_call(fn, *args, repeats: int = 3) -> float:
    """Median seconds of `fn(*args)` after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# Sections, in order: (title shown while it runs, module with `rows() -> list[dict]`).
# Each row: op, implementation, case, shape, error (max |err| vs reference, or None
# where there is no reference, e.g. a training run), seconds (median after
# compilation), and optionally compile_seconds (the first call, compilation included).
SECTIONS = [
    ("flash attention: xla vs reference", "shardfuse.demos.attention"),
    (
        "flash attention: pallas_tpu (TPU interpret mode on CPU)",
        "shardfuse.demos.attention_pallas_tpu",
    ),
    ("flash attention: triton (Triton interpreter on CPU)", "shardfuse.demos.attention_triton"),
    ("matmul and collective matmuls: xla vs reference", "shardfuse.demos.collective_matmul"),
    ("ring attention: 8-device ring vs one-device reference", "shardfuse.demos.ring_attention"),
    (
        "Llama-style LM: examples/train_lm.py, a small run on a 2x2x2 mesh",
        "shardfuse.demos.train_lm",
    ),
]


def run(seq_len: int = 512):
    """Runs the demo and prints its table. Returns the rows.

    Example:
      >>> from shardfuse import demos
      >>> rows = demos.run(seq_len=64)  # doctest: +SKIP
    """
    from rich.console import Console
    from rich.table import Table

    # Piped output (CI logs, files) gets a wide table instead of 80 wrapped columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(
        f"jax {jax.__version__} on {jax.default_backend()} with {jax.device_count()} devices"
    )
    rows = []
    for title, module_name in SECTIONS:
        with console.status(f"{title} ..."):
            rows += importlib.import_module(module_name).rows(seq_len=seq_len)
    table = Table(title="shardfuse demo: each implementation vs the reference")
    for column in ("op", "implementation", "case", "shape", "max |err|", "time", "compile"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["op"],
            row["implementation"],
            row["case"],
            row["shape"],
            "-" if row["error"] is None else f"{row['error']:.2e}",
            f"{row['seconds'] * 1e3:.1f} ms",
            "-" if row.get("compile_seconds") is None else f"{row['compile_seconds']:.1f} s",
        )
    console.print(table)
    return rows
