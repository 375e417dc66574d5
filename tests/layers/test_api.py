"""Every layer in every calling mode, input rules, renamed keywords, one-compile training.

Modes: eager, `nnx.jit`, `jax.jit` over `nnx.split` / `nnx.merge`, and
`nnx.grad`, on meshes with Explicit and Auto axes, with and without
`jax.set_mesh`. Each returns the same values and the documented output
sharding (`out.sharding.spec`, trailing Nones aside).
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.testing import assert_close

AXES = ("data", "sequence", "model")


def make_mesh(kind, shape=(2, 2, 2), names=AXES):
    types = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(types,) * len(names))


# name -> (constructor(mesh, **kw), input features, output features, expected output spec)
LAYERS = {
    "column": (
        lambda mesh, **kw: sf.layers.ColumnParallelLinear(8, 16, mesh=mesh, rngs=nnx.Rngs(0), **kw),
        8,
        16,
        P("data", "sequence", "model"),
    ),
    "row": (
        lambda mesh, **kw: sf.layers.RowParallelLinear(16, 8, mesh=mesh, rngs=nnx.Rngs(0), **kw),
        16,
        8,
        P("data", "sequence", None),
    ),
    "mlp": (
        lambda mesh, **kw: sf.layers.ParallelMLP(
            8, 16, activation="swiglu", mesh=mesh, rngs=nnx.Rngs(0), **kw
        ),
        8,
        8,
        P("data", "sequence", None),
    ),
    # No "sequence" axis on the attention meshes below: the ring is tested elsewhere and
    # its compile time would dominate this matrix.
    "attention": (
        lambda mesh, **kw: sf.layers.ParallelSelfAttention(
            8, 2, num_kv_heads=1, mesh=mesh, rngs=nnx.Rngs(0), **kw
        ),
        8,
        8,
        P("data", None, None),
    ),
    "block": (
        lambda mesh, **kw: sf.layers.ParallelTransformerBlock(
            8, 2, 16, num_kv_heads=1, mesh=mesh, rngs=nnx.Rngs(0), **kw
        ),
        8,
        8,
        P("data", "model", None),
    ),
}


def layer_mesh(name, kind):
    if name in ("attention", "block"):
        return make_mesh(kind, (2, 2), ("data", "model"))
    return make_mesh(kind)


def spec_of(x):
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def call_in_mode(model, x, mode):
    if mode == "eager":
        return model(x)
    if mode == "nnx.jit":
        return nnx.jit(lambda m, x: m(x))(model, x)
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)


def _mode_cells():
    """Every layer x {Explicit, Auto} x {no set_mesh, set_mesh}. The default run keeps the
    linear layers and the MLP in every cell, attention and the block on the mesh
    jax.make_mesh gives without set_mesh (the README's pattern) and attention on an Auto
    mesh under set_mesh; the other cells run with -m slow."""
    cells = []
    for name in LAYERS:
        for kind in ("explicit", "auto"):
            for context in (False, True):
                default = (
                    name in ("column", "row", "mlp")
                    or (kind == "explicit" and not context)
                    or (name == "attention" and kind == "auto" and context)
                )
                cell = f"{name}-{kind}-{'set_mesh' if context else 'no-set_mesh'}"
                marks = () if default else (pytest.mark.slow,)
                cells.append(pytest.param(name, kind, context, id=cell, marks=marks))
    return cells


@pytest.mark.parametrize("name, kind, context", _mode_cells())
def test_every_mode_same_values_and_documented_sharding(name, kind, context):
    make, fin, fout, expected = LAYERS[name]
    mesh = layer_mesh(name, kind)
    model = make(mesh)
    x = jax.random.normal(jax.random.key(1), (4, 8, fin))
    with jax.set_mesh(mesh) if context else contextlib.nullcontext():
        outputs = {mode: call_in_mode(model, x, mode) for mode in ("eager", "nnx.jit", "jax.jit")}

        def loss(m):
            return jnp.mean(m(x) ** 2)

        # Eager grad of a scalar computed from Explicit-sharded arrays needs a mesh
        # context (jax creates the cotangent on one device otherwise): jit it without one.
        grad = nnx.grad(loss) if context or kind == "auto" else nnx.jit(nnx.grad(loss))
        grads = grad(model)
        jit_grads = nnx.jit(nnx.grad(loss))(model)
    for mode, y in outputs.items():
        assert y.shape == (4, 8, fout), mode
        assert spec_of(y) == tuple(expected), (mode, y.sharding)
        assert_close(np.asarray(y), np.asarray(outputs["eager"]), name=mode)
    params = nnx.state(model, nnx.Param)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.all(np.isfinite(np.asarray(g))), path
    assert_close_trees(grads, jit_grads)
    param_specs = nnx.get_partition_spec(params)
    for (path, g), spec in zip(
        jax.tree_util.tree_leaves_with_path(jit_grads), jax.tree.leaves(param_specs), strict=True
    ):
        if kind == "explicit":  # gradients keep the parameter's sharding
            assert spec_of(g) == tuple(spec) + (None,) * (g.ndim - len(spec)), path


def assert_close_trees(a, b):
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True
    ):
        assert_close(np.asarray(x), np.asarray(y), kind="grad", name=jax.tree_util.keystr(path))


def test_block_three_axis_mesh_eager_matches_jit():
    mesh = make_mesh("explicit")
    block = sf.layers.ParallelTransformerBlock(
        8, 2, 16, num_kv_heads=1, mesh=mesh, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (2, 8, 8))
    eager = block(x)
    jitted = nnx.jit(lambda m, x: m(x))(block, x)
    assert eager.sharding.spec == P("data", ("sequence", "model"), None)
    assert jitted.sharding.spec == P("data", ("sequence", "model"), None)
    assert_close(np.asarray(eager), np.asarray(jitted), name="eager vs nnx.jit")


def count_compiles():
    """A list that grows by one entry per backend compilation while registered."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return events, listener


def test_eager_calls_reuse_one_compiled_program():
    mesh = make_mesh("explicit")
    make, fin, _, _ = LAYERS["mlp"]
    layer, other = make(mesh), make(mesh)  # same configuration: one program
    x, x2 = jnp.ones((4, 8, fin)), jnp.full((4, 8, fin), 2.0, jnp.float32)
    jax.block_until_ready(layer(x))
    events, listener = count_compiles()
    try:
        jax.block_until_ready(layer(x))
        jax.block_until_ready(other(x2))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == [], f"{len(events)} compilations on repeated eager calls"


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_training_step_compiles_once(kind):
    mesh = make_mesh(kind)
    model = sf.layers.ParallelMLP(8, 16, mesh=mesh, sequence_parallel=True, rngs=nnx.Rngs(0))
    optimizer = sf.layers.place_on_mesh(
        nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param), mesh
    )

    @nnx.jit
    def train_step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (4, 8, 8))
    losses = [float(train_step(model, optimizer, x))]
    events, listener = count_compiles()
    try:
        losses += [float(train_step(model, optimizer, x)) for _ in range(2)]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert events == [], f"steps 2 and 3 compiled {len(events)} times"
    assert losses[-1] < losses[0], losses
    assert int(optimizer.step[...]) == 3


