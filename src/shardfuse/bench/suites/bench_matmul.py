"""Matmul benchmarks: `sf.matmul` (a @ b + c, float32 accumulation) against a plain dot.

The shapes are a transformer's projections at `tokens = batch * seq_len` rows:
`qkv` `[tokens, hidden] @ [hidden, (H + 2K) D]`, `mlp_up` `[tokens, hidden] @
[hidden, ffn_hidden]` and `mlp_down` `[tokens, ffn_hidden] @ [ffn_hidden, hidden]`,
each with a float32 addend `c` `[tokens, N]` (the partial sum of a
reduce-scatter ring step, the case the fused epilogue is for).

Implementations, same run: `reference` (shardfuse's oracle), `shardfuse.<impl>`
(xla everywhere; pallas_tpu on TPU, on CPU only with --bench-interpret;
triton on NVIDIA GPUs; one that cannot run here is skipped with why), and
the baseline `jnp.dot`: `(jnp.dot(a, b, preferred_element_type=float32) + c)`
cast to the output dtype, at the same precision (HIGHEST for float32 inputs).
Forward only. FLOPs `2 M N C`; bytes: a, b and c read once, the output written once.
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import shardfuse as sf
from shardfuse.bench import flops
from shardfuse.bench.harness import BenchCase, not_timed_reason
from shardfuse.models import MODELS

OP = "matmul"
BASELINE = "jnp.dot"
PROJECTIONS = ("qkv", "mlp_up", "mlp_down")


# Every implementation is listed in every run: those that cannot run here are
# skipped with the reason, which the report prints under the table.
IMPLEMENTATIONS = (
    "reference",
    "shardfuse.xla",
    "shardfuse.pallas_tpu",
    "shardfuse.triton",
    BASELINE,
)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_matmul":
        return
    cases = [(projection, impl) for projection in PROJECTIONS for impl in IMPLEMENTATIONS]
    params, ids = metafunc.config.bench_scale.grid(cases, modes=None)
    metafunc.parametrize("model_name, seq_len, projection, implementation", params, ids=ids)


def projection_shape(model, projection: str) -> tuple[int, int]:
    """`(C, N)`: contraction and output width of one of the model's projections."""
    if projection == "qkv":
        return model.hidden, (model.heads + 2 * model.kv_heads) * model.head_dim
    if projection == "mlp_up":
        return model.hidden, model.ffn_hidden
    if projection == "mlp_down":
        return model.ffn_hidden, model.hidden
    raise ValueError(f"projection={projection!r} is not one of {PROJECTIONS}")


def _matmul_fn(implementation, dtype):
    if implementation == BASELINE:
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT

        def dot(a, b, c):
            out = jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)
            return (out + c).astype(a.dtype)

        return dot
    impl = implementation.removeprefix("shardfuse.")
    return lambda a, b, c: sf.matmul(a, b, addend=c, implementation=impl)


def test_matmul(
    measure, bench_scale, model_name, seq_len, projection, implementation, pytestconfig
):
    reason = not_timed_reason(implementation, jax.default_backend(), pytestconfig.bench_interpret)
    if reason:
        pytest.skip(reason)
    model = bench_scale.scaled(MODELS[model_name])
    M = bench_scale.batch(seq_len) * seq_len
    C, N = projection_shape(model, projection)
    dtype = jnp.dtype(bench_scale.dtype)
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=flops.FWD,
        shape={"M": M, "N": N, "C": C},
        dtype=dtype.name,
        flops=flops.matmul_flops(M, N, C),
        bytes=flops.matmul_bytes(M, N, C, dtype.itemsize) + M * N * 4,  # + float32 addend c
        baseline=BASELINE,
        model=model.name,
        variant=f"{projection} + c",
        seq_len=seq_len,
    )
    keys = jax.random.split(jax.random.key(seq_len), 3)
    a = jax.random.normal(keys[0], (M, C), dtype)
    b = jax.random.normal(keys[1], (C, N), dtype) * C**-0.5
    c = jax.random.normal(keys[2], (M, N), jnp.float32)
    measure(_matmul_fn(implementation, dtype), (a, b, c), case)
