"""`Stack(prefetch=True)`: ZeRO-3 next-layer weight prefetch equals the plain layer scan.

The oracle is the same stack with `prefetch=False` (ZeRO-3 blocks gathering
their own weights, itself tested against unsharded references in
`tests/parallel/test_zero.py`): same output, same gradients (parameters and
input) and the same shardings, under `jax.jit` of the gradient. Structure
(compiled HLO, loops counted by their trips): each fsdp-sharded parameter
all-gathered once per layer in the forward and once in the backward, the
gradients reduce-scattered over fsdp and summed over data on the shards (no
all-reduce of a whole kernel). Memory (compiled temp): flat in the number of
layers, never the whole stack gathered.
"""

import doctest
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core
from jax.sharding import AxisType, NamedSharding

import shardfuse as sf
from shardfuse._compat import scan_operand_counts
from shardfuse.layers import prefetch, prefetch_plan
from shardfuse.layers.stack import Stack
from tests.parallel import hlo_collectives

# per layer of the test block: q, kv, o, mlp up, mlp down kernels and the two norm scales
GATHERED_PER_LAYER = 7


def _mesh(explicit=True, shape=(2, 4), names=("data", "fsdp")):
    types = None if explicit else (AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types)


def _stack(mesh, prefetch, layers, remat="none", **kwargs):
    def block(rngs):
        return sf.layers.ParallelTransformerBlock(32, 4, 64, mesh=mesh, zero=3, rngs=rngs, **kwargs)

    return Stack(block, layers, mesh=mesh, remat=remat, prefetch=prefetch, rngs=nnx.Rngs(0))


def _inputs(stack, mesh, dtype=jnp.float32):
    spec = stack.blocks.io_spec()
    x = jax.random.normal(jax.random.key(1), (8, 16, 32), jnp.float32).astype(dtype)
    x = jax.device_put(x, NamedSharding(mesh, spec))
    cotangent = jax.random.normal(jax.random.key(2), x.shape, jnp.float32).astype(dtype)
    return x, cotangent


def _program(stack, mesh, x, cotangent, **keywords):
    """Compiled `(state, x) -> (y, (grad_state, grad_x))` of the stack, and its result.

    The compiled program carries the StableHLO it came from as `stablehlo`.
    """
    graphdef, state = nnx.split(stack)

    def forward_backward(state, x):
        y, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x, **keywords), state, x)
        return y, vjp(cotangent)

    with jax.set_mesh(mesh):
        lowered = jax.jit(forward_backward).lower(state, x)
        compiled = lowered.compile()
        compiled.stablehlo = lowered.as_text()
        return compiled, compiled(state, x)


def _assert_same(got, want, *, rtol=1e-5, atol=4e-5):
    """Every leaf finite, equal within tolerance, same dtype and equivalent sharding."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a32).all() and np.isfinite(b32).all()
        np.testing.assert_allclose(a32, b32, rtol=rtol, atol=atol)


def _gathered_layer_bytes(stack):
    """Per device: one layer's fsdp-sharded parameters made whole (no other axis shards them)."""
    total = 0
    for value in jax.tree.leaves(nnx.state(stack.blocks)):
        if "fsdp" in jax.tree.leaves(tuple(value.sharding.spec)):
            total += value[0].size * value.dtype.itemsize
    return total


def _check_structure(hlo, mesh, layers, largest_shard):
    counts = hlo_collectives.count(hlo, mesh)
    gathers = hlo_collectives.total(counts, "all-gather", "fsdp")
    scatters = hlo_collectives.total(counts, "reduce-scatter", "fsdp")
    # once per layer in the forward, once in the backward; one reduce-scatter per layer
    assert gathers == 2 * layers * GATHERED_PER_LAYER, counts
    assert scatters == layers * GATHERED_PER_LAYER, counts
    assert hlo_collectives.total(counts, "all-reduce", "fsdp") == 0, counts
    for line in hlo.splitlines():  # summed over data on shards, never on a whole kernel
        if " all-reduce(" in line or " all-reduce-start(" in line:
            result = line.split("=", 1)[1].split("all-reduce")[0]
            for dims in re.findall(r"f32\[([\d,]*)\]", result):
                size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                assert size <= largest_shard, line
    return counts


def _largest_shard(stack):
    return max(v[0].size for v in jax.tree.leaves(nnx.state(stack.blocks))) // 4


