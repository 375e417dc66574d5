"""`sf.layers.LayerOptions`: validation, keywords vs `options=`, overrides, composites.

- The options object validates every field (the error names the field and
  what is valid) and `.replace` validates like the constructor.
- Every layer built through its keywords and through `options=` is the same
  layer: the same configuration (`nnx.graphdef`), parameters, parameter
  shardings, outputs and gradients, over option combinations drawn from the
  option space (fixed seed; a small budget here, more under `-m slow`), on
  Explicit and Auto meshes. In float32 both also match the unsharded
  reference (`shardfuse.layers.reference`), and each parameter has the spec
  the options imply, derived here independently of the layers' code.
- A layer's own keyword wins over the options it is given.
- A composite layer hands its options to its children (a block built with
  `zero=3` has fsdp-sharded kernels and norms), and the checker of that
  catches a planted bug (children built without the options).
"""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import options as options_lib
from shardfuse.layers import reference
from shardfuse.testing import assert_close

LayerOptions = sf.layers.LayerOptions


def make_mesh(kind, shape=(2, 2, 2), names=("data", "fsdp", "model")):
    types = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(types,) * len(names))


# ---- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, error, match",
    [
        ("zero", 4, ValueError, r"zero=4 must be one of \(0, 1, 2, 3\)"),
        ("zero", True, ValueError, "zero=True must be one of"),
        ("model_axis", 3, ValueError, "model_axis=3 must be a mesh axis name"),
        ("fsdp_axis", "", ValueError, "fsdp_axis='' must be a mesh axis name"),
        ("remat", "some", ValueError, "remat='some' is not a remat policy; valid: .*selective"),
        ("dtype", jnp.int32, ValueError, "dtype=.*int32.* must be a floating dtype"),
        ("param_dtype", None, ValueError, "param_dtype=None must be a floating dtype"),
        ("reduce_dtype", "int8", ValueError, "reduce_dtype='int8' must be a floating dtype"),
        ("precision", "bogus", ValueError, "precision='bogus' must be None, a jax.lax"),
        ("implementation", "cuda", ValueError, r"implementation='cuda' must be None .*'xla'"),
        ("implementation", [], ValueError, r"implementation=\[\] must be None"),
        ("attention_implementation", "x", ValueError, "attention_implementation='x' must be"),
        ("reshard_after_forward", 1, TypeError, "reshard_after_forward=1 must be True or False"),
        ("prefetch", "yes", ValueError, "prefetch='yes' must be True or False"),
        ("sequence_parallel", "yes", TypeError, "sequence_parallel='yes' must be True, False"),
        ("mesh", "data", TypeError, "mesh='data' must be a jax.sharding.Mesh"),
    ],
)
def test_invalid_fields_name_the_field_and_what_is_valid(field, value, error, match):
    with pytest.raises(error, match=match):
        LayerOptions(**{field: value})
    with pytest.raises(error, match=match):  # .replace validates alike
        LayerOptions().replace(**{field: value})


def test_two_fields_naming_one_axis_are_refused():
    with pytest.raises(
        ValueError, match="model_axis='x' and data_axis='x' name the same mesh axis"
    ):
        LayerOptions(model_axis="x", data_axis="x")
    assert LayerOptions(model_axis=None, data_axis=None).model_axis is None  # None twice: fine


def test_values_are_normalized_frozen_and_hashable():
    options = LayerOptions(dtype="bfloat16", precision="highest", implementation=["xla"])
    assert options.dtype == jnp.dtype(jnp.bfloat16)
    assert options.precision == lax.Precision.HIGHEST
    assert options.implementation == ("xla",)
    assert options.attention_kernel_implementation() == ("xla",)
    assert options.replace(
        attention_implementation="reference"
    ).attention_kernel_implementation() == ("reference")
    assert hash(options) == hash(LayerOptions(dtype=jnp.bfloat16, precision=lax.Precision.HIGHEST,
                                              implementation=("xla",)))  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.zero = 3
    defaults = LayerOptions()
    assert (
        defaults.model_axis,
        defaults.data_axis,
        defaults.sequence_axis,
        defaults.fsdp_axis,
    ) == (
        sf.axes.MODEL,
        sf.axes.DATA,
        sf.axes.SEQUENCE,
        sf.axes.FSDP,
    )


