"""Collective matmul benchmarks: the overlapped rings against XLA's plain collective form.

A Megatron sequence-parallel MLP on a ring of all devices (8 CPU devices by
default), tokens `M = batch * seq_len` rows:

- `all_gather_matmul`, the up projection: x `[M, hidden]` sharded on M, w
  `[hidden, ffn_hidden]` sharded on its columns. Baseline `xla.all_gather_dot`:
  `lax.all_gather(x, tiled=True)` then `jnp.dot`.
- `matmul_reduce_scatter`, the down projection: x `[M, ffn_hidden]` and w
  `[ffn_hidden, hidden]` sharded on ffn_hidden, result sharded on M. Baseline
  `xla.dot_psum_scatter`: `jnp.dot` (float32 result) then `lax.psum_scatter`.
- `matmul_all_reduce`, the same down projection without sequence parallelism.
  Baseline `xla.dot_psum`.

Implementations, same run: `shardfuse.xla` (unidirectional ring),
`shardfuse.xla.bidirectional`, and the baseline; `shardfuse.pallas_tpu` on TPU
(skipped elsewhere, with why).
Forward for every shape, fwd+bwd (`jax.vjp`, both operands) at the largest.

Every case also records the cost model's prediction for the *unscaled* model
at the same token count on a ring of 8 (`predicted_hidden_h100_nvlink`,
`predicted_hidden_tpu_v5p_ici`: the fraction of the communication the matmuls
hide; see `shardfuse.collectives.collective_matmul.cost_model`). On CPU the
"devices" share two cores and ppermute is a memcpy, so the measured ratios
show the cost of the decomposition, not the overlap a GPU or TPU would get.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.bench import flops
from shardfuse.bench.harness import BenchCase, with_backward
from shardfuse.collectives.collective_matmul import cost_model
from shardfuse.models import MODELS

AXIS = "model"
BASELINES = {
    "all_gather_matmul": "xla.all_gather_dot",
    "matmul_reduce_scatter": "xla.dot_psum_scatter",
    "matmul_all_reduce": "xla.dot_psum",
}
PREDICTION_RING = 8


def implementations(op: str) -> list[str]:
    """The implementations of `op`, in every run (pallas_tpu skips itself off TPU, with why)."""
    names = ["shardfuse.xla", BASELINES[op], "shardfuse.pallas_tpu"]
    if op != "matmul_all_reduce":
        names.insert(1, "shardfuse.xla.bidirectional")
    return names


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_collective_matmul":
        return
    cases = [(op, impl) for op in BASELINES for impl in implementations(op)]
    params, ids = metafunc.config.bench_scale.grid(cases)
    metafunc.parametrize("model_name, seq_len, mode, op, implementation", params, ids=ids)


def layout(op: str, M: int, hidden: int, ffn_hidden: int):
    """Global (x shape, w shape, x spec, w spec, out spec) of `op` in the MLP."""
    if op == "all_gather_matmul":
        return (M, hidden), (hidden, ffn_hidden), P(AXIS), P(None, AXIS), P(None, AXIS)
    out = P(AXIS) if op == "matmul_reduce_scatter" else P()
    return (M, ffn_hidden), (ffn_hidden, hidden), P(None, AXIS), P(AXIS), out


def per_shard(op: str, implementation: str):
    """The per-shard function of one implementation (the baseline: XLA's collective form)."""
    if implementation == BASELINES[op]:

        def baseline(x, w):
            precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
            if op == "all_gather_matmul":
                x = lax.all_gather(x, AXIS, axis=0, tiled=True)
                return jnp.dot(x, w, precision=precision)
            y = jnp.dot(x, w, precision=precision, preferred_element_type=jnp.float32)
            if op == "matmul_reduce_scatter":
                return lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=True).astype(x.dtype)
            return lax.psum(y, AXIS).astype(x.dtype)

        return baseline
    impl = implementation.removeprefix("shardfuse.")
    options = {}
    if impl.endswith(".bidirectional"):
        impl = impl.removesuffix(".bidirectional")
        options["bidirectional"] = True
    fn = getattr(sf.collectives, op)
    return lambda x, w: fn(x, w, AXIS, implementation=impl, **options)


def predictions(op: str, model_name: str, tokens: int) -> dict:
    """The cost model's hidden fraction for the unscaled model on a ring of 8, per preset."""
    model = MODELS[model_name]
    contract, cols = (
        (model.hidden, model.ffn_hidden)
        if op == "all_gather_matmul"
        else (model.ffn_hidden, model.hidden)
    )
    result = {}
    for preset in cost_model.PRESETS:
        cost = cost_model.ring_cost(
            op,
            rows=max(tokens, PREDICTION_RING),
            contract=contract,
            cols=cols,
            ring_size=PREDICTION_RING,
            hardware=preset,
            bidirectional=True,
        )
        result[f"predicted_hidden_{preset}"] = round(cost.hidden_fraction, 3)
    return result


def test_collective_matmul(
    measure, benchmark, bench_scale, model_name, seq_len, mode, op, implementation
):
    if implementation == "shardfuse.pallas_tpu" and jax.default_backend() != "tpu":
        # Off TPU its kernels run in TPU interpret mode, a simulator: no time worth a row.
        pytest.skip(
            f"{implementation} is timed on TPU only (on {jax.default_backend()!r} it would run "
            "in TPU interpret mode, a simulator)"
        )
    model = bench_scale.scaled(MODELS[model_name])
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    M = max(bench_scale.batch(seq_len) * seq_len, n)
    M -= M % n
    hidden, ffn_hidden = model.hidden - model.hidden % n, model.ffn_hidden - model.ffn_hidden % n
    x_shape, w_shape, x_spec, w_spec, out_spec = layout(op, M, hidden, ffn_hidden)
    dtype = jnp.dtype(bench_scale.dtype)
    C, N = w_shape
    case = BenchCase(
        op=op,
        implementation=implementation,
        mode=mode,
        shape={"M": M, "C": C, "N": N, "ring": n},
        dtype=dtype.name,
        flops=flops.matmul_flops(M, N, C) * (3 if mode == flops.FWD_BWD else 1),
        bytes=flops.matmul_bytes(M, N, C, dtype.itemsize),
        baseline=BASELINES[op],
        model=model.name,
        variant="mlp_up" if op == "all_gather_matmul" else "mlp_down",
        seq_len=seq_len,
    )
    kx, kw = jax.random.split(jax.random.key(seq_len))
    x = jax.device_put(jax.random.normal(kx, x_shape, dtype), NamedSharding(mesh, x_spec))
    w = jax.device_put(
        (jax.random.normal(kw, w_shape, jnp.float32) * C**-0.5).astype(dtype),
        NamedSharding(mesh, w_spec),
    )
    sharded = jax.shard_map(
        per_shard(op, implementation), mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec
    )
    if mode == flops.FWD:
        fn, args = sharded, (x, w)
    else:
        cotangent = jax.device_put(
            jnp.ones(jax.eval_shape(sharded, x, w).shape, dtype), NamedSharding(mesh, out_spec)
        )

        fn, args = with_backward(sharded), (x, w, cotangent)
    measure(fn, args, case)
    benchmark.extra_info.update(predictions(op, model_name, bench_scale.batch(seq_len) * seq_len))