@pytest.mark.parametrize("name", list(LAYERS))
def test_empty_batch_gives_empty_output(name):
    make, fin, fout, expected = LAYERS[name]
    mesh = layer_mesh(name, "explicit")
    model = make(mesh)
    x = jnp.zeros((0, 8, fin))
    for y in (model(x), nnx.jit(lambda m, x: m(x))(model, x)):
        assert y.shape == (0, 8, fout)
        assert spec_of(y) == tuple(expected)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize("name", list(LAYERS))
def test_integer_or_bool_input_raises_type_error(name, dtype):
    make, fin, _, _ = LAYERS[name]
    model = make(layer_mesh(name, "auto"))
    x = jnp.zeros((2, 8, fin), dtype)
    with pytest.raises(TypeError, match=rf"x has dtype {jnp.dtype(dtype).name}; expected float"):
        model(x)


def test_norm_rules():
    mesh = make_mesh("auto")
    with pytest.raises(ValueError, match=r"kind='batchnorm' must be one of"):
        sf.layers.Norm(8, kind="batchnorm", mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"norm='batchnorm' must be one of"):
        sf.layers.ParallelTransformerBlock(8, 2, 16, norm="batchnorm", mesh=mesh, rngs=nnx.Rngs(0))
    norm = sf.layers.Norm(8, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"x has dtype int32"):
        norm(jnp.zeros((2, 8), jnp.int32))
    assert norm(jnp.zeros((0, 8))).shape == (0, 8)