@pytest.mark.parametrize(
    "explicit, layers",
    [(True, 2), pytest.param(False, 3, marks=pytest.mark.slow)],
    ids=["explicit-L2", "auto-L3"],
)
def test_prefetch_equals_plain_scan_values_gradients_shardings_and_collectives(explicit, layers):
    mesh = _mesh(explicit)
    plain, fetched = (_stack(mesh, flag, layers) for flag in (False, True))
    x, cotangent = _inputs(plain, mesh)
    _, want = _program(plain, mesh, x, cotangent)
    compiled, got = _program(fetched, mesh, x, cotangent)
    _assert_same(got, want)
    _check_structure(compiled.as_text(), mesh, layers, _largest_shard(fetched))


def _subjaxprs(eqn):
    for param in eqn.params.values():
        for value in param if isinstance(param, (tuple, list)) else (param,):
            jaxpr = getattr(value, "jaxpr", value)
            if hasattr(jaxpr, "eqns"):
                yield jaxpr


def _gathers(jaxpr) -> bool:
    return any(
        eqn.primitive.name == "all_gather" or any(_gathers(s) for s in _subjaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _scans(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in _subjaxprs(eqn):
            yield from _scans(sub)


def test_next_gather_does_not_depend_on_the_current_layer():
    """In both layer scans of the gradient's jaxpr (forward, reverse backward), the 7 gathers
    of the body read no value computed from the carried activations (or cotangent): nothing
    orders them after the layer's compute, so async collectives can overlap the two."""
    mesh = _mesh()
    stack = _stack(mesh, True, 3)
    graphdef, state = nnx.split(stack)
    loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x))  # noqa: E731
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(state, jnp.ones((8, 16, 32))).jaxpr
    found = []
    for scan in _scans(jaxpr):
        body = scan.params["jaxpr"].jaxpr
        gathers = [
            eqn
            for eqn in body.eqns
            if eqn.primitive.name != "scan"
            and (eqn.primitive.name == "all_gather" or any(map(_gathers, _subjaxprs(eqn))))
        ]
        if not gathers:
            continue
        num_consts, _ = scan_operand_counts(scan.params)
        tainted = {body.invars[num_consts]}  # activations / cotangent carry
        for eqn in body.eqns:
            if any(isinstance(v, jax_core.Var) and v in tainted for v in eqn.invars):
                tainted.update(eqn.outvars)
        assert tainted & set(body.outvars), "the layer's output must depend on its input"
        dependent = [
            g
            for g in gathers
            if any(isinstance(v, jax_core.Var) and v in tainted for v in g.invars)
        ]
        found.append((scan.params["reverse"], len(gathers), len(dependent)))
    assert sorted(found) == [(False, GATHERED_PER_LAYER, 0), (True, GATHERED_PER_LAYER, 0)], found


def test_bad_arguments():
    mesh = _mesh()

    def mlp(**kwargs):
        return lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=mesh, rngs=rngs, **kwargs)

    with pytest.raises(ValueError, match="prefetch='yes' must be True or False"):
        Stack(mlp(zero=3), 2, mesh=mesh, prefetch="yes", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs blocks built with zero=3 over one fsdp axis"):
        Stack(mlp(), 2, mesh=mesh, prefetch=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs blocks built with zero=3"):
        Stack(mlp(zero=2), 2, mesh=mesh, prefetch=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="down was built with reshard_after_forward=False"):
        Stack(
            mlp(zero=3, reshard_after_forward=False), 2, mesh=mesh, prefetch=True, rngs=nnx.Rngs(0)
        )
    no_fsdp = jax.make_mesh((8,), ("data",))
    with pytest.raises(ValueError, match="shard weights over no axis"):
        Stack(
            lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=no_fsdp, zero=3, rngs=rngs),
            2,
            mesh=no_fsdp,
            prefetch=True,
            rngs=nnx.Rngs(0),
        )
    one = jax.make_mesh((8, 1), ("data", "fsdp"))
    with pytest.raises(ValueError, match="fsdp axis of size > 1; 'fsdp' has size 1"):
        Stack(
            lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=one, zero=3, rngs=rngs),
            2,
            mesh=one,
            prefetch=True,
            rngs=nnx.Rngs(0),
        )
    piped = jax.make_mesh((2, 4), ("pipeline", "fsdp"))
    with pytest.raises(ValueError, match="layer_axis='pipeline' shards them over a pipeline"):
        Stack(
            lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=piped, zero=3, rngs=rngs),
            2,
            mesh=piped,
            layer_axis="pipeline",
            prefetch=True,
            rngs=nnx.Rngs(0),
        )
    stack = _stack(mesh, True, 1)
    # the blocks' own input checks run in the global view, before the per-shard program
    with pytest.raises(ValueError, match=r"x has shape \(8, 16, 33\); expected \[B, T, features"):
        stack(jnp.ones((8, 16, 33)))
    with pytest.raises(ValueError, match="batch size B=6 must be divisible by the size 8"):
        stack(jnp.ones((6, 16, 32)))
    with pytest.raises(ValueError, match=r"positions must be int \[T\] = \(16,\)"):
        stack(jnp.ones((8, 16, 32)), positions=jnp.arange(15))
    plan = prefetch.make_plan(stack.blocks, mesh)
    with pytest.raises(ValueError, match="mask=ndarray: with prefetch=True the blocks take only"):
        prefetch.check_keywords(plan, {"mask": np.ones(4)})
    with pytest.raises(TypeError, match="segment_ids has dtype float32; with prefetch=True"):
        prefetch.check_keywords(plan, {"segment_ids": jnp.ones((8, 16))})


