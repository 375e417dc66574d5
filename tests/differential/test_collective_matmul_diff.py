"""Generated differential test of the collective matmuls against JAX's own collectives.

Hypothesis draws `MatmulConfig`s (strategies_attention.py): `all_gather_matmul`,
`matmul_reduce_scatter`, `matmul_all_reduce` x ring sizes 1, 2, 3, 4, 8 (with a "data"
axis beside the ring on 2-D meshes) x Explicit / Auto axes x x of rank 2 or 3 with the
row axis anywhere but the last (negative too) x rows the ring does or does not divide x
unidirectional / bidirectional x precision x implementations that run on CPU (None,
reference, xla; pallas_tpu in TPU interpret mode under -m slow) x float32 / bfloat16 /
float16. In one jitted call, inside the same `jax.shard_map`, each is compared with
`all_gather(x) @ w`, `psum_scatter(x @ w)` or `psum(x @ w)` (float32 accumulation at
HIGHEST precision): values, the vjp of a random cotangent (dx, dw), and the output
sharding. Refused configurations must raise the predicted error naming the argument.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.differential import strategies_attention as sa
from tests.differential.budget import budget_params

pytestmark = pytest.mark.timeout(1200)

NAMES = ("y", "dx", "dw")


def layout(config):
    """Global shapes and PartitionSpecs: `(x_shape, w_shape, x_spec, w_spec, out_spec)`."""
    n, row, rank = config.n, config.row_axis, config.rank
    rows = n * config.m + config.extra_rows
    data = "data" if config.data > 1 else None
    lead, lead_spec = [0] * (rank - 1), [None] * (rank - 1)
    lead[row], lead_spec[row] = rows, "model"
    if rank == 3:  # the other leading axis: the batch, split over "data"
        lead[1 - row], lead_spec[1 - row] = 2 * config.data, data
    if config.op == "all_gather_matmul":
        x_shape, w_shape = (*lead, config.c), (config.c, n * config.f)
        out_spec = [*lead_spec, "model"]
        out_spec[row] = None
        return x_shape, w_shape, P(*lead_spec, None), P(None, "model"), P(*out_spec)
    x_shape, w_shape = (*lead, n * config.c), (n * config.c, config.f)
    x_spec = list(lead_spec)
    x_spec[row] = None
    out_spec = list(lead_spec if config.op == "matmul_reduce_scatter" else x_spec)
    return x_shape, w_shape, P(*x_spec, "model"), P("model", None), P(*out_spec, None)


def _oracle(config):
    """The op with `lax.all_gather` / `psum_scatter` / `psum` and a plain float32 matmul."""
    row = config.row_axis

    def matmul(a, b):
        return jnp.matmul(a, b, precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)  # fmt: skip

    def oracle(x, w):
        if config.op == "all_gather_matmul":
            gathered = lax.all_gather(x, "model", axis=row, tiled=True)
            return matmul(gathered, w).astype(x.dtype)
        if config.op == "matmul_reduce_scatter":
            product = matmul(x, w)
            return lax.psum_scatter(product, "model", scatter_dimension=row, tiled=True).astype(
                x.dtype
            )
        return lax.psum(matmul(x, w), "model").astype(x.dtype)

    return oracle


def _under_test(config, axis_name="model"):
    fn = getattr(sf.collectives, config.op)
    options = dict(implementation=config.implementation, precision=config.precision)
    axis = config.axis
    if config.bad == "axis":
        axis = config.rank - 1
    if config.op == "all_gather_matmul":
        options.update(gather_axis=axis, bidirectional=config.bidirectional)
    elif config.op == "matmul_reduce_scatter":
        options.update(scatter_axis=axis, bidirectional=config.bidirectional)
    return lambda x, w: fn(x, w, axis_name, **options)


def _mesh(config):
    if config.data > 1:
        return sa.mesh((config.data, config.n), ("data", "model"), config.explicit)
    return sa.mesh((config.n,), ("model",), config.explicit)


@functools.cache
def _program(config):
    """Jitted `(x, w, dy) -> (actual, ref32, ref_lp or None)`, each `(y, dx, dw)`."""
    _, _, x_spec, w_spec, out_spec = layout(config)
    mesh = _mesh(config)

    def sharded(per_shard):
        return jax.shard_map(per_shard, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)

    under_test, oracle = sharded(_under_test(config)), sharded(_oracle(config))

    def with_vjp(f, x, w, dy):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy.astype(y.dtype)))

    @jax.jit
    def run(x, w, dy):
        low = (x.astype(config.dtype), w.astype(config.dtype))
        rounded = [a.astype(jnp.float32) for a in low]
        actual = with_vjp(under_test, *low, dy)
        ref32 = with_vjp(oracle, *rounded, dy)
        ref_lp = None if config.dtype == "float32" else with_vjp(oracle, *low, dy)
        return actual, ref32, ref_lp

    return run


def _inputs(config):
    """x, w, cotangent (float32), scaled so outputs and gradients are O(1)."""
    x_shape, w_shape, x_spec, w_spec, out_spec = layout(config)
    rng = np.random.default_rng(config.seed)
    x = 0.5 * rng.standard_normal(x_shape, np.float32)
    w = rng.standard_normal(w_shape, np.float32) / np.sqrt(w_shape[0])
    out_shape = (*x_shape[:-1], w_shape[1])
    dy = rng.standard_normal(out_shape, np.float32) / np.sqrt(np.prod(x_shape[:-1]))
    mesh = _mesh(config)
    return [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in ((x, x_spec), (w, w_spec), (dy, out_spec))]  # fmt: skip


def _check_refused(config, refusal):
    x_shape, w_shape, x_spec, w_spec, out_spec = layout(config)
    mesh = _mesh(config)
    axis_name = "tensor" if config.bad == "axis_name" else "model"
    per_shard = _under_test(config, axis_name)

    def call(x, w):
        x, w = x.astype(config.dtype), w.astype(config.dtype)
        if config.bad == "dtype_mismatch":
            w = w.astype(jnp.float32 if config.dtype != "float32" else jnp.bfloat16)
        return per_shard(x, w)

    f = jax.shard_map(call, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    x, w = (jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
            for shape, spec in ((x_shape, x_spec), (w_shape, w_spec)))  # fmt: skip
    with pytest.raises(refusal[0], match=refusal[1]):
        jax.jit(f)(x, w)


def check_matmul(config: sa.MatmulConfig, tally: sa.Tally | None = None) -> None:
    refusal = config.refusal()
    if tally is not None:
        tally.count(refusal is not None)
    if refusal is not None:
        _check_refused(config, refusal)
        return
    x, w, dy = _inputs(config)
    actual, ref32, ref_lp = jax.block_until_ready(_program(config)(x, w, dy))
    expected = NamedSharding(_mesh(config), layout(config)[4])
    assert actual[0].sharding.is_equivalent_to(expected, actual[0].ndim), (
        f"y sharding {actual[0].sharding} != {expected}"
    )
    for i, name in enumerate(NAMES):
        what = f"{config.op} {name}"
        kind = "output" if name == "y" else "grad"
        got, ref = np.asarray(actual[i], np.float32), np.asarray(ref32[i], np.float32)
        if ref_lp is None:
            assert_close(got, ref, kind=kind, name=what)
        else:
            low = np.asarray(ref_lp[i], np.float32)
            assert_close_low_precision(got, ref, low, kind=kind, name=what, relative_cap=True)


CORNERS = (
    sa.MatmulConfig(op="all_gather_matmul", n=4, data=2, explicit=True, rank=3, axis=-2,
                    bidirectional=True, dtype="float32", m=3, c=8, f=5, extra_rows=0,
                    precision=None, implementation="xla", seed=0),
    sa.MatmulConfig(op="matmul_reduce_scatter", n=8, data=1, explicit=False, rank=2, axis=0,
                    bidirectional=True, dtype="bfloat16", m=2, c=3, f=8, extra_rows=0,
                    precision="highest", implementation="xla", seed=1),
)  # fmt: skip


@pytest.mark.parametrize("n", budget_params(4, 40))
def test_collective_matmuls_match_lax(n):
    tally, drawn = sa.Tally("collective matmuls"), set()

    def check(c):
        drawn.add((c.op, c.implementation))
        check_matmul(c, tally)

    sa.run_with_examples(check, sa.matmul_configs(), n, CORNERS)
    tally.report()
    if n >= 10:  # the slow budget: every op with every implementation
        want = {(op, i) for op in sa.MATMUL_OPS for i in (None, "reference", "xla")}
        sa.draw_missing(check, sorted(want, key=str), drawn, lambda w: sa.matmul_configs(
            implementations=(w[1],)).filter(lambda c: c.op == w[0]))  # fmt: skip
        assert want <= drawn, want - drawn


@pytest.mark.slow
@pytest.mark.parametrize("n", [pytest.param(10, id="slow")])
def test_collective_matmuls_pallas_tpu_interpret(n):
    tally, drawn = sa.Tally("collective matmuls pallas_tpu (interpret)"), set()

    def check(c):
        drawn.add(c.op)
        check_matmul(c, tally)

    strategy = sa.matmul_configs(implementations=("pallas_tpu",))
    sa.run_with_examples(check, strategy, n)
    sa.draw_missing(
        check, sa.MATMUL_OPS[:2], drawn, lambda op: strategy.filter(lambda c: c.op == op)
    )
    tally.report()
    # the fused kernels refuse the all-reduce (drawn rarely): both ops they run
    assert set(sa.MATMUL_OPS[:2]) <= drawn, drawn
