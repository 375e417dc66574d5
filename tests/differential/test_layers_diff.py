"""Generated differential test of the parallel layers against their unsharded references.

Hypothesis draws a layer (`ColumnParallelLinear`, `RowParallelLinear`, `ParallelMLP`,
`ParallelSelfAttention`, `ParallelTransformerBlock`, `Norm`, `Stack`), every option that
changes its computation (ZeRO stage, fsdp axis, reshard after forward, reduce dtype,
sequence parallelism, axes switched off, compute dtype, implementation, precision, biases,
gathered/parallel inputs and outputs, GQA/MQA, head dim, causal, window, softcap, ring
layout, RoPE base, segment ids and RoPE positions, norm kind, activation, remat policy,
Stack's layer axis and prefetch), a mesh of 1-3 of the axes data, fsdp, sequence, model
(pipeline for Stack) with Explicit or Auto axis types, and eager or `nnx.jit`
(`strategies_model.layer_cases`).

Oracle: `shardfuse.layers.reference` on the same parameters, unsharded on one device
(a Stack: the reference block looped over the layers). Compared: the output, the input
gradient and EVERY parameter gradient leaf of `sum(y * cotangent)` with a random
cotangent, float32 at rtol 1e-5 / atol 4e-5 (TESTING.md, the toolkit rule); bfloat16
compute by the flash-attention rule (`shardfuse.testing.assert_close_low_precision`: within
2x (outputs) / 3x (gradients) the bfloat16 reference's own error plus a floor, capped at
1e-2 / 5e-2 of the magnitude). The output's sharding is the layer's documented spec and each
gradient leaf is sharded like its parameter. A drawn refusal must raise ValueError/TypeError
naming the argument.
"""

import contextlib
import functools
import re
from collections import Counter

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import reference
from shardfuse.layers.stack import Stack
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.differential.budget import assert_catches, budget_params, run, settings
from tests.differential.strategies_model import LAYER_KINDS, LayerCase, layer_cases

RTOL, ATOL = 1e-5, 4e-5
STATS = Counter()  # drawn / refused per kind (read by the report, printed with -s)


def make_mesh(case):
    names = tuple(a for a, _ in case.mesh)
    shape = tuple(s for _, s in case.mesh)
    types = (AxisType.Explicit if case.explicit else AxisType.Auto,) * len(names)
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)


def _layer_kwargs(options: dict) -> dict:
    kwargs = dict(options)
    for name in ("dtype", "reduce_dtype"):
        if kwargs.get(name) is not None:
            kwargs[name] = jnp.dtype(kwargs[name])
    return kwargs


def build_layer(kind, options: dict, features: int, mesh, rngs):
    """The layer `kind` with `options`; biases drawn N(0, 0.5) so that they matter."""
    o = _layer_kwargs(options)
    if kind == "norm":
        return sf.layers.Norm(features, mesh=mesh, rngs=rngs, **o)
    o["bias_init"] = nnx.initializers.normal(0.5)
    if kind == "column":
        return sf.layers.ColumnParallelLinear(
            features, o.pop("out_features"), mesh=mesh, rngs=rngs, **o
        )
    if kind == "row":
        return sf.layers.RowParallelLinear(
            features, o.pop("out_features"), mesh=mesh, rngs=rngs, **o
        )
    if kind == "mlp":
        return sf.layers.ParallelMLP(features, o.pop("hidden_features"), mesh=mesh, rngs=rngs, **o)
    if kind == "attention":
        return sf.layers.ParallelSelfAttention(
            features, o.pop("num_heads"), mesh=mesh, rngs=rngs, **o
        )
    if kind == "block":
        return sf.layers.ParallelTransformerBlock(
            features, o.pop("num_heads"), o.pop("hidden_features"), mesh=mesh, rngs=rngs, **o
        )
    raise AssertionError(kind)


def build(case: LayerCase, mesh):
    features = case.shape[-1]
    options = dict(case.options)
    if case.kind != "stack":
        return build_layer(case.kind, options, features, mesh, nnx.Rngs(0))
    make = functools.partial(build_layer, case.block, options, features, mesh)
    return Stack(make, mesh=mesh, rngs=nnx.Rngs(0), **dict(case.stack))