@pytest.mark.slow  # two compiles of a 2-layer and an 8-layer gradient: ~10 s
def test_compiled_temp_memory_does_not_hold_the_stack_gathered():
    """Compiled temp memory per device, gradient step (y and vjp), float32, (data 2, fsdp 4).

    Measured (jax 0.10.2, CPU), one gathered layer = 41,216 bytes:
    | L | prefetch=False | prefetch=True | L gathered layers |
    | 2 | 192,600 | 202,096 | 82,432 |
    | 4 | 308,824 | 181,688 | 164,864 |
    | 8 | 541,272 | 189,880 | 329,728 |
    prefetch: flat in L (under five gathered layers: the current one, the
    prefetched one, the weight cotangent whole over fsdp, loop double
    buffers); the plain scan grows with each layer's saved activations.
    """
    mesh = _mesh()
    temps = {}
    for layers in (2, 8):
        stack = _stack(mesh, True, layers)
        x, cotangent = _inputs(stack, mesh)
        compiled, _ = _program(stack, mesh, x, cotangent)
        temps[layers] = compiled.memory_analysis().temp_size_in_bytes
    layer_bytes = _gathered_layer_bytes(stack)
    assert layer_bytes == 4 * (32 * 32 + 32 * 64 + 32 * 32 + 32 * 128 + 64 * 32 + 2 * 32)
    # six more layers add less than half a gathered layer; 8 layers hold less than 5 gathered
    assert temps[8] - temps[2] < layer_bytes // 2, temps
    assert temps[8] < 5 * layer_bytes < 8 * layer_bytes, (temps, layer_bytes)


@pytest.mark.slow  # ring attention and a model axis: two compiles
def test_prefetch_on_fsdp_sequence_model_mesh_with_segment_ids():
    mesh = _mesh(True, (2, 2, 2), ("fsdp", "sequence", "model"))
    plain, fetched = (_stack(mesh, flag, 3, num_kv_heads=2) for flag in (False, True))
    x, cotangent = _inputs(plain, mesh)
    segments = jnp.asarray(np.repeat([[0] * 10 + [1] * 6], 8, axis=0), jnp.int32)
    _, want = _program(plain, mesh, x, cotangent, segment_ids=segments)
    compiled, got = _program(fetched, mesh, x, cotangent, segment_ids=segments)
    _assert_same(got, want)
    counts = hlo_collectives.count(compiled.as_text(), mesh)
    assert hlo_collectives.total(counts, "all-gather", "fsdp") == 2 * 3 * GATHERED_PER_LAYER


@pytest.mark.slow  # bfloat16 compute: gathered in bfloat16, reduced in float32
@pytest.mark.parametrize("remat", ["full", "selective"])
def test_prefetch_mixed_precision_and_remat(remat):
    mesh = _mesh(False)
    kwargs = dict(dtype=jnp.bfloat16)
    plain, fetched = (_stack(mesh, flag, 3, remat, **kwargs) for flag in (False, True))
    x, cotangent = _inputs(plain, mesh, jnp.bfloat16)
    _, want = _program(plain, mesh, x, cotangent)
    compiled, got = _program(fetched, mesh, x, cotangent)
    # same bfloat16 math in another order: within the bf16 rounding of the plain path
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.dtype == b.dtype and np.isfinite(a32).all()
        assert np.max(np.abs(a32 - b32)) <= 1e-2 * np.max(np.abs(b32)) + 1e-6
    # every kernel gathered in bfloat16 (XLA:CPU then runs bf16 collectives in f32: the
    # program JAX hands XLA is checked), only the norm scales `[32]` in their float32
    pattern = r"stablehlo.all_gather.*?->\s*tensor<([\dx]+x(?:bf16|f32))>"
    gathers = re.findall(pattern, compiled.stablehlo)
    assert gathers and all(g.endswith("bf16") or g == "32xf32" for g in gathers), gathers
    assert sum(g.endswith("bf16") for g in gathers) >= 5, gathers


