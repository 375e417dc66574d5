"""Decode-attention benchmarks: `sf.decode_attention` and `jax.nn.dot_product_attention`.

One decode step of each model's attention: T new queries (1, and 4 as in
speculative decoding) per batch row against a KV cache of capacity S (the run's
sequence lengths) whose rows hold different valid lengths (from S down to about
S / 2), GQA as the model has it, plus its sliding window and logit softcap.
Every group times, in the same run:

- `reference`: `sf.decode_attention(implementation="reference")`, the oracle;
- `shardfuse.<impl>`: xla everywhere (chunked, merged by lse); pallas_tpu on
  TPU (on CPU only with --bench-interpret); triton on NVIDIA GPUs;
- `jax.nn.xla`: `jax.nn.dot_product_attention` with the same mask given as a
  boolean `[B, 1, T, S]` array built from the lengths inside the timed call
  (jax.nn's own `is_causal` is top-left aligned and cannot place the queries at
  each row's end): the baseline ratios are taken to (the reference where
  jax.nn cannot express the case: it has no logit softcap);
- `jax.nn.cudnn` (GPU): `key_value_seq_lengths=lengths`, for T = 1 without a
  window (the cases its length masking expresses).

FLOPs count the visible (query, key) pairs of each row (`shardfuse.flops`);
bytes are q, out and lse plus the K/V rows below each row's length, read once.
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.bench import flops
from shardfuse.bench.harness import ATTENTION_IMPLEMENTATIONS, BenchCase, not_timed_reason
from shardfuse.models import MODELS

OP = "decode_attention"
BASELINE = "jax.nn.xla"
QUERIES = (1, 4)
IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_decode_attention":
        return
    scale = metafunc.config.bench_scale
    params, ids = [], []
    for model in scale.models:
        for seq_len in scale.seq_lens:
            for T in QUERIES:
                for impl in IMPLEMENTATIONS:
                    params.append((model, seq_len, T, impl))
                    ids.append(f"{model}-S{seq_len}-T{T}-{impl}")
    metafunc.parametrize("model_name, seq_len, num_queries, implementation", params, ids=ids)


def decode_batch(scale) -> int:
    """Batch rows of a decode step: 16 on accelerators, 2 at the CPU scales."""
    return max(2, scale.tokens_per_batch // 1024)


def cache_lengths(B: int, S: int) -> list[int]:
    """Valid lengths of the B rows: from S down to about S / 2.

    Example:
      >>> cache_lengths(4, 512)
      [512, 448, 384, 320]
    """
    return [S - i * S // (2 * B) for i in range(B)]


def _mask(lengths, T, S, window):
    """bool `[B, 1, T, S]`: the decode mask (`sf.decode_attention`'s docstring)."""
    q_pos = lengths[:, None, None] - T + jnp.arange(T)[None, :, None]  # [B, T, 1]
    kv_pos = jnp.arange(S)[None, None, :]
    mask = (kv_pos < lengths[:, None, None]) & (kv_pos <= q_pos)
    if window is not None:
        mask &= q_pos - kv_pos <= window[0]
    return mask[:, None]


def _decode_fn(implementation, model, window, T, S):
    """`f(q, k, v, lengths) -> out`, or a skip reason."""
    softcap = model.logit_softcap
    if implementation == "reference" or implementation.startswith("shardfuse."):
        impl = implementation.removeprefix("shardfuse.")
        return lambda q, k, v, lengths: sf.decode_attention(
            q, k, v, lengths, window=window, logit_softcap=softcap, implementation=impl
        )
    if softcap is not None:
        return f"{implementation} has no logit softcap"
    if implementation == "jax.nn.xla":
        return lambda q, k, v, lengths: jax.nn.dot_product_attention(
            q, k, v, mask=_mask(lengths, T, S, window), implementation="xla"
        )
    if implementation == "jax.nn.cudnn":
        if T != 1 or window is not None:
            return "jax.nn.cudnn: its length masking expresses T = 1 without a window only"
        return lambda q, k, v, lengths: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"
        )
    raise ValueError(f"unknown implementation {implementation!r}")


def test_decode_attention(
    measure, bench_scale, model_name, seq_len, num_queries, implementation, pytestconfig
):
    reason = not_timed_reason(implementation, jax.default_backend(), pytestconfig.bench_interpret)
    if reason:
        pytest.skip(reason)
    model = bench_scale.scaled(MODELS[model_name])
    B, T, S = decode_batch(bench_scale), num_queries, seq_len
    H, K, D = model.heads, model.kv_heads, model.head_dim
    dtype = jnp.dtype(bench_scale.dtype)
    window, variant = model.causal_mask
    lengths = cache_lengths(B, S)
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=flops.FWD,
        shape={"B": B, "T": T, "S": S, "H": H, "K": K, "D": D},
        dtype=dtype.name,
        flops=sum(
            flops.attention_flops(1, T, L, H, D, causal=True, window=window) for L in lengths
        ),
        bytes=sum(flops.attention_bytes(1, T, L, H, K, D, dtype.itemsize) for L in lengths),
        baseline="reference" if model.logit_softcap else BASELINE,
        model=model.name,
        variant=variant,
        seq_len=seq_len,
    )
    fn = _decode_fn(implementation, model, window, T, S)
    if isinstance(fn, str):
        pytest.skip(fn)
    keys = jax.random.split(jax.random.key(seq_len), 3)
    q = jax.random.normal(keys[0], (B, T, H, D), dtype)
    k = jax.random.normal(keys[1], (B, S, K, D), dtype)
    v = jax.random.normal(keys[2], (B, S, K, D), dtype)
    args = (q, k, v, jnp.asarray(lengths, jnp.int32))
    third_party = implementation == "jax.nn.cudnn"
    measure(fn, args, case, skip_on=(Exception,) if third_party else None)