def _ring(layer, mesh):
    """The ring size and layout the layer lays its sequence out in (None: natural order)."""
    attention = getattr(layer, "attention", layer)
    if not hasattr(attention, "layout") or attention.sequence_axis is None:
        return None, None
    return mesh.shape[attention.sequence_axis], attention.layout


def _reference_fn(case: LayerCase, layer):
    """`ref(params, x, dtype=None, **call) -> y`: the unsharded oracle of `layer`."""
    fns = dict(
        column=reference.linear,
        row=reference.linear,
        mlp=reference.mlp,
        attention=reference.self_attention,
        block=reference.transformer_block,
        norm=lambda layer, p, x, dtype=None: reference.norm(layer, p, x),
    )
    if case.kind != "stack":
        return functools.partial(fns[case.kind], layer)
    inner = fns[case.block]

    def stacked(p, x, dtype=None, **call):
        blocks = p["blocks"]
        for i in range(layer.num_layers):
            p_i = jax.tree.map(lambda a, i=i: a[i], blocks)
            x = inner(layer.blocks, p_i, x, dtype=dtype, **call)
        return x

    return stacked


def _expected_spec(case: LayerCase, layer, input_spec):
    if case.kind == "norm":
        return input_spec
    if case.kind == "stack":
        return layer.blocks.io_spec()
    if case.kind in ("column", "row"):
        return layer.output_spec()
    return layer.io_spec()


def _inputs(case: LayerCase, layer, mesh):
    """Natural-order x, the call's and the reference's keywords, ring conversions."""
    B, T, F = case.shape
    x = jax.random.normal(jax.random.key(1), (B, T, F), jnp.float32)
    ring, layout = _ring(layer if case.kind != "stack" else layer.blocks, mesh)
    to_ring = (lambda a: sf.to_ring_layout(a, ring, layout)) if ring else (lambda a: a)
    from_ring = (lambda a: sf.from_ring_layout(a, ring, layout)) if ring else (lambda a: a)
    segments, positions = case.call
    call, ref = {}, {}
    if segments:
        seg = jnp.sort(jax.random.randint(jax.random.key(2), (B, T), 0, 3), axis=1)
        call["segment_ids"], ref["segment_ids"] = to_ring(seg.astype(jnp.int32)), seg
    if positions:
        pos = (jnp.arange(T, dtype=jnp.int32) % 5) * 3  # restarts, as in packed sequences
        call["positions"], ref["positions"] = to_ring(pos[None])[0], pos
    return x, call, ref, to_ring, from_ring


def _place_input(case, x, mesh):
    """The norm's input is placed on `P(data)` (it keeps the input's sharding); the others
    get a plain array and place it themselves."""
    if case.kind != "norm":
        return x, None
    spec = P("data") if "data" in mesh.axis_names else P()
    return jax.device_put(x, NamedSharding(mesh, spec)), spec


def _flat(tree):
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_sharded_as(x, mesh, spec, name):
    expected = NamedSharding(mesh, spec)
    assert x.sharding.is_equivalent_to(expected, x.ndim), (name, x.sharding, expected)


