"""The fused routed SwiGLU experts on the CPU (`native_cpu.swiglu_experts`, native/moe_experts.cc).

Oracle: each row through its expert by gathered dense einsums in float32 at HIGHEST precision
(no sort, no grouped matmul), zero for rows whose id is outside `[0, G)`; values and every
gradient (rows, gate_up, down), float32 and bfloat16, generated shapes and routings (ids
outside the shard, empty experts, no computed row, one row). Work: the kernels' multiply-add
counter equals the active work, forward 3 F H per computed row and backward twice that, with
the residual saved (no recomputed forward). Layer: `ParallelMoE` on the CPU mesh runs its
experts as one forward and one backward custom call per dispatch chunk, and no separate
grouped matmul.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_policies

import shardfuse as sf
from shardfuse.kernels.grouped_matmul import native_cpu
from shardfuse.layers.mlp import activate

pytestmark = pytest.mark.skipif(
    not native_cpu.extension.status("cpu")[0], reason="the native extension is not built"
)


def oracle(rows, ids, gate_up, down):
    G = gate_up.shape[0]
    held = (ids >= 0) & (ids < G)
    e = jnp.clip(ids, 0, G - 1)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    h = jnp.einsum("rf,rfk->rk", f32(rows), f32(gate_up)[e], precision="highest")
    y = jnp.einsum("rh,rhf->rf", activate("swiglu", h), f32(down)[e], precision="highest")
    return jnp.where(held[:, None], y, 0.0)


def _case(seed):
    """A generated case: shapes, dtype and ids (some outside [0, G), some experts empty)."""
    rng = np.random.default_rng(seed)
    R = int(rng.choice([0, 1, 7, 64, 193]))
    F, H, G = int(rng.choice([8, 24, 64])), int(rng.choice([4, 16, 40])), int(rng.integers(1, 6))
    dtype = [jnp.float32, jnp.bfloat16][seed % 2]
    ids = rng.integers(-2, G + 3, R) if seed % 3 else rng.integers(0, max(1, G // 2), R)
    return R, F, H, G, dtype, jnp.asarray(ids, jnp.int32)


def _operands(R, F, H, G, dtype, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    rows = jax.random.normal(k[0], (R, F)).astype(dtype)
    gate_up = (jax.random.normal(k[1], (G, F, 2 * H)) / np.sqrt(F)).astype(dtype)
    down = (jax.random.normal(k[2], (G, H, F)) / np.sqrt(H)).astype(dtype)
    weights = jax.random.normal(k[3], (R, F))
    return rows, gate_up, down, weights


@pytest.mark.parametrize("seed", range(12))
def test_values_and_gradients_equal_the_oracle(seed):
    R, F, H, G, dtype, ids = _case(seed)
    rows, gate_up, down, w = _operands(R, F, H, G, dtype, seed)

    def loss(fn):
        return lambda r, g, d: jnp.sum(fn(r, ids, g, d).astype(jnp.float32) * w)

    got = (native_cpu.swiglu_experts(rows, ids, gate_up, down),) + jax.jit(
        jax.grad(loss(native_cpu.swiglu_experts), argnums=(0, 1, 2))
    )(rows, gate_up, down)
    want = (oracle(rows, ids, gate_up, down),) + jax.grad(loss(oracle), argnums=(0, 1, 2))(
        rows, gate_up, down
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("y", "d_rows", "d_gate_up", "d_down"), got, want, strict=True):
        assert a.dtype == dtype and a.shape == b.shape, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol, err_msg=name)
    held = np.asarray((ids >= 0) & (ids < G))
    assert not np.asarray(got[0], np.float32)[~held].any()  # rows not held: exactly zero
    assert not np.asarray(got[1], np.float32)[~held].any()


def test_saturated_gates_stay_finite_and_equal_the_oracle():
    """Gate values far past where the sigmoid saturates (|gate| up to ~300): the vectorised
    activation's clamped exp neither overflows nor loses the silu's sign, forward or back."""
    R, F, H, G = 37, 8, 12, 2  # H = 12: one whole vector and a tail (or a tail alone)
    rows, gate_up, down, w = _operands(R, F, H, G, jnp.float32, 7)
    gate_up = gate_up * 100.0
    ids = jnp.asarray(np.arange(R) % (G + 1), jnp.int32)

    def loss(fn):
        return lambda r, g, d: jnp.sum(fn(r, ids, g, d) * w)

    got = (native_cpu.swiglu_experts(rows, ids, gate_up, down),) + jax.grad(
        loss(native_cpu.swiglu_experts), argnums=(0, 1, 2)
    )(rows, gate_up, down)
    want = (oracle(rows, ids, gate_up, down),) + jax.grad(loss(oracle), argnums=(0, 1, 2))(
        rows, gate_up, down
    )
    h = np.einsum("rf,rfk->rk", np.asarray(rows), np.asarray(gate_up)[np.asarray(ids) % G])
    assert np.abs(h[:, ::2]).max() > 150  # the case does saturate
    for name, a, b in zip(("y", "d_rows", "d_gate_up", "d_down"), got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(
            a, b, atol=1e-5 * max(1.0, np.abs(b).max()), rtol=1e-5, err_msg=name
        )


def test_work_is_the_active_work_and_the_backward_reuses_the_residual():
    R, F, H, G = 96, 32, 16, 4
    ids = jnp.asarray(np.random.default_rng(0).integers(-1, G + 1, R), jnp.int32)
    computed = int(((ids >= 0) & (ids < G)).sum())
    rows, gate_up, down, w = _operands(R, F, H, G, jnp.float32, 0)
    fwd = jax.jit(native_cpu.swiglu_experts)
    grad = jax.jit(
        jax.grad(lambda r: jnp.sum(native_cpu.swiglu_experts(r, ids, gate_up, down) * w))
    )
    remat = jax.jit(jax.grad(lambda r: jnp.sum(jax.checkpoint(
        lambda r: native_cpu.swiglu_experts(r, ids, gate_up, down),
        policy=checkpoint_policies.save_only_these_names("moe_up"))(r) * w)))  # fmt: skip
    for f, *args in ((fwd, rows, ids, gate_up, down), (grad, rows), (remat, rows)):
        jax.block_until_ready(f(*args))  # compile outside the counted calls
    counts = []
    for f, *args in ((fwd, rows, ids, gate_up, down), (grad, rows), (remat, rows)):
        before = native_cpu.executed_macs()
        jax.block_until_ready(f(*args))
        counts.append(native_cpu.executed_macs() - before)
    assert counts == [3 * F * H * computed, 9 * F * H * computed, 9 * F * H * computed]


def test_a_moe_layer_runs_its_experts_as_one_call_each_way():
    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    moe = sf.layers.ParallelMoE(16, 32, num_experts=8, top_k=2, mesh=mesh, rngs=nnx.Rngs(0))
    graph, params, rest = nnx.split(moe, nnx.Param, ...)
    x = jax.random.normal(jax.random.key(1), (8, 8, 16))

    def loss(params, x):
        y, _ = nnx.merge(graph, params, rest).forward_with_stats(x)
        return jnp.sum(y**2)

    with jax.set_mesh(mesh):
        x = jax.reshard(x, jax.sharding.PartitionSpec(("expert", "data")))
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).compile().as_text()
    # On this mesh the layer runs the capped dispatch (`moe_capped.capped_expert_parallel`): a
    # conditional whose branches each run the experts once each way (the fallback's
    # backward recomputes its forward first). Per computation:
    calls = []
    for computation in hlo.split("\n\n"):
        targets = [t.split('"')[0] for t in computation.split('custom_call_target="')[1:]]
        assert not [t for t in targets if t.startswith("shardfuse_grouped_matmul")]
        calls.append((targets.count("shardfuse_moe_experts_forward"),
                      targets.count("shardfuse_moe_experts_backward")))  # fmt: skip
    assert sorted(c for c in calls if c != (0, 0)) == [(0, 1), (1, 0), (1, 0), (1, 1)]
    assert " conditional(" in hlo


def test_unsupported_operands_are_refused():
    rows, gate_up, down, _ = _operands(4, 8, 4, 2, jnp.float32, 0)
    assert native_cpu.swiglu_experts_supported(rows, gate_up, down)
    assert not native_cpu.swiglu_experts_supported(rows.astype(jnp.float16), gate_up, down)
    assert not native_cpu.swiglu_experts_supported(rows.astype(jnp.bfloat16), gate_up, down)
    assert not native_cpu.swiglu_experts_supported(rows, gate_up[:, :, :6], down)
    with pytest.raises(NotImplementedError, match="float32 or bfloat16"):
        native_cpu.swiglu_experts(rows.astype(jnp.float16), jnp.zeros(4, jnp.int32), gate_up, down)


def test_docstring_examples():
    import doctest

    from shardfuse.collectives import expert_dispatch

    if not native_cpu.swiglu_experts_supported(*_operands(4, 8, 4, 2, jnp.float32, 0)[:3]):
        pytest.skip("the C++ fused experts are not built")
    for module in (native_cpu, expert_dispatch):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0, module
