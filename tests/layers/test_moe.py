"""ParallelMoE against the dense one-device oracle (`sf.layers.reference.moe`).

Generated differential tests: routing rule x k x experts x groups x shared experts x
capacity x mesh (expert x data x fsdp x sequence x model, Explicit and Auto) x eager/jit;
the output, the auxiliary losses, the tokens per expert, the dropped tokens and every
gradient (router, experts, shared experts, gate, input) equal the oracle's. A fixed seed;
`QUICK` cases in the default suite, `_slow_cases()` (22) under `-m slow`. Planted
mutations (a wrong unsort, a dropped renormalisation) must make the same comparison fail.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import _sharding
from shardfuse.layers import moe as moe_lib
from shardfuse.layers import router as router_lib
from shardfuse.testing import assert_close_low_precision
from tests.layers.common import assert_trees_close_low_precision
from tests.layers.moe_cases import Case, build, check_case, draw_case, inputs

# slow: the first 20 generated cases, then the first of the next 20 on each mesh that they
# missed (22 cases: every mesh, rule, capacity, axis type and mode that 40 draws held; 40
# took 400-600 s of the slow suite)
QUICK, SLOW, SLOW_DRAWS = 2, 20, 40


def _cases(seed, count):
    rng = np.random.default_rng(seed)
    return [draw_case(rng) for _ in range(count)]


def _slow_cases():
    drawn = _cases(1, SLOW_DRAWS)
    cases = drawn[:SLOW]
    for case in drawn[SLOW:]:
        if case.mesh not in {c.mesh for c in cases}:
            cases.append(case)
    return cases


# hand-picked: each rule and the expert-parallel meshes the issue names, then generated ones
HAND = [
    Case(mesh=(("expert", 4), ("model", 2)), routing="softmax", num_experts=8, top_k=2,
         shared_experts=1, shared_expert_gate=True),
    Case(mesh=(("data", 2), ("expert", 2), ("model", 2)), axis_type="auto", mode="jit",
         routing="sigmoid", num_experts=8, top_k=3, groups=(4, 2), routed_scaling=2.5,
         capacity_factor=1.0, sequence_parallel=True),
    Case(mesh=(("fsdp", 2), ("expert", 2), ("model", 2)), num_experts=4, top_k=2,
         shared_experts=1, zero=3),
    # gpt-oss: biased router and experts, the clamped SwiGLU (a limit the rows reach)
    Case(mesh=(("expert", 2), ("data", 2), ("model", 2)), num_experts=4, top_k=2,
         activation="swiglu_clamped", swiglu_limit=0.5, expert_bias=True),
]  # fmt: skip


@pytest.mark.parametrize("case", HAND + _cases(0, QUICK), ids=str)
def test_moe_equals_oracle(case):
    check_case(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _slow_cases(), ids=str)
def test_moe_equals_oracle_generated_slow(case):
    check_case(case)


def test_capacity_overflow_drops_counted_tokens_never_nan():
    # every token prefers expert 0: capacity ceil(0.5 * n * 2 / 4) = n/4 of n first choices
    case = Case(mesh=(("expert", 2), ("data", 2)), num_experts=4, top_k=2, capacity_factor=0.5)
    moe = build(case)
    router = np.zeros((8, 4), np.float32)
    router[:, 0] = 5.0
    moe.router[...] = jax.device_put(router, moe.router[...].sharding)
    x = jnp.abs(jax.random.normal(jax.random.key(0), (4, 8, 8))) + 0.1  # logits favour 0
    stats = check_case(case, moe=moe, x=x)
    n = 2 * 8  # tokens per device (batch shard)
    capacity = 4  # ceil(0.5 * 16 * 2 / 4)
    assert int(stats["dropped_tokens"]) >= 4 * (n - capacity)  # expert 0's overflow, 4 devices
    assert int(stats["tokens_per_expert"][0]) == 4 * 8  # every token chose it


def _mutated_fails(monkeypatch, patch, case):
    # the layer's compiled program is cached by its configuration: trace the mutant afresh,
    # and never leave it in the cache for the tests that follow
    _sharding._compiled.clear_cache()
    patch(monkeypatch)
    try:
        with pytest.raises(AssertionError):
            check_case(case)
    finally:
        monkeypatch.undo()
        _sharding._compiled.clear_cache()


def test_planted_wrong_unsort_is_caught(monkeypatch):
    original = moe_lib.ParallelMoE._experts
    original_fused = moe_lib.native_cpu_gmm.swiglu_experts_forward

    def shifted(self, *args):  # results unsorted onto the neighbouring rows
        return jnp.roll(original(self, *args), 1, axis=0)

    def shifted_fused(*args):  # the same in the capped dispatch's fused experts
        y, h = original_fused(*args)
        return jnp.roll(y, 1, axis=0), h

    def patch(m):
        m.setattr(moe_lib.ParallelMoE, "_experts", shifted)
        m.setattr(moe_lib.native_cpu_gmm, "swiglu_experts_forward", shifted_fused)

    case = HAND[0]  # passes unmutated (test_moe_equals_oracle)
    _mutated_fails(monkeypatch, patch, case)


def test_planted_down_bias_on_every_model_shard_is_caught(monkeypatch):
    original = moe_lib.routed_experts

    def every_shard(*args, **kwargs):  # the down bias added on each model shard, not once
        return original(*args, **{**kwargs, "add_down_bias": True})

    case = HAND[3]  # passes unmutated (test_moe_equals_oracle)
    _mutated_fails(monkeypatch, lambda m: m.setattr(moe_lib, "routed_experts", every_shard),
                   case)  # fmt: skip


def test_planted_dropped_renormalisation_is_caught(monkeypatch):
    original = router_lib.route

    def no_renormalisation(config, logits, bias=None):
        return original(dataclasses.replace(config, normalize_top_k=False), logits, bias)

    case = HAND[0]
    _mutated_fails(monkeypatch, lambda m: m.setattr(router_lib, "route", no_renormalisation),
                   case)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=4, top_k=5), "top_k=5 must be between 1 and num_experts=4"),
        (dict(num_experts=6, top_k=2), "num_experts"),  # 6 experts over expert=4
        (dict(num_experts=4, top_k=2, capacity_factor=0), "capacity_factor=0"),
        (dict(num_experts=4, top_k=2, capacity_factor=-1.0), "capacity_factor=-1.0"),
        (dict(num_experts=4, top_k=2, routing="relu"), "routing='relu'"),
        (dict(num_experts=4, top_k=2, n_groups=3, topk_groups=1), "n_groups=3"),
        (dict(num_experts=4, top_k=2, n_groups=2), "topk_groups=None"),
        (dict(num_experts=4, top_k=2, shared_experts=-1), "shared_experts=-1"),
        (dict(num_experts=4, top_k=2, dispatch_implementation="nccl"), "dispatch_implementation"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, match):
    mesh = jax.make_mesh((4, 2), ("expert", "model"))
    with pytest.raises(ValueError, match=match):
        sf.layers.ParallelMoE(8, 8, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)


def test_bad_input_raises_before_tracing():
    moe = build(Case(mesh=(("expert", 2),)))
    with pytest.raises(ValueError, match="expected"):
        moe(jnp.ones((2, 4, 5)))
    with pytest.raises(ValueError, match="batch size B"):
        moe(jnp.ones((3, 4, 8)))
    with pytest.raises(TypeError):
        moe(jnp.ones((2, 4, 8), jnp.int32))


def test_expert_axis_without_moe_keeps_dense_layers_working():
    # a mesh with an expert axis: a dense MLP splits its batch over it, same result
    mesh = jax.make_mesh((2, 2), ("expert", "model"))
    mlp = sf.layers.ParallelMLP(8, 16, activation="swiglu", mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (4, 4, 8))
    y = mlp(x)
    assert y.sharding.spec[0] == "expert"
    ref = sf.layers.reference.mlp(mlp, sf.layers.reference.params(mlp), np.asarray(x))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_sigmoid_bias_only_chooses_and_updates_outside_the_gradient():
    case = Case(mesh=(("expert", 2),), routing="sigmoid", num_experts=4, top_k=1,
                normalize_top_k=False)  # fmt: skip
    moe = build(case)
    x, _ = inputs(moe, case)

    def set_bias(values):
        sharding = moe.selection_bias[...].sharding
        moe.selection_bias[...] = jax.device_put(jnp.asarray(values, jnp.float32), sharding)

    set_bias([0.0] * 4)
    moe(x)
    counts = moe.tokens_per_expert[...]
    # a large bias on expert 3 sends every token there; the weight stays sigmoid(logit)
    set_bias([0.0, 0.0, 0.0, 100.0])
    y = moe(x)
    assert moe.tokens_per_expert[...].tolist() == [0, 0, 0, int(counts.sum())]
    ref, _ = sf.layers.reference.moe(moe, sf.layers.reference.params(moe), np.asarray(x))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), atol=1e-5, rtol=1e-5)
    new = router_lib.update_selection_bias(moe.selection_bias[...], moe.tokens_per_expert[...])
    assert new.tolist()[3] < 100.0 and all(b > 0 for b in new.tolist()[:3])
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x))))(moe)
    assert "selection_bias" not in nnx.to_pure_dict(grads)


def test_moe_stats_sum_over_layers_and_tokens_per_expert():
    case = Case(mesh=(("expert", 2),), num_experts=4, top_k=2)

    class Two(nnx.Module):
        def __init__(self):
            self.a, self.b = build(case, seed=0), build(case, seed=1)

        def __call__(self, x):
            return self.b(self.a(x))

    model = Two()
    x, _ = inputs(model.a, case)
    model(x)
    stats = sf.layers.moe_stats(model)
    expected = model.a.load_balancing_loss[...] + model.b.load_balancing_loss[...]
    np.testing.assert_allclose(stats["load_balancing_loss"], expected, rtol=1e-6)
    assert [int(t.sum()) for t in stats["tokens_per_expert"]] == [x.shape[0] * x.shape[1] * 2] * 2


@pytest.mark.slow
def test_bfloat16_within_the_low_precision_rule():
    case = Case(mesh=(("expert", 2), ("model", 2)), num_experts=4, top_k=2, shared_experts=1)
    moe = build(case, dtype=jnp.bfloat16)
    x, ct = inputs(moe, case)
    p = sf.layers.reference.params(moe)
    x0, ct0 = (jax.device_put(np.asarray(a), jax.devices()[0]) for a in (x, ct))

    def oracle(dtype):
        def loss(p, x):
            y, _ = sf.layers.reference.moe(moe, p, x, dtype=dtype)
            return jnp.sum(y.astype(jnp.float32) * ct0), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x0)

    (_, ref32), g32 = oracle(jnp.float32)
    (_, ref_lp), g_lp = oracle(jnp.bfloat16)

    def loss(m, x):
        y = m(x)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    (_, y), grads = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(moe, x)
    assert y.dtype == jnp.bfloat16
    assert_close_low_precision(y, ref32, ref_lp, name="y", relative_cap=True)
    assert_trees_close_low_precision(
        {"p": nnx.to_pure_dict(grads[0]), "x": grads[1]},
        {"p": g32[0], "x": g32[1]},
        {"p": g_lp[0], "x": g_lp[1]},
    )


def test_zero3_shards_expert_weights_over_fsdp():
    moe = build(HAND[2])
    assert moe.gate_up[...].sharding.spec == P("expert", "fsdp", "model")
    assert moe.down[...].sharding.spec == P("expert", "model", "fsdp")
    assert moe.shared_up[...].sharding.spec == P("fsdp", "model")
    with pytest.raises(ValueError, match="features=5 must be divisible"):
        build(HAND[2], features=5)