@pytest.mark.slow
def test_prefetch_in_a_manual_region_equals_plain_scan():
    """Inside one shard_map over every mesh axis (how `sf.parallel` runs models)."""
    mesh = _mesh()
    plain, fetched = (_stack(mesh, flag, 3) for flag in (False, True))
    x, cotangent = _inputs(plain, mesh)
    _, want = _program(plain, mesh, x, cotangent)
    graphdef, state = nnx.split(fetched)
    spec = fetched.blocks.io_spec()
    specs = nnx.get_partition_spec(state)

    def forward_backward(state, x):
        run = jax.shard_map(
            lambda s, x: nnx.merge(graphdef, s)(x),
            mesh=mesh,
            in_specs=(specs, spec),
            out_specs=spec,
        )
        y, vjp = jax.vjp(run, state, x)
        return y, vjp(cotangent)

    with jax.set_mesh(mesh):
        got = jax.jit(forward_backward)(state, x)
    _assert_same(got, want)


@pytest.mark.slow
def test_prefetch_under_accumulate_zero3_equals_plain_scan():
    """`sf.parallel.accumulate` (2 microbatches, padding mask) runs the stack per shard."""
    from shardfuse.parallel.accumulate import accumulate

    mesh = _mesh()

    def loss_fn(model, batch):
        y = model(batch["x"])
        return jnp.sum(batch["mask"] * jnp.sum(y * y, -1)), jnp.sum(batch["mask"])

    x = jax.random.normal(jax.random.key(3), (16, 16, 32))
    batch = dict(x=x, mask=jnp.ones((16, 16)).at[:, 12:].set(0))
    step = nnx.jit(lambda model, batch: accumulate(loss_fn, 2, mesh=mesh, zero=3)(model, batch))
    want = step(_stack(mesh, False, 3), batch)
    got = step(_stack(mesh, True, 3), batch)
    _assert_same(got, want)


@pytest.mark.slow
def test_empty_batch_gives_empty_output_and_zero_gradients():
    mesh = _mesh()
    stack = _stack(mesh, True, 2)
    x = jnp.zeros((0, 16, 32))
    graphdef, state = nnx.split(stack)
    y, grads = jax.jit(
        jax.value_and_grad(lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x)), argnums=(0, 1))
    )(state, x)
    assert float(y) == 0.0
    assert all(not np.asarray(g).any() for g in jax.tree.leaves(grads))


@pytest.mark.slow
@pytest.mark.parametrize("module", [prefetch, prefetch_plan], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_prefetch_reruns_what_full_remat_reruns_but_the_last_layer():
    """The executed work of the prefetching scan, counted in the compiled gradient (dot FLOPs,
    loop bodies times their trip counts), and the planner's price of it (`sf.flops`,
    `RunOptions(prefetch=True)`): both rerun the forward of every layer but the last, as
    remat "full" does every layer's, so prefetch's extra work is (L - 1) / L of full's."""
    from shardfuse import flops
    from tests.parallel.pipeline_flops import executed_flops

    mesh, layers = _mesh(), 4

    def counted(prefetch, remat="none"):
        def block(rngs):
            return sf.layers.ParallelMLP(32, 64, mesh=mesh, zero=3, rngs=rngs)

        stack = Stack(block, layers, mesh=mesh, remat=remat, prefetch=prefetch, rngs=nnx.Rngs(0))
        grad = nnx.jit(nnx.grad(lambda stack, x: jnp.sum(stack(x) ** 2)))
        with jax.set_mesh(mesh):
            return executed_flops(grad.lower(stack, jnp.ones((8, 16, 32))).compile().as_text())

    plain, full, fetched = counted(False), counted(False, "full"), counted(True)
    assert fetched - plain == pytest.approx((full - plain) * (layers - 1) / layers, rel=1e-12)
    spec = sf.models.ModelSpec.tiny(num_layers=layers)
    price = {
        name: flops.hardware_flops(spec, seq_len=64, remat=remat, prefetch=prefetch)
        for name, remat, prefetch in (("plain", "none", False), ("full", "full", False),
                                      ("fetched", "none", True))
    }  # fmt: skip
    extra, full_extra = price["fetched"] - price["plain"], price["full"] - price["plain"]
    assert extra == pytest.approx(full_extra * (layers - 1) / layers, rel=1e-12)