def test_replace_refuses_unknown_fields_and_keeps_the_rest():
    options = LayerOptions(zero=3, remat="full")
    with pytest.raises(TypeError, match="LayerOptions has no field zero_stage; its fields are"):
        options.replace(zero_stage=2)
    changed = options.replace(fsdp_axis="dp")
    assert (changed.zero, changed.remat, changed.fsdp_axis) == (3, "full", "dp")
    assert options.fsdp_axis == "fsdp"  # the original is untouched


def test_resolve_not_given_differs_from_none():
    base = LayerOptions(model_axis="tp", zero=2)
    resolved = options_lib.resolve(base, model_axis=None, zero=options_lib.UNSET)
    assert (resolved.model_axis, resolved.zero) == (None, 2)
    assert options_lib.resolve(None) == LayerOptions()
    assert options_lib.resolve(base) is base
    with pytest.raises(TypeError, match="options=.* must be a shardfuse.layers.LayerOptions"):
        options_lib.resolve({"zero": 3})


def test_layers_need_a_mesh_and_refuse_unknown_keywords():
    with pytest.raises(TypeError, match=r"ColumnParallelLinear\(\) needs a mesh: pass mesh="):
        sf.layers.ColumnParallelLinear(4, 8, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"Stack\(\) needs a mesh"):
        sf.layers.Stack(lambda rngs: None, 2, rngs=nnx.Rngs(0))
    mesh = make_mesh("explicit")
    with pytest.raises(TypeError, match="zero_stage"):
        sf.layers.ColumnParallelLinear(4, 8, mesh=mesh, zero_stage=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="zero=5 must be one of"):
        sf.layers.ParallelMLP(4, 8, mesh=mesh, zero=5, rngs=nnx.Rngs(0))
    # an explicitly named axis must be in the mesh (checked when the layer is built)
    with pytest.raises(
        ValueError, match="model_axis='tp' is not an axis of the mesh; its axes are"
    ):
        sf.layers.ColumnParallelLinear(4, 8, options=LayerOptions(mesh=mesh, model_axis="tp"),
                                       rngs=nnx.Rngs(0))  # fmt: skip


def test_signature_lists_the_option_keywords():
    import inspect

    for layer in (sf.layers.ColumnParallelLinear, sf.layers.ParallelTransformerBlock,
                  sf.layers.Stack):  # fmt: skip
        parameters = inspect.signature(layer.__init__).parameters
        for field in options_lib.FIELDS:
            assert parameters[field].default is options_lib.UNSET, (layer, field)
        assert parameters["options"].default is None


