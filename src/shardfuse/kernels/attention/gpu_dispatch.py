"""What `implementation=None` runs on an NVIDIA GPU: the fastest backend measured for the case.

The table `gpu_dispatch.json` (beside this module) is written by the GPU bench,
`python -m shardfuse.bench.tools.gpu_attention --dispatch-out ...`, and committed
with the bench's results. Each row is one measured case:

    {"generation": "sm90", "head_dim": 128, "dtype": "bfloat16", "mask": "causal",
     "seq_len": 16384, "order": ["mosaic_gpu", "cudnn", "triton"], "ms": {...}}

`order` is the backends by measured forward + backward time, fastest first.
A call picks the row of its GPU generation, head dim (the smallest measured one
at least its own), dtype and mask kind (`segments`, `window`, `causal`,
`full`: the most specific mask the call has) whose length is nearest its key
length (on a log scale), and tries the row's order, then the generation's
`fallback` (the backends that won most rows; a case no row covers goes there
directly), then `xla`. Each backend still refuses what it cannot run
(cudnn: lse, segment ids, softcap, positions), so the next one in the order
takes such calls.
"""

import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp

TABLE_FILE = pathlib.Path(__file__).with_name("gpu_dispatch.json")
# Before any measurement: Triton runs on sm_80 and newer, Mosaic GPU on sm_90 and newer.
DEFAULT_FALLBACK = {"sm80": ("triton", "xla"), "sm90": ("triton", "mosaic_gpu", "xla")}


def generation(capability: int) -> str:
    """ "sm80" (Ampere, 8.x) or "sm90" (Hopper and newer) for a compute capability like 90."""
    return "sm90" if capability >= 90 else "sm80"


def mask_kind(config, has_segments: bool) -> str:
    """The mask kind a dispatch row is keyed by: segments, window, causal or full."""
    if has_segments:
        return "segments"
    if config.window is not None:
        return "window"
    return "causal" if config.causal else "full"


@functools.cache
def load_table(path: str | None = None) -> dict:
    """The dispatch table: `{"rows": [...], "fallback": {generation: names}, "source": text}`."""
    path = pathlib.Path(path) if path else TABLE_FILE
    if not path.exists():
        return {"rows": [], "fallback": {}, "source": "no table (nothing measured)"}
    return json.loads(path.read_text())


def _row(table, gen, head_dim, dtype, mask, seq_len):
    rows = [
        r
        for r in table["rows"]
        if r["generation"] == gen and r["dtype"] == dtype and r["mask"] == mask
        and r["head_dim"] >= head_dim
    ]  # fmt: skip
    if not rows:
        return None
    smallest = min(r["head_dim"] for r in rows)
    rows = [r for r in rows if r["head_dim"] == smallest]
    return min(rows, key=lambda r: abs(math.log(max(seq_len, 1) / r["seq_len"])))


def preference(config, q, k, q_seg, capability: int, table: dict | None = None) -> tuple[str, ...]:
    """The backends to try, in order, for this call on a GPU of `capability` (e.g. 90).

    Example:
      >>> from shardfuse.kernels.attention.base import AttentionConfig
      >>> config = AttentionConfig(causal=True, window=None, logit_softcap=None, scale=0.1)
      >>> q = k = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
      >>> table = {"rows": [{"generation": "sm90", "head_dim": 128, "dtype": "bfloat16",
      ...           "mask": "causal", "seq_len": 4096, "order": ["mosaic_gpu", "cudnn"]}],
      ...          "fallback": {"sm90": ["mosaic_gpu", "triton"]}}
      >>> preference(config, q, k, None, 90, table)
      ('mosaic_gpu', 'cudnn', 'triton', 'xla')
    """
    table = load_table() if table is None else table
    gen = generation(capability)
    fallback = tuple(table.get("fallback", {}).get(gen, DEFAULT_FALLBACK[gen]))
    row = _row(
        table, gen, q.shape[3], jnp.dtype(q.dtype).name, mask_kind(config, q_seg is not None),
        k.shape[1],
    )  # fmt: skip
    order = tuple(row["order"]) if row else ()
    return tuple(dict.fromkeys((*order, *fallback, "xla")))


def describe(platform: str | None = None) -> str:
    """The rule in force, for `shardfuse info`."""
    platform = platform or jax.default_backend()
    table = load_table()
    if platform in ("gpu", "cuda"):
        capability = str(getattr(jax.devices()[0], "compute_capability", "9.0"))
        major, minor = (int(x) for x in capability.split(".")[:2])
        gens = [generation(10 * major + minor)]
    else:
        gens = sorted(DEFAULT_FALLBACK)
    parts = []
    for gen in gens:
        rows = [r for r in table["rows"] if r["generation"] == gen]
        fallback = table.get("fallback", {}).get(gen, DEFAULT_FALLBACK[gen])
        parts.append(
            f"{gen}: the fastest of {len(rows)} measured cases (head dim, dtype, mask, length), "
            f"else {' > '.join(fallback)}"
        )
    return f"on NVIDIA GPUs, by measurement ({table.get('source', '')}): " + "; ".join(parts)
