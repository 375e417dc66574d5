"""ColumnParallelLinear and RowParallelLinear against nnx.Linear with the same kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.layers.common import assert_sharded_as, assert_trees_close, mesh_1d, mesh_3d


def _nnx_linear_like(layer, dtype=None):
    kernel = np.asarray(layer.kernel[...])
    bias = np.asarray(layer.bias[...])
    return nnx.Linear(
        kernel.shape[0],
        kernel.shape[1],
        dtype=dtype,
        precision=jax.lax.Precision.HIGHEST,
        kernel_init=lambda *_: jnp.asarray(kernel),
        bias_init=lambda *_: jnp.asarray(bias),
        rngs=nnx.Rngs(0),
    )


def _pair(mesh, sequence_parallel, dtype=None):
    column = sf.layers.ColumnParallelLinear(
        16,
        32,
        mesh=mesh,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        bias_init=nnx.initializers.normal(1.0),
        rngs=nnx.Rngs(0),
    )
    row = sf.layers.RowParallelLinear(
        32,
        16,
        mesh=mesh,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        bias_init=nnx.initializers.normal(1.0),
        rngs=nnx.Rngs(1),
    )
    return column, row


def _loss_and_grads(column, row, x, ct):
    def loss(column, row, x):
        h = column(x)
        return jnp.sum(row(h).astype(jnp.float32) * ct), h

    (value, h), grads = nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(column, row, x)
    return value, h, grads


@pytest.mark.parametrize(
    "mesh_fn, sequence_parallel",
    [(mesh_1d, False), (mesh_1d, True), (mesh_3d, True)],
    ids=["1d", "1d-seqpar", "3d-seqpar"],
)
def test_column_row_match_nnx_linear(mesh_fn, sequence_parallel):
    mesh = mesh_fn()
    column, row = _pair(mesh, sequence_parallel)
    x = jax.random.normal(jax.random.key(0), (4, 16, 16))
    ct = jax.random.normal(jax.random.key(1), (4, 16, 16))
    value, h, (g_col, g_row, g_x) = nnx.jit(_loss_and_grads)(column, row, x, ct)
    ref_col, ref_row = _nnx_linear_like(column), _nnx_linear_like(row)
    ref_value, ref_h, (r_col, r_row, r_x) = _loss_and_grads(ref_col, ref_row, x, ct)
    assert_close(h, ref_h, name="column output")
    assert_close(value, ref_value, atol=1e-4, rtol=1e-5, name="loss")
    assert_close(g_x, r_x, kind="grad", name="dx")
    assert_trees_close(nnx.to_pure_dict(g_col), nnx.to_pure_dict(r_col), name="column")
    assert_trees_close(nnx.to_pure_dict(g_row), nnx.to_pure_dict(r_row), name="row")
    # Output shardings as documented.
    data = "data" if "data" in mesh.axis_names else None
    sequence = "sequence" if "sequence" in mesh.axis_names else None
    assert_sharded_as(h, mesh, P(data, sequence, "model"))
    if sequence_parallel:
        seq_out = (sequence, "model") if sequence else "model"
    else:
        seq_out = sequence
    assert_sharded_as(row(h), mesh, P(data, seq_out, None))


def test_bfloat16_two_x_rule():
    mesh = mesh_3d()
    column, row = _pair(mesh, True, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(0), (4, 16, 16)).astype(jnp.bfloat16)
    out = row(column(x))
    assert out.dtype == jnp.bfloat16
    ref32 = _nnx_linear_like(row)(_nnx_linear_like(column)(x.astype(jnp.float32)))
    ref_lp = _nnx_linear_like(row, jnp.bfloat16)(_nnx_linear_like(column, jnp.bfloat16)(x))
    assert_close_low_precision(out, ref32, ref_lp, name="bf16 column->row", relative_cap=True)


def test_gather_output_and_partition_specs():
    mesh = mesh_3d()
    column = sf.layers.ColumnParallelLinear(16, 32, mesh=mesh, gather_output=True, rngs=nnx.Rngs(0))
    row = sf.layers.RowParallelLinear(32, 16, mesh=mesh, rngs=nnx.Rngs(0))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(column, nnx.Param)))
    assert specs == {"kernel": P(None, "model"), "bias": P("model")}
    assert nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(row, nnx.Param))) == {
        "kernel": P("model"),  # canonical specs: no trailing None
        "bias": P(),
    }
    assert column.kernel[...].sharding.spec == P(None, "model")
    assert row.kernel[...].sharding.spec == P("model")
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    y = column(x)
    assert_sharded_as(y, mesh, P("data", "sequence", None))
    assert_close(y, _nnx_linear_like(column)(x), name="gathered output")


def test_explicit_sharding_mesh():
    mesh = jax.make_mesh((2, 2, 2), ("data", "sequence", "model"))  # Explicit axes on jax 0.10
    column, row = _pair(mesh, True)
    x = jax.random.normal(jax.random.key(0), (4, 16, 16))
    expected = _nnx_linear_like(row)(_nnx_linear_like(column)(x))
    assert_close(np.asarray(row(column(x))), np.asarray(expected), name="explicit mesh")


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda m: sf.layers.ColumnParallelLinear(16, 30, mesh=m, rngs=nnx.Rngs(0)),
            r"out_features=30 must be divisible by the size 4 of mesh axis 'model'",
        ),
        (
            lambda m: sf.layers.RowParallelLinear(30, 16, mesh=m, rngs=nnx.Rngs(0)),
            r"in_features=30 must be divisible",
        ),
        (
            lambda m: sf.layers.ColumnParallelLinear(
                16, 32, mesh=m, model_axis="tensor", rngs=nnx.Rngs(0)
            ),
            r"model_axis='tensor' is not an axis of the mesh; its axes are \('model',\)",
        ),
        (
            lambda m: sf.layers.ColumnParallelLinear(
                16, 32, mesh=m, sequence_axis="seq", rngs=nnx.Rngs(0)
            ),
            r"sequence_axis='seq' is not an axis",
        ),
    ],
)
def test_bad_construction(build, match):
    with pytest.raises(ValueError, match=match):
        build(mesh_1d())


def test_bad_call():
    column = sf.layers.ColumnParallelLinear(
        16, 32, mesh=mesh_1d(), sequence_parallel=True, rngs=nnx.Rngs(0)
    )
    with pytest.raises(ValueError, match=r"sequence length T=6 must be divisible by the size 4"):
        column(jnp.zeros((2, 6, 16)))
    with pytest.raises(ValueError, match=r"x has 8 features .* in_features=16"):
        column(jnp.zeros((2, 8, 8)))
    with pytest.raises(ValueError, match=r"expected \[B, T, 16\]"):
        column(jnp.zeros((8, 16)))


def test_row_parallel_with_replicated_input():
    mesh = mesh_3d()
    row = sf.layers.RowParallelLinear(32, 16, mesh=mesh, input_is_parallel=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))  # replicated features
    y = row(x)
    assert_sharded_as(y, mesh, P("data", "sequence", None))
    assert_close(y, _nnx_linear_like(row)(x), name="row on a replicated input")