def check_layer(case: LayerCase):
    """The differential check of one drawn layer configuration (see the module docstring)."""
    STATS[f"{case.kind}:drawn"] += 1
    mesh = make_mesh(case)
    if case.refusal is not None:
        STATS[f"{case.kind}:refused"] += 1
        what, match = case.refusal
        with pytest.raises((ValueError, TypeError), match=re.escape(match)):
            layer = build(case, mesh)
            x = jnp.ones(case.shape, case.input_dtype)
            layer(x)
        return
    layer = build(case, mesh)
    x, call, ref_call, to_ring, from_ring = _inputs(case, layer, mesh)
    inner = layer.blocks if case.kind == "stack" else layer
    dtype = getattr(getattr(inner, "attention", getattr(inner, "up", inner)), "dtype", None)
    low = dtype is not None and jnp.dtype(dtype) == jnp.bfloat16
    out_features = dict(case.options).get("out_features", case.shape[-1])
    cotangent = jax.random.normal(jax.random.key(3), (*x.shape[:2], out_features), jnp.float32)

    # The input's dtype as drawn (float32, or bfloat16 into a bfloat16 Stack); the gradient
    # is taken with respect to the float32 x, through the cast.
    x_dtype = jnp.dtype(case.input_dtype)

    def loss(layer, x):
        y = layer(to_ring(x).astype(x_dtype), **call)
        return jnp.sum(from_ring(y).astype(jnp.float32) * cotangent), y

    grad_fn = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    if case.jit:
        grad_fn = nnx.jit(grad_fn)
    x_in, input_spec = _place_input(case, x, mesh)
    # Eager autodiff of arrays on Explicit axes needs the mesh in context (a JAX rule: the
    # scalar loss's cotangent is made on the mesh); jitted, the layers need no context.
    context = jax.set_mesh(mesh) if case.explicit and not case.jit else contextlib.nullcontext()
    with context:
        (_, y), (g_layer, g_x) = grad_fn(layer, x_in)

    # The output's sharding is the documented spec; on Explicit axes each gradient is sharded
    # like its parameter (sharding in types).
    spec = _expected_spec(case, layer, input_spec)
    _assert_sharded_as(y, mesh, spec, "output")
    params = nnx.state(layer, nnx.Param)
    param_shardings = _flat(jax.tree.map(lambda v: v.sharding, nnx.to_pure_dict(params)))
    grads = _flat(nnx.to_pure_dict(g_layer))
    assert grads.keys() == param_shardings.keys(), (grads.keys(), param_shardings.keys())
    for key, g in grads.items():
        if not case.explicit:  # Auto axes: the compiler picks the gradients' shardings
            break
        assert g.sharding.is_equivalent_to(param_shardings[key], g.ndim), (
            key,
            g.sharding,
            param_shardings[key],
        )
    y = np.asarray(from_ring(y))
    g_x = np.asarray(g_x)

    ref_fn = _reference_fn(case, layer)
    p0 = reference.params(layer)

    @functools.partial(jax.jit, static_argnames="dtype")
    def oracle(p, x, dtype=None):
        def f(p, x):
            y = ref_fn(p, x, dtype=dtype, **ref_call)
            return jnp.sum(y.astype(jnp.float32) * cotangent), y

        (_, y), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(p, x)
        return y, *grads

    if not low:
        ry, r_params, r_x = oracle(p0, x)
        assert y.dtype == np.float32
        assert_close(y, np.asarray(ry), atol=ATOL, rtol=RTOL, name="output")
        assert_close(g_x, np.asarray(r_x), atol=ATOL, rtol=RTOL, name="dx")
        expected = _flat(r_params)
        assert grads.keys() == expected.keys()
        for key in grads:
            assert_close(
                np.asarray(grads[key]),
                np.asarray(expected[key]),
                atol=ATOL,
                rtol=RTOL,
                name=f"d{key}",
            )
        return
    # bfloat16 compute: the flash-attention rule against the float32 and bf16 references.
    lp = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p0)
    ref_lp = oracle(lp, x.astype(jnp.bfloat16))
    ref32 = oracle(
        jax.tree.map(lambda a: a.astype(jnp.float32), lp),
        x.astype(jnp.bfloat16).astype(jnp.float32),
        dtype=jnp.float32,
    )
    assert y.dtype == jnp.bfloat16, y.dtype
    # A stack rounds once per layer: the cap grows with its depth (the rule's first bound,
    # twice the bfloat16 reference's own error, does not).
    rule = dict(relative_cap=True, depth=dict(case.stack).get("num_layers", 1))
    assert_close_low_precision(y, ref32[0], ref_lp[0], name="output", **rule)
    assert_close_low_precision(g_x, ref32[2], ref_lp[2], kind="grad", name="dx", **rule)
    e32, elp = _flat(ref32[1]), _flat(ref_lp[1])
    assert grads.keys() == e32.keys()
    for key in grads:
        assert_close_low_precision(
            grads[key], e32[key], elp[key], kind="grad", name=f"d{key}", **rule
        )