def test_block_takes_the_attention_keywords_of_its_attention():
    """The block lists ParallelSelfAttention's keywords (one home for their defaults) and
    hands them on unread; a keyword neither takes fails naming the block."""
    import inspect

    from shardfuse.layers import block as block_lib

    attention = inspect.signature(sf.layers.ParallelSelfAttention.__init__).parameters
    block = inspect.signature(sf.layers.ParallelTransformerBlock.__init__).parameters
    for name in block_lib.ATTENTION_KEYWORDS:
        assert block[name] == attention[name], name
    assert not any(p.kind is p.VAR_KEYWORD for p in block.values())
    mesh = make_mesh("explicit", (2,), ("model",))
    made = sf.layers.ParallelTransformerBlock(
        8, 2, 16, mesh=mesh, num_kv_heads=1, causal=False, window=(3, None), qkv_bias=True,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    got = made.attention
    assert (got.num_kv_heads, got.causal, got.window, got.qkv_bias) == (1, False, (3, None), True)
    with pytest.raises(TypeError, match=r"ParallelTransformerBlock\(\) got an unexpected "
                       r"keyword argument 'num_kv_head'"):  # fmt: skip
        sf.layers.ParallelTransformerBlock(8, 2, 16, mesh=mesh, num_kv_head=1, rngs=nnx.Rngs(0))


def test_deprecated_keyword_spellings_still_work():
    mesh = make_mesh("explicit", (2,), ("tp",))
    with pytest.warns(DeprecationWarning, match="use model_axis="):
        layer = sf.layers.ColumnParallelLinear(4, 8, mesh=mesh, axis="tp", rngs=nnx.Rngs(0))
    assert layer.model_axis == "tp" and layer.kernel[...].sharding.spec == P(None, "tp")
    with pytest.warns(DeprecationWarning, match="use model_axis="):
        block = sf.layers.ParallelTransformerBlock(8, 2, 16, mesh=mesh, tp_axis="tp",
                                                   rngs=nnx.Rngs(0))  # fmt: skip
    assert block.mlp.down.kernel[...].sharding.spec == P("tp", None)


# ---- the same layer through keywords and through options= ------------------------------------

# name -> (constructor(**kw), input features)
LAYERS = {
    "column": (lambda **kw: sf.layers.ColumnParallelLinear(8, 16, **kw), 8),
    "row": (lambda **kw: sf.layers.RowParallelLinear(16, 8, input_is_parallel=False, **kw), 16),
    "mlp": (lambda **kw: sf.layers.ParallelMLP(8, 16, activation="swiglu", **kw), 8),
    "attention": (lambda **kw: sf.layers.ParallelSelfAttention(8, 2, num_kv_heads=2, **kw), 8),
    "block": (lambda **kw: sf.layers.ParallelTransformerBlock(8, 2, 16, num_kv_heads=2, **kw), 8),
    "norm": (lambda **kw: sf.layers.Norm(8, kind="layernorm", **kw), 8),
}

# the option space the combinations are drawn from (meshes: data x fsdp x model, 2 x 2 x 2)
SPACE = dict(
    model_axis=["model", None],
    zero=[0, 1, 3],
    reshard_after_forward=[True, False],
    sequence_parallel=[None, True, False],
    dtype=[None, jnp.bfloat16],
    precision=[None, "highest"],
    implementation=[None, "xla"],
    remat=["none", "full", "selective"],
)


def draw_options(rng: random.Random) -> dict:
    fields = {name: rng.choice(values) for name, values in SPACE.items()}
    if fields["model_axis"] is None:  # sequence parallelism needs a model axis
        fields["sequence_parallel"] = rng.choice([None, False])
    return fields


def _cases(count: int, seed: int, *, slow: bool = False):
    """`count` drawn option combinations per layer, Explicit and Auto meshes in turn."""
    rng = random.Random(seed)
    cases = []
    for name in LAYERS:
        for index in range(count):
            kind = ("explicit", "auto")[len(cases) % 2]
            marks = (pytest.mark.slow,) if slow else ()
            fields = draw_options(rng)
            cases.append(pytest.param(name, kind, fields, id=f"{name}-{kind}-{index}", marks=marks))
    return cases


def _params(layer):
    return jax.tree.map(lambda v: v[...], nnx.state(layer, nnx.Param), is_leaf=_is_variable)


def _is_variable(x):
    return isinstance(x, nnx.Variable)


def _loss(graphdef, state, x, cotangent):
    y = nnx.merge(graphdef, state)(x)
    # a sum, not jnp.vdot: vdot flattens y, a reshape an Explicit mesh refuses when y is
    # sharded over two dims (column with sequence parallelism and ZeRO-3)
    return jnp.sum(y.astype(jnp.float32) * cotangent), y


_value_and_grad = jax.jit(jax.value_and_grad(_loss, argnums=(1, 2), has_aux=True), static_argnums=0)


def run(layer, x, cotangent):
    """`(output, loss, (parameter gradients, input gradient))` of `layer` under one jit."""
    graphdef, state = nnx.split(layer)
    (loss, y), grads = _value_and_grad(graphdef, state, x, cotangent)
    return y, loss, grads


def expected_spec(name, key, options: LayerOptions, mesh):
    """The documented spec of parameter `key` (a path) under `options`, derived here."""
    model = options.model_axis if options.model_axis in mesh.axis_names else None
    fsdp = options.fsdp_axis if options.zero == 3 and options.fsdp_axis in mesh.axis_names else None
    column = {"kernel": P(fsdp, model), "bias": P(model)}  # kernel [in, out] split by columns
    row = {"kernel": P(model, fsdp), "bias": P()}  # split by rows
    owner, leaf = (key[-2] if len(key) > 1 else name), key[-1]
    if owner in ("column", "up"):
        return column[leaf]
    if owner in ("row", "down"):
        return row[leaf]
    if leaf in ("q_kernel", "kv_kernel"):  # kv heads (2) divisible by the model axis (2)
        return column["kernel"]
    if leaf == "o_kernel":
        return row["kernel"]
    if owner in ("norm", "norm_1", "norm_2"):
        return P(fsdp)
    raise AssertionError(f"no expected spec for {key}")


def _canonical(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def check_equivalent(name, kind, fields):
    make, features = LAYERS[name]
    mesh = make_mesh(kind)
    options = LayerOptions(mesh=mesh, **fields)
    by_keywords = make(mesh=mesh, rngs=nnx.Rngs(0), **fields)
    by_options = make(options=options, rngs=nnx.Rngs(0))
    # one configuration: one compiled program serves both
    assert nnx.graphdef(by_keywords) == nnx.graphdef(by_options)
    params_k, params_o = _params(by_keywords), _params(by_options)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params_k),
                            jax.tree.leaves(params_o), strict=True):  # fmt: skip
        key = tuple(getattr(p, "key", p) for p in path)
        assert a.sharding == b.sharding, key
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(key))
        expected = expected_spec(name, key, options, mesh)
        assert _canonical(a.sharding.spec, a.ndim) == _canonical(expected, a.ndim), (key, a)
    x = jax.random.normal(jax.random.key(1), (4, 8, features), jnp.float32)
    out_features = 16 if name == "column" else 8
    cotangent = jax.random.normal(jax.random.key(2), (4, 8, out_features), jnp.float32)
    y_k, loss_k, grads_k = run(by_keywords, x, cotangent)
    y_o, loss_o, grads_o = run(by_options, x, cotangent)
    assert y_k.sharding == y_o.sharding
    np.testing.assert_array_equal(np.asarray(y_k), np.asarray(y_o))
    np.testing.assert_array_equal(np.asarray(loss_k), np.asarray(loss_o))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_k),
                            jax.tree.leaves(grads_o), strict=True):  # fmt: skip
        assert np.all(np.isfinite(np.asarray(a))), path
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    if fields["dtype"] is None and name != "norm":  # float32: the unsharded reference too
        p = reference.params(by_options)
        oracle = {
            "column": reference.linear,
            "row": reference.linear,
            "mlp": reference.mlp,
            "attention": reference.self_attention,
            "block": reference.transformer_block,
        }[name]
        x1, c1 = (jax.device_put(np.asarray(a), jax.devices()[0]) for a in (x, cotangent))

        def ref_loss(p):
            y = oracle(by_options, p, x1)
            return jnp.vdot(y, c1), y

        (_, ref), ref_grad = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(p)
        assert_close(np.asarray(y_o), np.asarray(ref), name=f"{name} vs reference")
        ours = nnx.to_pure_dict(grads_o[0])
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours),
                                jax.tree.leaves(ref_grad), strict=True):  # fmt: skip
            assert_close(np.asarray(a), np.asarray(b), kind="grad", name=f"{name} grad {path}")


