"""Grouped (mixture-of-experts) matmul benchmarks: `sf.grouped_matmul` against its peers.

The shapes, routings and contenders are `shardfuse.bench.moe`'s: two MoE layers'
expert up-projections (`mixtral-8x7b`, 8 experts top 2; `olmoe-1b-7b`, 64 small
experts top 8; widths / 8 on CPU) x balanced and Zipf-skewed routing x forward and
forward + backward x float32 and bfloat16 on CPU (the scale's dtype elsewhere).
Each group times, in the same run, `shardfuse` (the platform's default),
`shardfuse.<impl>` (xla everywhere; triton on NVIDIA GPUs; pallas_tpu on TPU, on
CPU only with --bench-interpret), `jax.lax.ragged_dot`, `tokamax.ragged_dot`,
`one_hot_dense` and the baseline `dense_matmul`: one `[M, K] @ [K, N]` of the same
FLOPs, so `vs baseline` is the fraction of the dense matmul rate. `--quick` times
the default, the peers and the baseline, forward + backward (which holds a forward),
float32 on CPU: 20 cases, the peers' G x FLOPs the bulk of them.

FLOPs `2 M K N` forward, 3x that forward + backward (`sf.flops.grouped_matmul_flops`);
bytes: lhs, rhs and the output once (and d lhs, d rhs, the cotangent backward).
"""

import jax
import jax.numpy as jnp
import pytest

from shardfuse.bench import flops, moe
from shardfuse.bench.harness import BenchCase, not_timed_reason, with_backward

OP = "grouped_matmul"
IMPLEMENTATIONS = (
    "shardfuse",
    "shardfuse.xla",
    "shardfuse.triton",
    "shardfuse.pallas_tpu",
    *moe.PEERS,
    moe.DENSE,
)
QUICK = ("shardfuse", *moe.PEERS, moe.DENSE)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_grouped_matmul":
        return
    scale = metafunc.config.bench_scale
    quick = scale.name.endswith("quick")
    dtypes = ("float32", "bfloat16") if scale.name == "cpu" else (scale.dtype,)
    params = [
        (shape, routing, mode, dtype, impl)
        for shape in moe.MOE_SHAPES
        for routing in moe.ROUTINGS
        for mode in ((flops.FWD_BWD,) if quick else flops.MODES)
        for dtype in dtypes
        for impl in (QUICK if quick else IMPLEMENTATIONS)
    ]
    metafunc.parametrize(
        "shape_name, routing, mode, dtype, implementation",
        params,
        ids=["-".join(p) for p in params],
    )


def test_grouped_matmul(
    measure, bench_scale, shape_name, routing, mode, dtype, implementation, pytestconfig
):
    backend = jax.default_backend()
    reason = not_timed_reason(implementation, backend, pytestconfig.bench_interpret)
    if reason:
        pytest.skip(reason)
    shape = moe.MOE_SHAPES[shape_name].scaled(bench_scale.divisor)
    tokens = moe.TOKENS[bench_scale.name]
    lhs, rhs, sizes, cotangent = moe.inputs(shape, tokens, routing, jnp.dtype(dtype))
    (M, K), N, G = lhs.shape, shape.expert_hidden, shape.experts
    itemsize = jnp.dtype(dtype).itemsize
    io = (M * K + G * K * N + M * N) * itemsize
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=mode,
        shape={"M": M, "K": K, "N": N, "G": G, "top_k": shape.top_k},
        dtype=dtype,
        flops=flops.grouped_matmul_flops(M, K, N, mode=mode),
        bytes=io if mode == flops.FWD else 2 * io + M * N * itemsize,
        baseline=moe.DENSE,
        model=shape.name,
        variant=f"{routing} routing",
    )
    try:
        fn = moe.contender(implementation)
    except ImportError as e:
        pytest.skip(f"{implementation} is not installed: {e}")
    args = (lhs, rhs[0]) if implementation == moe.DENSE else (lhs, rhs, sizes)
    if mode == flops.FWD_BWD:  # the sizes' (integer) cotangent is float0: no work
        fn, args = with_backward(fn), (*args, cotangent)
    # Third-party peers' own limits are not ours to report as failures.
    skip_on = None if implementation.startswith("shardfuse") else (Exception,)
    measure(fn, args, case, skip_on=skip_on)