@pytest.mark.parametrize(
    "make, old, new, attribute",
    [
        (
            lambda m, **kw: sf.layers.ColumnParallelLinear(8, 16, mesh=m, rngs=nnx.Rngs(0), **kw),
            "axis",
            "model_axis",
            "model_axis",
        ),
        (
            lambda m, **kw: sf.layers.RowParallelLinear(16, 8, mesh=m, rngs=nnx.Rngs(0), **kw),
            "axis",
            "model_axis",
            "model_axis",
        ),
        (
            lambda m, **kw: sf.layers.ParallelMLP(8, 16, mesh=m, rngs=nnx.Rngs(0), **kw),
            "axis",
            "model_axis",
            None,
        ),
        (
            lambda m, **kw: sf.layers.ParallelSelfAttention(8, 2, mesh=m, rngs=nnx.Rngs(0), **kw),
            "tp_axis",
            "model_axis",
            "model_axis",
        ),
        (
            lambda m, **kw: sf.layers.ParallelSelfAttention(8, 2, mesh=m, rngs=nnx.Rngs(0), **kw),
            "cp_axis",
            "sequence_axis",
            "sequence_axis",
        ),
        (
            lambda m, **kw: sf.layers.ParallelTransformerBlock(
                8, 2, 16, mesh=m, rngs=nnx.Rngs(0), **kw
            ),
            "tp_axis",
            "model_axis",
            None,
        ),
        (
            lambda m, **kw: sf.layers.ParallelTransformerBlock(
                8, 2, 16, mesh=m, rngs=nnx.Rngs(0), **kw
            ),
            "cp_axis",
            "sequence_axis",
            None,
        ),
    ],
)
def test_deprecated_keywords_warn_and_still_work(make, old, new, attribute):
    mesh = make_mesh("auto", (2, 2), ("sequence", "model"))
    value = "model" if new == "model_axis" else "sequence"
    with pytest.warns(DeprecationWarning, match=rf"\({old}=\.\.\.\) is deprecated .* use {new}="):
        layer = make(mesh, **{old: value})
    if attribute is not None:
        assert getattr(layer, attribute) == value
    with pytest.raises(TypeError, match=rf"got both {old}= \(deprecated\) and {new}="):
        make(mesh, **{old: value, new: value})


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_row_input_is_parallel_both_ways(kind):
    mesh = make_mesh(kind)
    layers = {
        flag: sf.layers.RowParallelLinear(
            16, 8, mesh=mesh, input_is_parallel=flag, rngs=nnx.Rngs(0)
        )
        for flag in (True, False)
    }
    assert layers[True].input_spec() == P("data", "sequence", "model")
    assert layers[False].input_spec() == P("data", "sequence", None)
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    kernel, bias = layers[True].kernel[...], layers[True].bias[...]
    expected = np.asarray(
        jnp.einsum("btm,mn->btn", x, kernel, precision=jax.lax.Precision.HIGHEST) + bias
    )
    for flag, layer in layers.items():
        y = layer(x)
        assert spec_of(y) == ("data", "sequence", None)
        assert_close(np.asarray(y), expected, name=f"input_is_parallel={flag}")
        grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))(layer)
        assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    grad_x = {
        flag: jax.jit(jax.grad(lambda x, layer=layer: jnp.mean(layer(x) ** 2)))(x)
        for flag, layer in layers.items()
    }
    assert_close(np.asarray(grad_x[False]), np.asarray(grad_x[True]), kind="grad", name="dx")