@pytest.mark.parametrize("name, kind, fields", _cases(1, seed=0), ids=str)
def test_keywords_and_options_build_the_same_layer(name, kind, fields):
    check_equivalent(name, kind, fields)


@pytest.mark.slow
@pytest.mark.parametrize("name, kind, fields", _cases(2, seed=1), ids=str)
def test_keywords_and_options_build_the_same_layer_more_combinations(name, kind, fields):
    check_equivalent(name, kind, fields)


# ---- overrides and composites ---------------------------------------------------------------


def test_a_layer_keyword_wins_over_the_options():
    mesh = make_mesh("explicit")
    options = LayerOptions(mesh=mesh, zero=3, dtype=jnp.bfloat16)
    layer = sf.layers.ColumnParallelLinear(8, 16, options=options, zero=0, model_axis=None,
                                           rngs=nnx.Rngs(0))  # fmt: skip
    assert layer.kernel[...].sharding.spec == P()
    assert layer.dtype == jnp.bfloat16  # the fields not overridden come from the options
    assert layer.options == options.replace(zero=0, model_axis=None, sequence_parallel=False)
    mlp = sf.layers.ParallelMLP(8, 16, options=options, sequence_parallel=True, rngs=nnx.Rngs(0))
    assert mlp.up.sequence_parallel and mlp.down.sequence_parallel
    assert mlp.io_spec() == P(("data", "fsdp"), "model", None)
    # None overrides too: the block's default sequence parallelism comes back with None
    block = sf.layers.ParallelTransformerBlock(8, 2, 16, options=options.replace(
        sequence_parallel=False), sequence_parallel=None, rngs=nnx.Rngs(0))  # fmt: skip
    assert block.attention.sequence_parallel and block.mlp.up.sequence_parallel