@pytest.mark.parametrize("max_examples", budget_params(4, 20))
def test_layers_match_unsharded_reference(max_examples):
    """Drawn from every kind at once; under `-m slow` every kind that the budget drew fewer
    than twice is then drawn 3 more times on its own, so that each layer kind is checked
    (a flat budget of 30 drew no Norm, one of 20 no ParallelMLP)."""
    drawn = Counter()

    def check(case):
        drawn[case.kind] += 1
        check_layer(case)

    run(check, layer_cases(), max_examples)
    if max_examples >= 10:
        for kind in LAYER_KINDS:
            if drawn[kind] < 2:
                run(check, layer_cases(kinds=(kind,)), 3)
        assert set(drawn) == set(LAYER_KINDS), drawn


# ---- defects the generator found (regressions: Stack's scan carry) ---------------------


def _stack_case(prefetch: bool, explicit: bool, dtype=None):
    """A 2-layer Stack of ParallelMLP blocks: plain on a (data,) mesh, or ZeRO-3 blocks with
    `prefetch=True` on a (data, fsdp) mesh."""
    names = ("data", "fsdp") if prefetch else ("data",)
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh(
        (2,) * len(names), names, axis_types=(kind,) * len(names), devices=jax.devices()[:4]
    )
    options = dict(zero=3) if prefetch else {}
    stack = Stack(
        lambda rngs: sf.layers.ParallelMLP(16, 32, dtype=dtype, mesh=mesh, rngs=rngs, **options),
        2,
        mesh=mesh,
        prefetch=prefetch,
        rngs=nnx.Rngs(0),
    )
    return mesh, stack


def _blocks_in_sequence(stack, x):
    """The Stack's blocks applied one after the other (layer l: slice l of each parameter)."""
    graphdef, state = nnx.split(stack.blocks)
    for layer in range(stack.num_layers):
        x = nnx.merge(graphdef, jax.tree.map(lambda a, i=layer: a[i], state))(x)
    return x


@pytest.mark.parametrize("prefetch", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_stack_eager_explicit_traced_input(prefetch):
    """Eager autodiff (under `jax.set_mesh`, which eager autodiff on Explicit axes needs) of a
    Stack whose input is computed inside the differentiated function: the input enters the
    scan's carry on the sharding the block gives its output (it came in replicated and left
    the block sharded over data, which `lax.scan` refused). Equal to the jitted gradient."""
    mesh, stack = _stack_case(prefetch, explicit=True)
    x = jax.random.normal(jax.random.key(1), (4, 8, 16), jnp.float32)
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    grad_fn = nnx.value_and_grad(lambda s, x: jnp.sum(s(x * 1.0) * cotangent), argnums=(0, 1))
    with jax.set_mesh(mesh):
        loss, (g_stack, g_x) = grad_fn(stack, x)
    loss_jit, (g_stack_jit, g_x_jit) = nnx.jit(grad_fn)(stack, x)
    assert_close(loss, loss_jit, name="loss")
    assert_close(g_x, g_x_jit, kind="grad", name="dx")
    got, expected = _flat(nnx.to_pure_dict(g_stack)), _flat(nnx.to_pure_dict(g_stack_jit))
    assert got.keys() == expected.keys() and got
    for key in got:
        assert_close(got[key], expected[key], kind="grad", name=f"d{key}")


@pytest.mark.parametrize("prefetch", [False, True])
def test_stack_of_bfloat16_blocks_takes_float32_input(prefetch):
    """A Stack of `dtype=bfloat16` blocks called on float32 activations behaves as its blocks
    in sequence (a block casts float32 input and returns bfloat16): the input is cast to the
    blocks' output dtype before the scan, whose carry keeps its dtype. The gradient of x is
    float32, as through the blocks; output and gradient bitwise equal to the loop's."""
    mesh, stack = _stack_case(prefetch, explicit=False, dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (4, 8, 16), jnp.float32)
    y = stack(x)
    expected = _blocks_in_sequence(stack, x)
    assert y.dtype == expected.dtype == jnp.bfloat16, (y.dtype, expected.dtype)
    # the same bfloat16 computation in the same order: bitwise (on CPU)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))

    @nnx.jit
    def input_grads(stack, x):
        g_x = jax.grad(lambda x: stack(x).astype(jnp.float32).sum())(x)
        return g_x, jax.grad(lambda x: _blocks_in_sequence(stack, x).astype(jnp.float32).sum())(x)

    g_x, g_loop = input_grads(stack, x)
    assert g_x.dtype == g_loop.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g_x), np.asarray(g_loop))


