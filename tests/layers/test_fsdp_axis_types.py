"""Every layer with a ZeRO-3 `fsdp_axis`, on Explicit and Auto meshes, eager and under nnx.jit.

Issue 24: `Norm(..., fsdp_axis="fsdp")` on an Explicit `(data, fsdp)` mesh, called on
activations sharded as the layers shard them (`P((data, fsdp))` on the batch), raised
`ShardingTypeError` (the fsdp-sharded scale met a batch sharded over the same axis). The
sweep runs forward and a random-cotangent gradient (parameters and input) of each layer
and compares them with the same layer, same parameter values, on a one-device mesh.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.testing import assert_close
from tests.layers.common import assert_trees_close

F, HIDDEN, HEADS = 16, 32, 2
B, T = 8, 8


def _block(mesh, rngs, **kwargs):
    return sf.layers.ParallelTransformerBlock(F, HEADS, HIDDEN, mesh=mesh, rngs=rngs, **kwargs)


# name -> make(mesh, rngs); every layer of sf.layers that takes an fsdp axis
LAYERS = {
    "rmsnorm": lambda mesh, rngs: sf.layers.Norm(F, mesh=mesh, fsdp_axis="fsdp", rngs=rngs),
    "layernorm": lambda mesh, rngs: sf.layers.Norm(
        F, kind="layernorm", mesh=mesh, fsdp_axis="fsdp", rngs=rngs
    ),
    "column": lambda mesh, rngs: sf.layers.ColumnParallelLinear(
        F, F, mesh=mesh, zero=3, fsdp_axis="fsdp", rngs=rngs
    ),
    "row": lambda mesh, rngs: sf.layers.RowParallelLinear(
        F, F, input_is_parallel=False, mesh=mesh, zero=3, fsdp_axis="fsdp", rngs=rngs
    ),
    "mlp": lambda mesh, rngs: sf.layers.ParallelMLP(
        F, HIDDEN, activation="swiglu", mesh=mesh, zero=3, fsdp_axis="fsdp", rngs=rngs
    ),
    "attention": lambda mesh, rngs: sf.layers.ParallelSelfAttention(
        F, HEADS, mesh=mesh, zero=3, fsdp_axis="fsdp", rngs=rngs
    ),
    "block": lambda mesh, rngs: _block(mesh, rngs, zero=3, fsdp_axis="fsdp"),
    "stack": lambda mesh, rngs: sf.layers.Stack(
        lambda r: _block(mesh, r, zero=3), 2, mesh=mesh, rngs=rngs
    ),
    "stack_prefetch": lambda mesh, rngs: sf.layers.Stack(
        lambda r: _block(mesh, r, zero=3), 2, mesh=mesh, prefetch=True, rngs=rngs
    ),
}


# the one-device reference of a layer that refuses a mesh without fsdp (same parameters)
REFERENCES = {"stack_prefetch": LAYERS["stack"]}


def _mesh(shape, axis_type):
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, ("data", "fsdp"), axis_types=(axis_type,) * 2, devices=devices)


def _forward_and_grad(layer, x, cotangent, jit: bool):
    """`layer(x)` and its vjp with `cotangent` (parameter gradients as a pure dict, dx)."""

    def run(layer, x, cotangent):
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        apply = lambda params, x: nnx.merge(graphdef, params, rest)(x)  # noqa: E731
        y, vjp = jax.vjp(apply, params, x)
        param_grads, x_grad = vjp(cotangent)
        return y, nnx.to_pure_dict(param_grads), x_grad

    return (nnx.jit(run) if jit else run)(layer, x, cotangent)


def _inputs(mesh=None):
    """x and the output cotangent `[B, T, F]`, batch-sharded over (data, fsdp) on `mesh`."""
    key_x, key_c = jax.random.split(jax.random.key(2))
    x = jax.random.normal(key_x, (B, T, F), jnp.float32)
    cotangent = jax.random.normal(key_c, (B, T, F), jnp.float32)
    if mesh is None:
        return x, cotangent
    batch = NamedSharding(mesh, P(("data", "fsdp")))  # as the layers shard activations
    return jax.device_put(x, batch), jax.device_put(cotangent, batch)


@functools.cache
def _reference(name):
    """`(params, y, param_grads, dx)` of the layer built on one device from the same key.

    Parameter values depend on the key only, not on the mesh (`sharded_param`);
    the test checks that they are equal.
    """
    reference = REFERENCES.get(name, LAYERS[name])(_mesh((1, 1), AxisType.Auto), nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(reference, nnx.Param))
    with jax.default_matmul_precision("highest"):
        outputs = _forward_and_grad(reference, *_inputs(), jit=True)
    return jax.tree.map(np.asarray, (params, *outputs))


# The long cases (eager vjps of whole blocks and stacks: minutes on 2 cores) run with -m slow.
SLOW = {("block", "eager"), ("stack", "eager"), ("stack_prefetch", "eager")}
SLOW |= {("stack_prefetch", "auto", "jit")}


def _cases():
    for name in LAYERS:
        for axis_type, type_id in ((AxisType.Explicit, "explicit"), (AxisType.Auto, "auto")):
            for jit, mode in ((False, "eager"), (True, "jit")):
                slow = (name, mode) in SLOW or (name, type_id, mode) in SLOW
                yield pytest.param(
                    name,
                    axis_type,
                    jit,
                    id=f"{name}-{type_id}-{mode}",
                    marks=[pytest.mark.slow] if slow else [],
                )


@pytest.mark.parametrize("name, axis_type, jit", list(_cases()))
def test_fsdp_layer_matches_unsharded(name, axis_type, jit):
    mesh = _mesh((2, 4), axis_type)
    layer = LAYERS[name](mesh, nnx.Rngs(0))
    y, grads, x_grad = _forward_and_grad(layer, *_inputs(mesh), jit)
    params_ref, y_ref, grads_ref, x_grad_ref = _reference(name)
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), params_ref)

    assert np.isfinite(np.asarray(y_ref)).all()
    assert_close(np.asarray(y), np.asarray(y_ref), name=f"{name} output")
    assert_close(np.asarray(x_grad), np.asarray(x_grad_ref), kind="grad", name=f"{name} dx")
    assert_trees_close(grads, grads_ref, kind="grad", name=f"{name} grad")
    if axis_type == AxisType.Auto:
        return  # (Auto axes: where the gradients live is the compiler's choice)
    # Explicit axes: gradients come back typed like the parameters (ZeRO-3: over fsdp)
    params = dict(jax.tree_util.tree_leaves_with_path(params))
    for path, grad in jax.tree_util.tree_leaves_with_path(grads):
        sharding = params[path].sharding
        assert grad.sharding.is_equivalent_to(sharding, grad.ndim), (path, grad.sharding, sharding)
