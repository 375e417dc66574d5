"""Attention benchmarks: shardfuse's implementations and their baselines, side by side.

Every group (one model's attention at one sequence length, forward or
forward + backward) times, in the same run:

- `reference`: `sf.attention_reference`, the oracle (materialises `[T, S]`);
- `shardfuse.<impl>`: `sf.flash_attention(implementation=impl)` for every
  implementation (xla everywhere; pallas_tpu on TPU, and on CPU only with
  --bench-interpret; triton on NVIDIA GPUs, elsewhere it says why not);
- `jax.nn.xla` (and `jax.nn.cudnn` on GPU): `jax.nn.dot_product_attention`,
  the baseline that ratios are taken to (the reference where jax.nn cannot
  express the case: it has no logit softcap);
- `jax.pallas`: JAX's own Pallas flash attention (`pallas.ops.tpu.flash_attention`
  on TPU, `pallas.ops.gpu.attention.mha` on GPU). On CPU it only runs in
  interpret mode, which times a simulator (about 25x slower than shardfuse.xla
  forward at T=256 on the 2-core CI machine), so it runs there only with
  --bench-interpret. It has no GQA: K/V heads are repeated to H before timing.

Every implementation is in every run: one that cannot run here is skipped
with the reason, and `shardfuse bench` lists those under the table.

Masks: causal, plus each model's sliding window (of `window` keys, the query
itself included) and logit softcap. FLOPs and bytes: `shardfuse.bench.flops`.
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.bench import flops
from shardfuse.bench.harness import (
    ATTENTION_IMPLEMENTATIONS,
    BenchCase,
    not_timed_reason,
    with_backward,
)
from shardfuse.models import MODELS

OP = "flash_attention"
BASELINE = "jax.nn.xla"


# Every implementation is listed in every run: those that cannot run here are
# skipped with the reason, which the report prints under the table.
IMPLEMENTATIONS = (*ATTENTION_IMPLEMENTATIONS, "jax.pallas")


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_attention":
        return
    params, ids = metafunc.config.bench_scale.grid(IMPLEMENTATIONS, modes="all")
    metafunc.parametrize("model_name, seq_len, mode, implementation", params, ids=ids)


def _attention_fn(implementation, model, window, D):
    """`f(q, k, v) -> out` on `[B, T, H, D]`, `[B, S, K, D]` inputs, or a skip reason."""
    softcap = model.logit_softcap
    if implementation == "reference" or implementation.startswith("shardfuse."):
        impl = implementation.removeprefix("shardfuse.")
        return lambda q, k, v: sf.flash_attention(
            q, k, v, causal=True, window=window, logit_softcap=softcap, implementation=impl
        )
    if softcap is not None:
        return f"{implementation} has no logit softcap"
    if implementation.startswith("jax.nn."):
        impl = implementation.removeprefix("jax.nn.")
        return lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=window, implementation=impl
        )
    if implementation == "jax.pallas":
        if window is not None:
            return "jax.pallas flash attention has no sliding window"
        return _jax_pallas_fn(D)
    raise ValueError(f"unknown implementation {implementation!r}")


def _jax_pallas_fn(D):
    """JAX's Pallas flash attention on `[B, T, H, D]` with K/V already repeated to H heads."""
    scale = D**-0.5
    if jax.default_backend() in ("gpu", "cuda"):
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

        return lambda q, k, v: gpu_attention.mha(q, k, v, None, sm_scale=scale, causal=True)
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

    def tpu_layout(q, k, v):  # [B, T, H, D] -> [B, H, T, D]
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        out = tpu_attention.flash_attention(q, k, v, causal=True, sm_scale=scale)
        return out.transpose(0, 2, 1, 3)

    if jax.default_backend() == "tpu":
        return tpu_layout

    def interpreted(q, k, v):
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            return tpu_layout(q, k, v)

    return interpreted


def test_attention(measure, bench_scale, model_name, seq_len, mode, implementation, pytestconfig):
    reason = not_timed_reason(implementation, jax.default_backend(), pytestconfig.bench_interpret)
    if reason:
        pytest.skip(reason)
    model = bench_scale.scaled(MODELS[model_name])
    B, T, S = bench_scale.batch(seq_len), seq_len, seq_len
    H, K, D = model.heads, model.kv_heads, model.head_dim
    dtype = jnp.dtype(bench_scale.dtype)
    window, variant = model.causal_mask
    baseline = "reference" if model.logit_softcap else BASELINE
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=mode,
        shape={"B": B, "T": T, "S": S, "H": H, "K": K, "D": D},
        dtype=dtype.name,
        flops=flops.attention_flops(B, T, S, H, D, causal=True, window=window, mode=mode),
        bytes=flops.attention_bytes(B, T, S, H, K, D, dtype.itemsize, mode=mode),
        baseline=baseline,
        model=model.name,
        variant=variant,
        seq_len=seq_len,
    )
    fn = _attention_fn(implementation, model, window, D)
    if isinstance(fn, str):
        pytest.skip(fn)
    keys = jax.random.split(jax.random.key(seq_len), 4)
    q = jax.random.normal(keys[0], (B, T, H, D), dtype)
    k = jax.random.normal(keys[1], (B, S, K, D), dtype)
    v = jax.random.normal(keys[2], (B, S, K, D), dtype)
    if implementation == "jax.pallas":  # no GQA: repeat K/V heads outside the timing
        k, v = (jnp.repeat(x, H // K, axis=2) for x in (k, v))
    args = (q, k, v)
    if mode == flops.FWD_BWD:
        fn = with_backward(fn)
        args += (jax.random.normal(keys[3], (B, T, H, D), dtype),)
    # JAX's Pallas kernels and cuDNN have limits of their own (head dims, shared memory):
    # a compile error there skips the case with the error instead of failing the run.
    third_party = implementation in ("jax.pallas", "jax.nn.cudnn")
    measure(fn, args, case, skip_on=(Exception,) if third_party else None)