# ---- planted bugs: the generator must catch each of them -------------------------------


def _skip_mlp_residual(monkeypatch):
    """The block forgets its second residual add: `out = mlp(norm_2(h))`."""
    from shardfuse.layers import block as block_module

    def local(self, x, positions, segment_ids, norm_params, attention_params, mlp_params):
        (s1, b1), (s2, b2) = (self.norm_1.gathered(*p, x) for p in norm_params)
        h = block_module.normalize(self.norm_1.kind, x, s1, b1, self.norm_1.eps)
        h = x + self.attention.local(h, positions, segment_ids, *attention_params)
        y = block_module.normalize(self.norm_2.kind, h, s2, b2, self.norm_2.eps)
        return self.mlp.local(y, *mlp_params)

    monkeypatch.setattr(block_module.ParallelTransformerBlock, "local", local)


def _rotate_sequence_gather(monkeypatch):
    """Sequence parallelism's all-gather returns the shards rotated by one (wrong order)."""
    from shardfuse import collectives

    original = collectives.all_gather_matmul

    def rotated(x, w, axis_name, **kwargs):
        n = jax.lax.axis_size(axis_name)
        x = jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])
        return original(x, w, axis_name, **kwargs)

    monkeypatch.setattr(collectives, "all_gather_matmul", rotated)


def _drop_zero3_reduce_scatter(monkeypatch):
    """ZeRO-3's gradient reduce-scatter keeps only this shard's slice of its own cotangent
    (the sum over the fsdp axis is dropped)."""
    from shardfuse.layers import fsdp

    def bwd(axis, dim, dtype, reduce_dtype, param_dtype, _, cotangent):
        n = jax.lax.axis_size(axis)
        size = cotangent.shape[dim] // n
        start = jax.lax.axis_index(axis) * size
        grad = jax.lax.dynamic_slice_in_dim(cotangent, start, size, axis=dim)
        return (grad.astype(param_dtype),)

    monkeypatch.setattr(
        fsdp, "_fsdp_gather", jax.custom_vjp(fsdp._fsdp_gather.fun, nondiff_argnums=(1, 2, 3, 4, 5))
    )
    fsdp._fsdp_gather.defvjp(fsdp._gather_fwd, bwd)


def _tp(case):
    o = dict(case.options)
    return case.size(o.get("model_axis"))


MUTATIONS = {
    # name: (mutation, strategy of the configurations it applies to)
    "skip_mlp_residual": (
        _skip_mlp_residual,
        layer_cases(kinds=("block",)).filter(lambda c: c.refusal is None),
    ),
    "rotate_sequence_gather": (
        _rotate_sequence_gather,
        layer_cases(kinds=("column", "mlp")).filter(
            lambda c: c.refusal is None and _tp(c) > 1 and dict(c.options)["sequence_parallel"]
        ),
    ),
    "drop_zero3_reduce_scatter": (
        _drop_zero3_reduce_scatter,
        layer_cases(kinds=("column", "row")).filter(
            lambda c: c.refusal is None and dict(c.options)["zero"] == 3 and c.size("fsdp") > 1
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_generator_catches_planted_bugs(mutation, monkeypatch):
    """Under each planted bug, the generated check fails within a few drawn configurations."""
    plant, strategy = MUTATIONS[mutation]
    assert_catches(plant, check_layer, strategy, 4, monkeypatch)


def test_layer_strategy_is_mostly_valid():
    """The generator's refused fraction stays small (most draws test values, not errors)."""

    @settings(200)
    @hypothesis.given(layer_cases())
    def count(case):
        STATS["strategy:drawn"] += 1
        STATS["strategy:refused"] += case.refusal is not None

    STATS["strategy:drawn"] = STATS["strategy:refused"] = 0
    count()
    assert STATS["strategy:refused"] <= 0.2 * STATS["strategy:drawn"], STATS
