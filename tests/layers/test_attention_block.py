"""ParallelMLP, ParallelSelfAttention and ParallelTransformerBlock against the unsharded
references of `shardfuse.layers.reference`: forward and gradients of parameters and inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import reference
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.layers.common import (
    assert_sharded_as,
    assert_trees_close,
    assert_trees_close_low_precision,
    mesh_1d,
    mesh_3d,
)


def _check(
    layer,
    ref_fn,
    x,
    *,
    ring=None,
    layout="zigzag",
    call_kwargs=None,
    ref_kwargs=None,
    dtype=jnp.float32,
):
    """Forward and gradients (params and input) of `layer` vs `ref_fn` on natural-order x."""
    call_kwargs, ref_kwargs = call_kwargs or {}, ref_kwargs or {}
    to_ring = (lambda a: sf.to_ring_layout(a, ring, layout)) if ring else (lambda a: a)
    from_ring = (lambda a: sf.from_ring_layout(a, ring, layout)) if ring else (lambda a: a)
    ct = jax.random.normal(jax.random.key(7), x.shape, jnp.float32)

    @nnx.jit
    def sharded(layer, x):
        def loss(layer, x):
            y = from_ring(layer(to_ring(x), **call_kwargs))
            return jnp.sum(y.astype(jnp.float32) * ct), y

        (_, y), (g_layer, g_x) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer, x)
        return y, nnx.to_pure_dict(g_layer), g_x

    def unsharded(params, x, dtype=None):
        def loss(params, x):
            y = ref_fn(layer, params, x, dtype=dtype, **ref_kwargs)
            return jnp.sum(y.astype(jnp.float32) * ct), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return y, *grads

    params = reference.params(layer)
    y, g_params, g_x = sharded(layer, x.astype(dtype))
    if dtype == jnp.float32:
        ry, r_params, r_x = unsharded(params, x)
        assert_close(np.asarray(y), np.asarray(ry), atol=2e-5, rtol=2e-5, name="output")
        assert_close(np.asarray(g_x), np.asarray(r_x), kind="grad", atol=5e-5, rtol=5e-5, name="dx")
        assert_trees_close(g_params, r_params, name="dparams")
        return y
    lp = jax.tree.map(lambda a: a.astype(dtype), params)
    ref_lp = unsharded(lp, x.astype(dtype))
    ref32 = unsharded(
        jax.tree.map(lambda a: a.astype(jnp.float32), lp),
        x.astype(dtype).astype(jnp.float32),
        dtype=jnp.float32,
    )
    assert y.dtype == dtype
    assert_close_low_precision(y, ref32[0], ref_lp[0], name="output", relative_cap=True)
    assert_close_low_precision(g_x, ref32[2], ref_lp[2], kind="grad", name="dx", relative_cap=True)
    assert_trees_close_low_precision(g_params, ref32[1], ref_lp[1], name="dparams")
    return y


@pytest.mark.parametrize(
    "activation", [pytest.param("gelu", marks=pytest.mark.slow), "swiglu", "swiglu_clamped"]
)
def test_mlp(activation):
    mesh = mesh_3d()
    mlp = sf.layers.ParallelMLP(
        16,
        32,
        activation=activation,
        swiglu_limit=0.5,  # (swiglu_clamped: a limit the N(0, 1) rows reach)
        mesh=mesh,
        sequence_parallel=True,
        bias_init=nnx.initializers.normal(1.0),
        rngs=nnx.Rngs(0),
    )
    x = jax.random.normal(jax.random.key(0), (2, 16, 16))
    y = _check(mlp, reference.mlp, x)
    assert_sharded_as(y, mesh, P("data", ("sequence", "model"), None))


@pytest.mark.slow
def test_mlp_bfloat16():
    mlp = sf.layers.ParallelMLP(
        16, 32, activation="swiglu", mesh=mesh_1d(), dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    _check(mlp, reference.mlp, jax.random.normal(jax.random.key(0), (2, 8, 16)), dtype=jnp.bfloat16)


ATTENTION_CASES = {
    # GQA with kv heads split over tp (K = tp = 2), zigzag ring over cp = 2, segment ids.
    "3d-kv-split-zigzag-segments": dict(
        mesh=mesh_3d, heads=4, kv_heads=2, layout="zigzag", sequence_parallel=True, segments=True
    ),
    # MQA: one kv head replicated over tp = 2, contiguous ring, RoPE on custom positions.
    "3d-mqa-contiguous-positions": dict(
        mesh=mesh_3d,
        heads=4,
        kv_heads=1,
        layout="contiguous",
        sequence_parallel=False,
        positions=True,
    ),
    # Tensor parallel only (no sequence axis: flash attention), sliding window.
    "1d-tp4-window": dict(
        mesh=mesh_1d, heads=8, kv_heads=4, layout="zigzag", sequence_parallel=True, window=(5, 0)
    ),
}


@pytest.mark.parametrize(
    "name",
    [
        "3d-kv-split-zigzag-segments",
        pytest.param("3d-mqa-contiguous-positions", marks=pytest.mark.slow),
        pytest.param("1d-tp4-window", marks=pytest.mark.slow),
    ],
)
def test_self_attention(name):
    case = ATTENTION_CASES[name]
    mesh = case["mesh"]()
    attention = sf.layers.ParallelSelfAttention(
        32,
        case["heads"],
        num_kv_heads=case["kv_heads"],
        mesh=mesh,
        layout=case["layout"],
        sequence_parallel=case["sequence_parallel"],
        window=case.get("window"),
        use_bias=True,
        bias_init=nnx.initializers.normal(0.5),
        rngs=nnx.Rngs(0),
    )
    B, T = 2, 32
    x = jax.random.normal(jax.random.key(0), (B, T, 32))
    ring = mesh.shape["sequence"] if "sequence" in mesh.axis_names else None
    to_ring = (lambda a: sf.to_ring_layout(a, ring, case["layout"])) if ring else (lambda a: a)
    call_kwargs, ref_kwargs = {}, {}
    if case.get("segments"):
        seg = jnp.sort(jax.random.randint(jax.random.key(1), (B, T), 0, 3), axis=1).astype(
            jnp.int32
        )
        call_kwargs["segment_ids"], ref_kwargs["segment_ids"] = to_ring(seg), seg
    if case.get("positions"):
        pos = (jnp.arange(T, dtype=jnp.int32) % 12) * 3  # restarts, as in packed sequences
        call_kwargs["positions"] = to_ring(pos[None])[0]
        ref_kwargs["positions"] = pos
    y = _check(
        attention,
        reference.self_attention,
        x,
        ring=ring,
        layout=case["layout"],
        call_kwargs=call_kwargs,
        ref_kwargs=ref_kwargs,
    )
    assert y.shape == x.shape
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(attention, nnx.Param)))
    kv = P(None, "model") if case["kv_heads"] % mesh.shape["model"] == 0 else P()
    # (canonical specs: no trailing None)
    assert specs == {
        "q_kernel": P(None, "model"),
        "kv_kernel": kv,
        "o_kernel": P("model"),
        "q_bias": P("model"),
        "kv_bias": P(*kv[1:]),
        "o_bias": P(),
    }


@pytest.mark.parametrize(
    "qk_norm, kv_heads",
    [("flat", 2), pytest.param("flat", 1, marks=pytest.mark.slow),
     pytest.param("head", 2, marks=pytest.mark.slow)],
)  # fmt: skip
def test_self_attention_qk_norm_and_clip(qk_norm, kv_heads):
    """Qwen3's per-head and OLMoE's flat q/k RMSNorms and the q/k/v clamp, on a data x
    sequence x model mesh (ring attention, sequence parallel; the flat norm's sum of
    squares reduced over model, or, one kv head replicated, computed whole on each
    shard): forward and gradients against the reference."""
    mesh = mesh_3d()
    attention = sf.layers.ParallelSelfAttention(
        32, 4, num_kv_heads=kv_heads, mesh=mesh, layout="zigzag", sequence_parallel=True,
        qk_norm=qk_norm, qk_norm_eps=1e-5, clip_qkv=1.0, rngs=nnx.Rngs(0),
    )  # fmt: skip
    for norm in (attention.q_norm, attention.k_norm):  # weights that are not all ones
        norm[...] = norm[...] * jnp.linspace(0.5, 2.0, norm.shape[0])
    x = 2.0 * jax.random.normal(jax.random.key(0), (2, 32, 32))
    _check(attention, reference.self_attention, x, ring=2)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(attention, nnx.Param)))
    assert specs["q_norm"] == (P("model") if qk_norm == "flat" else P())
    assert specs["k_norm"] == (P("model") if qk_norm == "flat" and kv_heads == 2 else P())
    # the clamp acts: unclamped, the output differs
    params = reference.params(attention)
    unclamped = nnx.clone(attention)
    unclamped.clip_qkv = None
    diff = reference.self_attention(unclamped, params, x) - reference.self_attention(
        attention, params, x
    )
    assert float(jnp.abs(diff).max()) > 1e-2


def test_self_attention_sinks_window_yarn_and_biases():
    """gpt-oss's attention: sinks (through ring attention's lse), q/k/v/o biases, a window
    and YaRN RoPE on a data x sequence x model mesh: forward and gradients (sinks included)
    against the reference; the sinks act (zeroed, the output differs)."""
    mesh = mesh_3d()
    attention = sf.layers.ParallelSelfAttention(
        32, 4, num_kv_heads=2, mesh=mesh, layout="zigzag", sequence_parallel=True, sinks=True,
        use_bias=True, window=(5, 0), rope_theta=100.0,
        rope_scaling=("yarn", 4.0, 8.0, 1.0, 8, False, 1.2),
        bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(0),
    )  # fmt: skip
    attention.sinks[...] = jax.device_put(
        jnp.array([-1.0, 0.5, 2.0, 0.0]), attention.sinks[...].sharding
    )
    x = jax.random.normal(jax.random.key(0), (2, 32, 32))
    _check(attention, reference.self_attention, x, ring=2)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(attention, nnx.Param)))
    assert specs["sinks"] == P("model")
    params = reference.params(attention)
    zeroed = {**params, "sinks": params["sinks"] * 0}
    diff = reference.self_attention(attention, zeroed, x) - reference.self_attention(
        attention, params, x
    )
    assert float(jnp.abs(diff).max()) > 1e-2


def _block(mesh, dtype=None):
    return sf.layers.ParallelTransformerBlock(
        32, 4, 64, num_kv_heads=2, mesh=mesh, layout="zigzag", dtype=dtype, rngs=nnx.Rngs(0)
    )


@pytest.mark.slow  # the block is also checked per shard (test_manual_region) and in test_api
def test_transformer_block_gqa_causal_ring():
    mesh = mesh_3d()
    block = _block(mesh)
    x = jax.random.normal(jax.random.key(0), (2, 32, 32))
    y = _check(block, reference.transformer_block, x, ring=2)
    out = block(sf.to_ring_layout(x, 2, "zigzag"))
    assert_sharded_as(out, mesh, P("data", ("sequence", "model"), None))
    assert y.shape == x.shape


@pytest.mark.slow
def test_transformer_block_bfloat16():
    block = _block(mesh_3d(), dtype=jnp.bfloat16)
    _check(
        block,
        reference.transformer_block,
        jax.random.normal(jax.random.key(0), (2, 32, 32)),
        ring=2,
        dtype=jnp.bfloat16,
    )


@pytest.mark.slow  # training end to end: tests/test_train_lm.py, tests/test_examples.py
def test_training_with_optax_matches_reference_and_learns():
    mesh = mesh_3d()
    block = _block(mesh)
    params0 = reference.params(block)
    optimizer = nnx.Optimizer(block, optax.sgd(0.05), wrt=nnx.Param)
    x = sf.to_ring_layout(jax.random.normal(jax.random.key(0), (2, 32, 32)), 2, "zigzag")
    target = jnp.roll(x, 1, axis=-1)

    @nnx.jit
    def step(block, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(block)
        optimizer.update(block, grads)
        return loss

    losses = [float(step(block, optimizer, x)) for _ in range(3)]
    assert losses[2] < losses[0], losses
    # The first SGD step equals the one computed on the unsharded reference.
    ref_grads = jax.grad(
        lambda p: jnp.mean(
            (
                reference.transformer_block(block, p, sf.from_ring_layout(x, 2, "zigzag"))
                - sf.from_ring_layout(target, 2, "zigzag")
            )
            ** 2
        )
    )(params0)
    expected = jax.tree.map(lambda p, g: p - 0.05 * g, params0, ref_grads)
    block_once = _block(mesh)
    opt_once = nnx.Optimizer(block_once, optax.sgd(0.05), wrt=nnx.Param)
    step(block_once, opt_once, x)
    assert_trees_close(reference.params(block_once), expected, name="params after one step")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_heads=6), r"num_heads=6 must be divisible by the size 4 of mesh axis 'model'"),
        (
            dict(num_kv_heads=3, num_heads=12),
            r"num_kv_heads=3 must divide or be divisible by the size 4",
        ),
        (dict(num_kv_heads=3), r"num_heads=8 must be a positive multiple of num_kv_heads=3"),
        (
            dict(model_axis="tensor"),
            r"model_axis='tensor' is not an axis of the mesh; its axes are \('model',\)",
        ),
        (dict(sequence_axis="context"), r"sequence_axis='context' is not an axis"),
        (dict(head_dim=7), r"head_dim=7 must be even"),
        (dict(layout="spiral"), r"layout='spiral' is not one of"),
    ],
)
def test_attention_bad_construction(kwargs, match):
    args = dict(num_heads=8, mesh=mesh_1d(), rngs=nnx.Rngs(0))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sf.layers.ParallelSelfAttention(32, args.pop("num_heads"), **args)


def test_bad_calls():
    block = _block(mesh_3d())
    with pytest.raises(
        ValueError, match=r"T=20 must be divisible by 8 \(sequence size 2 x model size 2"
    ):
        block(jnp.zeros((2, 20, 32)))
    with pytest.raises(ValueError, match=r"expected \[B, T, features=32\]"):
        block(jnp.zeros((2, 32, 16)))
    with pytest.raises(ValueError, match=r"segment_ids must be int \[B, T\]"):
        block(jnp.zeros((2, 32, 32)), segment_ids=jnp.zeros((2, 16), jnp.int32))
    with pytest.raises(ValueError, match=r"hidden_features=30 must be divisible"):
        sf.layers.ParallelMLP(16, 30, mesh=mesh_1d(), rngs=nnx.Rngs(0))