def _children_follow(block, options: LayerOptions):
    """Every option-taking module inside `block` got `options` (up to sequence parallelism)."""
    expected = options.replace(sequence_parallel=None)
    checked = 0
    for path, node in nnx.iter_graph(block):
        got = getattr(node, "options", None)
        if isinstance(got, LayerOptions):
            assert got.replace(sequence_parallel=None) == expected, (path, got)
            checked += 1
    assert checked >= 7, checked  # block, attention, mlp, up, down, 2 norms
    specs = nnx.get_partition_spec(nnx.state(block, nnx.Param))
    fsdp = options.fsdp_axis if options.zero == 3 else None
    for path, spec in jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda s: isinstance(s, P)
    ):
        if "kernel" in jax.tree_util.keystr(path) or fsdp is not None:
            assert (fsdp in jax.tree.leaves(tuple(spec))) == (fsdp is not None), (path, spec)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_block_hands_its_options_to_its_children(kind):
    mesh = make_mesh(kind)
    options = LayerOptions(mesh=mesh, zero=3, fsdp_axis="fsdp", param_dtype=jnp.bfloat16,
                           reshard_after_forward=False, remat="selective")  # fmt: skip
    block = sf.layers.ParallelTransformerBlock(8, 2, 16, options=options, rngs=nnx.Rngs(0))
    _children_follow(block, options)
    assert block.mlp.up.kernel[...].sharding.spec == P("fsdp", "model")
    assert block.attention.o_kernel[...].sharding.spec == P("model", "fsdp")
    assert block.norm_1.scale[...].sharding.spec == P("fsdp")
    assert block.mlp.down.zero.reshard_after_forward is False and block.remat == "selective"
    dtypes = {v.dtype for v in jax.tree.leaves(nnx.state(block, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    stack = sf.layers.Stack(lambda rngs: sf.layers.ParallelTransformerBlock(
        8, 2, 16, options=options.replace(remat="none"), rngs=rngs), 2, options=options,
        rngs=nnx.Rngs(0))  # fmt: skip
    assert stack.remat == "selective" and stack.mesh is mesh
    assert stack.blocks.mlp.up.kernel[...].sharding.spec == P(None, "fsdp", "model")


def test_the_children_check_catches_a_planted_bug(monkeypatch):
    mesh = make_mesh("explicit")
    options = LayerOptions(mesh=mesh, zero=3)
    real = options_lib.with_default_sequence_parallel

    def drop_options(options, default):  # planted: a composite's children built from defaults
        return real(LayerOptions(mesh=options.mesh), default)

    monkeypatch.setattr(options_lib, "with_default_sequence_parallel", drop_options)
    block = sf.layers.ParallelTransformerBlock(8, 2, 16, options=options, rngs=nnx.Rngs(0))
    with pytest.raises(AssertionError):
        _children_follow(block, options)


def test_mesh_axes_and_zero_options_resolve_on_the_mesh():
    mesh = make_mesh("explicit")  # data x fsdp x model
    options = LayerOptions(mesh=mesh, zero=3)
    assert options.mesh_axes() == dict(model_axis="model", data_axis="data", sequence_axis=None,
                                       fsdp_axis="fsdp", expert_axis=None)  # fmt: skip
    assert options.zero_options().param_axis == "fsdp"
    assert options.replace(zero=2).zero_options().param_axis is None
    no_fsdp = options.replace(mesh=make_mesh("auto", (2, 4), ("data", "model")))
    assert no_fsdp.mesh_axes()["fsdp_axis"] is None and no_fsdp.zero_options().param_axis is None
    with pytest.raises(ValueError, match="sequence_axis='ring' is not an axis of the mesh"):
        options.replace(sequence_axis="ring").mesh_axes()
    with pytest.raises(TypeError, match="needs a mesh"):
        LayerOptions().mesh_axes()


def test_the_model_takes_one_options_object():
    mesh = make_mesh("explicit")  # data x fsdp x model
    spec = sf.models.ModelSpec.tiny(num_layers=2)
    options = LayerOptions(mesh=mesh, zero=3, remat="selective", param_dtype=jnp.float32)
    by_options = sf.models.Transformer(spec, options=options, rngs=nnx.Rngs(0))
    by_keywords = sf.models.Transformer(spec, mesh=mesh, zero=3, remat="selective",
                                        rngs=nnx.Rngs(0))  # fmt: skip
    assert nnx.graphdef(by_options) == nnx.graphdef(by_keywords)
    assert by_options.blocks.remat == "selective"  # the stack applies remat per layer ...
    assert by_options.blocks.blocks.remat == "none"  # ... and the blocks none (not twice)
    assert by_options.blocks.blocks.attention.sequence_parallel  # the model's default
    assert by_options.embed[...].sharding.spec == P("fsdp", None)  # zero=3: the table too
    assert by_options.blocks.blocks.mlp.up.kernel[...].sharding.spec == P(None, "fsdp", "model")
    assert by_options.head.unembed.kernel[...].sharding.spec == P("fsdp", "model")
    scale = by_options.head.norm.scale[...]
    assert _canonical(scale.sharding.spec, 1) == (None,)  # the final norm stays replicated
