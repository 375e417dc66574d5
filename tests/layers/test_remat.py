"""Activation checkpointing policies: what each saves inside a scan over blocks; equal gradients.

Blocks are stacked (parameters `[L, ...]`) and applied by `nnx.scan`, as a
layer stack does; the saved residuals of the loss (`saved_residuals`, what
`jax.ad_checkpoint.print_saved_residuals` prints) are the activations the
policy promises, told apart by their shapes: the block sizes are chosen so
that every tagged tensor has its own last dimension (F=32, q=H*D=24,
kv=2*K*D=12, attention core [H=4, D=6], MLP up=2*48=96, activation 48).
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from shardfuse.layers import ParallelTransformerBlock, fsdp, remat
from shardfuse.layers.fsdp import FSDP_GATHER

L, B, T, F = 2, 2, 8, 32
X, Q, KV, UP, CORE = (F,), (24,), (12,), (96,), (4, 6)


def _stacked(policy, mesh, **kwargs):
    blocks = [
        ParallelTransformerBlock(
            F,
            4,
            48,
            num_kv_heads=1,
            head_dim=6,
            mesh=mesh,
            remat=policy,
            rngs=nnx.Rngs(i),
            **kwargs,
        )
        for i in range(L)
    ]
    graphdef = nnx.graphdef(blocks[0])
    state = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
    return graphdef, state


def _loss(graphdef):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def layer(x, state):
        return nnx.merge(graphdef, state)(x), None

    def loss(state, x):
        y, _ = layer(x, state)
        return jnp.sum(jnp.sin(y))

    return loss


def _activations(loss, state, x):
    """{(memory, trailing shape)} of the saved residuals stacked `[L, B, T, ...]`."""
    out = set()
    for aval, _ in saved_residuals(loss, state, x):
        if aval.shape[:3] == (L, B, T):
            out.add((getattr(aval, "memory_space", None).name.lower(), aval.shape[3:]))
    return out


def _device(*shapes):
    return {("device", s) for s in shapes}


@pytest.fixture(scope="module")
def one_device():
    return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))


EXPECTED = {
    "full": _device(X),  # the block input only
    "selective": _device(X, Q, KV, UP),  # Korthikanti: projections kept, attention core not
    "dots": _device(X, Q, KV, UP, CORE),  # every matmul output
    "offload": _device(X) | {("host", s) for s in (X, Q, KV, UP)},
}


@pytest.fixture(scope="module")
def reference_none(one_device):
    """Saved activations and gradients of the "none" policy."""
    x = jax.random.normal(jax.random.key(0), (B, T, F))
    graphdef, state = _stacked("none", one_device)
    kept = _activations(_loss(graphdef), state, x)
    return kept, jax.jit(jax.grad(_loss(graphdef), argnums=(0, 1)))(state, x)


def _abstract_stack(policy, mesh):
    """`(graphdef, state, x)` as shapes only: the residuals are traced, nothing compiled."""
    block = nnx.eval_shape(
        lambda: ParallelTransformerBlock(
            F, 4, 48, num_kv_heads=1, head_dim=6, mesh=mesh, remat=policy, rngs=nnx.Rngs(0)
        )
    )
    graphdef, state = nnx.split(block)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct((L, *a.shape), a.dtype), state)
    return graphdef, state, jax.ShapeDtypeStruct((B, T, F), jnp.float32)


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_policy_saves_what_it_promises_inside_scan(policy, one_device):
    graphdef, state, x = _abstract_stack(policy, one_device)
    saved = _activations(_loss(graphdef), state, x)
    assert {(m.replace("any", "device"), s) for m, s in saved} == EXPECTED[policy], saved
    graphdef, state, x = _abstract_stack("none", one_device)
    kept = _activations(_loss(graphdef), state, x)
    assert _device(X, CORE, (48,)) <= kept and len(kept) > len(EXPECTED[policy])


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(EXPECTED))
def test_saved_residuals_inside_scan_and_gradients_equal_none(policy, one_device, reference_none):
    x = jax.random.normal(jax.random.key(0), (B, T, F))
    graphdef, state = _stacked(policy, one_device)
    loss = _loss(graphdef)
    saved = _activations(loss, state, x)
    expected = {(m if m != "host" else "host", s) for m, s in EXPECTED[policy]}
    assert {(m.replace("any", "device"), s) for m, s in saved} == expected, saved

    kept, want = reference_none
    assert _device(X, CORE, (48,)) <= kept  # "none" keeps the attention core and activation
    assert len(kept) > len(expected)
    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(state, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_zero3_gathered_weights_not_saved_unless_asked():
    mesh = jax.make_mesh((4,), ("fsdp",))
    # gathered kernels, stacked over layers, as residuals (global view: 4 fsdp copies)
    gathered = {(L, 4 * F, 36), (L, 4 * 24, F), (L, 4 * F, 96), (L, 4 * 48, F)}

    def saved_weights(reshard, policy):
        graphdef, state = _stacked(policy, mesh, zero=3, reshard_after_forward=reshard)
        x = jax.random.normal(jax.random.key(0), (4, T, F))
        return {a.shape for a, _ in saved_residuals(_loss(graphdef), state, x)} & gathered

    assert saved_weights(True, "none") == set()  # reshard_after_forward: gathered again
    assert saved_weights(False, "none") == gathered  # kept: one gather fewer
    assert saved_weights(True, "selective") == set()
    assert saved_weights(False, "selective") == gathered
    assert FSDP_GATHER not in remat.MATMUL_OUTPUT_NAMES


def test_unknown_policy_and_offload_without_host_memory(monkeypatch, one_device):
    with pytest.raises(ValueError, match=r"remat='lots' is not a remat policy; valid: \('none'"):
        ParallelTransformerBlock(F, 4, 48, mesh=one_device, remat="lots", rngs=nnx.Rngs(0))
    monkeypatch.setattr(remat, "offload_supported", lambda device=None: (False, "tpu lacks it"))
    with pytest.raises(NotImplementedError, match="host memory, but the tpu lacks it"):
        remat.checkpoint(jnp.sin, "offload")


@pytest.mark.parametrize("module", [remat, fsdp], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
