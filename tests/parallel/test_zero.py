"""ZeRO stages 0-3: AdamW training equals the one-device reference; each stage shards what it says.

Training: `accumulate(zero=...)` for the gradients, `ZeroOptimizer` for the
update, three AdamW steps on padded batches, against the same tiny LM on one
device with a plain `nnx.Optimizer` (rtol 1e-5, float32). Memory: bytes per
device of parameters, gradients and optimizer state from `addressable_shards`
(and the compiled step's `memory_analysis` for its arguments), against the
replicated totals divided by the fsdp size, for exactly the state the stage
shards.
"""

import doctest
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse.layers import ColumnParallelLinear, ParallelTransformerBlock
from shardfuse.parallel.accumulate import accumulate
from shardfuse.parallel.zero import ZeroOptimizer, shard_spec

# the modules themselves (sf.parallel exports a function named accumulate)
accumulate_module = importlib.import_module("shardfuse.parallel.accumulate")
zero_module = importlib.import_module("shardfuse.parallel.zero")
from tests.parallel.memory_cases import (  # noqa: E402
    assert_trees_close,
    batch_spec,
    for_mesh,
    make_lm,
    mesh_of,
    one_device_mesh,
    padded_batch,
    token_loss,
)

STEPS = 3


def _tx():
    return optax.adamw(1e-3, weight_decay=0.1)


def _train(mesh, zero, microbatches=2):
    model = make_lm(mesh, zero)
    optimizer = ZeroOptimizer(model, _tx(), mesh=mesh, zero=zero)
    grad_fn = accumulate(
        token_loss, microbatches, mesh=mesh, zero=zero, batch_spec=batch_spec(mesh)
    )

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = grad_fn(model, batch)
        optimizer.update(model, grads)
        return loss, grads

    for seed in range(STEPS):
        _, grads = step(model, optimizer, for_mesh(padded_batch(seed), mesh))
    return model, optimizer, grads, step


@pytest.fixture(scope="module")
def reference():
    model = make_lm(one_device_mesh())
    optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        def loss(model):
            s, n = token_loss(model, batch)
            return s / n

        grads = nnx.grad(loss)(model)
        optimizer.update(model, grads)

    for seed in range(STEPS):
        step(model, optimizer, padded_batch(seed))
    return nnx.state(model, nnx.Param)


CASES = [(zero, mesh) for mesh in ("data2-fsdp4", "fsdp2-seq2-model2") for zero in range(4)]


@pytest.mark.parametrize(
    "zero, mesh_name, explicit",
    [pytest.param(z, m, True, marks=pytest.mark.slow) for z, m in CASES]
    + [pytest.param(3, "fsdp2-seq2-model2", False, marks=pytest.mark.slow)],
)
def test_adamw_steps_match_reference(zero, mesh_name, explicit, reference):
    mesh = mesh_of(mesh_name, explicit)
    model, optimizer, grads, _ = _train(mesh, zero)
    assert_trees_close(nnx.state(model, nnx.Param), reference, rtol=1e-5, atol=1e-6)
    _check_shares(model, optimizer, grads, mesh, zero)
    assert int(optimizer.step[...]) == STEPS

    # parameters keep their own sharding through the update (ZeRO-1/2: gathered back)
    def entries(spec, ndim):  # Auto meshes drop trailing Nones
        return tuple(spec) + (None,) * (ndim - len(spec))

    for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        got, want = p[...].sharding.spec, p.get_metadata()["out_sharding"]
        assert entries(got, p[...].ndim) == entries(want, p[...].ndim), path


def _per_device(tree) -> tuple[int, int]:
    """(bytes on device 0, bytes of one copy over the non-fsdp axes) of the arrays of `tree`.

    The second figure is what a device would hold if nothing were sharded over
    fsdp (tensor-parallel sharding over `model` still applied).
    """
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    local = sum(x.addressable_shards[0].data.nbytes for x in arrays)

    def without_fsdp(x):
        mesh, shards = x.sharding.mesh, 1
        for entry in x.sharding.spec:
            for name in (entry,) if isinstance(entry, str) else entry or ():
                shards *= mesh.shape[name] if name != "fsdp" else 1
        return x.nbytes // shards

    return local, sum(without_fsdp(x) for x in arrays)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bytes_per_device_follow_the_stage(zero):
    mesh = mesh_of("data2-fsdp4")
    model, optimizer, grads, step = _train(mesh, zero, microbatches=1)
    shares = _check_shares(model, optimizer, grads, mesh, zero)
    # the compiled step receives exactly these shards (plus the batch)
    batch = padded_batch(0)
    arguments = step.lower(model, optimizer, batch).compile().memory_analysis()
    inputs = shares["parameters"][0] + shares["optimizer state"][0]
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch))
    assert inputs <= arguments.argument_size_in_bytes <= inputs + batch_bytes, shares


def _check_shares(model, optimizer, grads, mesh, zero):
    """Bytes per device of each state against its whole size / fsdp where the stage shards it."""
    fsdp = mesh.shape["fsdp"]
    shares = {
        "parameters": _per_device(nnx.state(model, nnx.Param)),
        "gradients": _per_device(grads),
        "optimizer state": _per_device(nnx.state(optimizer, nnx.OptState)),
    }
    sharded = {"parameters": zero >= 3, "gradients": zero >= 2, "optimizer state": zero >= 1}
    table = []
    for name, (local, total) in shares.items():
        table.append((name, local, total))
        if sharded[name]:  # within 2%: only the final norm [F] (4 bytes/feature) stays whole
            assert local <= 1.02 * total / fsdp + 16, (name, local, total)
        else:
            assert local == total, (name, local, total)
    return shares


def test_zero_bad_input():
    mesh = mesh_of("data2-fsdp4")
    with pytest.raises(ValueError, match=r"zero=4 must be one of \(0, 1, 2, 3\)"):
        ColumnParallelLinear(16, 32, mesh=mesh, zero=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"zero=4 must be one of"):
        ZeroOptimizer(
            ColumnParallelLinear(8, 8, mesh=mesh, rngs=nnx.Rngs(0)), _tx(), mesh=mesh, zero=4
        )
    with pytest.raises(
        ValueError, match=r"in_features=6 must be divisible by the size 4 of fsdp_axis"
    ):
        ColumnParallelLinear(6, 32, mesh=mesh, zero=3, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError, match=r"features=18 must be divisible by the size 4 of fsdp_axis"
    ):
        ParallelTransformerBlock(18, 1, 64, mesh=mesh, zero=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"fsdp_axis='shards' is not an axis of the mesh"):
        ColumnParallelLinear(16, 32, mesh=mesh, zero=3, fsdp_axis="shards", rngs=nnx.Rngs(0))
    # an array no dimension of which the axis divides stays replicated (optimizer state)
    assert shard_spec(P(), (6, 3), mesh, "fsdp") == P(None, None)
    assert shard_spec(P(None, "data"), (6, 8), mesh, "fsdp") == P(None, ("data", "fsdp"))


@pytest.mark.slow
@pytest.mark.parametrize("module", [zero_module, accumulate_module], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_zero3_mixed_precision_gathers_in_dtype_reduces_in_float32():
    mesh = jax.make_mesh((8,), ("fsdp",))
    for reduce_dtype, reduced in ((jnp.float32, "f32"), (None, "bf16")):
        layer = ColumnParallelLinear(
            16,
            32,
            mesh=mesh,
            zero=3,
            dtype=jnp.bfloat16,
            reduce_dtype=reduce_dtype,
            rngs=nnx.Rngs(0),
        )
        assert layer.kernel[...].dtype == jnp.float32  # param_dtype storage
        x = jnp.ones((8, 4, 16), jnp.float32)
        graphdef, state = nnx.split(layer)

        def loss(state, x, graphdef=graphdef):
            return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x).astype(jnp.float32)))

        grad = jax.jit(jax.grad(loss))
        # the program as JAX emits it (XLA:CPU then widens bf16 collectives to f32 itself)
        text = grad.lower(state, x).as_text()
        gathers = [line for line in text.splitlines() if "stablehlo.all_gather" in line]
        lines = text.splitlines()
        scatters = [  # a reduce_scatter's types follow its reduction region: "}) : (...) -> ..."
            next(rest for rest in lines[i:] if rest.lstrip().startswith("}) :"))
            for i, line in enumerate(lines)
            if "stablehlo.reduce_scatter" in line
        ]
        assert gathers and all(line.rstrip().endswith("bf16>") for line in gathers), gathers
        assert scatters and all(line.rstrip().endswith(f"x{reduced}>") for line in scatters)
        assert grad(state, x)["kernel"][...].dtype == jnp.float32


def _stack(mesh, reshard, layers=2):
    from shardfuse.layers.stack import Stack

    def block(rngs):
        return ParallelTransformerBlock(
            32, 4, 64, mesh=mesh, zero=3, reshard_after_forward=reshard, rngs=rngs
        )

    stack = Stack(block, layers, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (8, 16, 32)),
        jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))),
    )
    return loss, state, x


def _kernel_shapes(state):
    """The [in, out] kernel shapes of one layer (global view) of a stacked state."""
    return {tuple(v.shape[1:]) for v in jax.tree.leaves(state) if v.ndim == 3}  # [L, in, out]


def test_zero3_on_data_x_fsdp_saves_no_gathered_weight():
    """reshard_after_forward with activations that vary over more axes than fsdp (data).

    The gathered weight meets the activations through JAX's `pvary` cast; that
    cast's output must not become a saved residual (it would keep every
    layer's whole weight for the backward, as it did before this test).
    """
    from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints

    mesh = mesh_of("data2-fsdp4")
    L = 2
    for reshard in (True, False):
        loss, state, x = _stack(mesh, reshard, L)
        kernels = _kernel_shapes(state)
        with jax.set_mesh(mesh):
            saved = {tuple(a.shape) for a, _ in saved_residuals(loss, state, x)}
        # a gathered kernel as a residual: [L, in, out] with the fsdp-sharded dim whole, per
        # device of the 8 (the global view of a value varying over data and fsdp)
        whole = {(L, a * 8, b) for a, b in kernels} | {(L, a, b * 8) for a, b in kernels}
        assert bool(saved & whole) == (not reshard), (reshard, saved & whole)


@pytest.mark.slow  # one compile of a 2-layer stack's gradient: ~15-30 s on 2 cores
def test_zero3_on_data_x_fsdp_regathers_in_backward_and_reduces_shards_over_data():
    """The compiled gradient: every kernel gathered again in the backward, and the gradient's
    all-reduce over data on reduce-scattered shards (the cast to vary over data sits before
    the gather: `fsdp.gather(..., like=x)`), never on a whole kernel."""
    from tests.parallel import hlo_collectives

    mesh = mesh_of("data2-fsdp4")
    L = 2
    loss, state, x = _stack(mesh, True, L)
    kernels, fsdp = _kernel_shapes(state), mesh.shape["fsdp"]
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(state, x).compile().as_text()
    counts = hlo_collectives.count(hlo, mesh)
    # forward: qkv, o, up, down and two norm scales per layer; backward: the 4 kernels again
    assert hlo_collectives.total(counts, "all-gather", "fsdp") >= (6 + 4) * L
    largest_shard = max(a * b for a, b in kernels) // fsdp
    for line in hlo.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            result = line.split("=", 1)[1].split("all-reduce")[0]
            for dims in re.findall(r"f32\[([\d,]*)\]", result):
                size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                assert size <= largest_shard, line  # never a whole kernel over data


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_abstract_state_has_the_real_shardings(zero, explicit):
    """`nnx.eval_shape` of model + ZeroOptimizer (abstract state, for planning memory without
    allocating it) gives each state array the sharding the real one gets. On an explicit
    mesh the ZeRO-1 moments came out without their fsdp sharding (and ZeRO-3's replicated
    leaves too): the traced types followed the parameters, not `out_shardings`."""
    mesh = mesh_of("data2-fsdp4", explicit=explicit)

    def build():
        model = make_lm(mesh, zero)
        return model, ZeroOptimizer(model, _tx(), mesh=mesh, zero=zero)

    with jax.set_mesh(mesh):
        real = nnx.state(build()[1])
        abstract = nnx.state(nnx.eval_shape(build)[1])
    real_leaves = jax.tree_util.tree_leaves_with_path(real)
    abstract_leaves = jax.tree.leaves(abstract)
    assert len(real_leaves) == len(abstract_leaves) > 4

    def full(x):  # the spec with one entry per dimension (P() and P(None) are the same)
        return tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))

    fsdp_sharded = 0
    for (path, r), a in zip(real_leaves, abstract_leaves, strict=True):
        assert a.shape == r.shape and a.dtype == r.dtype, jax.tree_util.keystr(path)
        if explicit:  # an Auto mesh's types carry no sharding: eval_shape says replicated
            assert full(a) == full(r), jax.tree_util.keystr(path)
            fsdp_sharded += "fsdp" in str(a.sharding.spec)
    assert fsdp_sharded > 0 or not explicit or zero == 0


def test_a_resolved_zero_options_is_taken_as_it_is():
    """`zero=` of the optimizer (and of `accumulate`) is a stage or the run's `ZeroOptions`,
    resolved once on the mesh (`fsdp.zero_options`, the one check): the same state."""
    from shardfuse.layers import fsdp

    mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
    layer = ColumnParallelLinear(16, 32, mesh=mesh, rngs=nnx.Rngs(0))
    resolved = fsdp.zero_options(mesh, zero=1)
    assert fsdp.zero_options(mesh, zero=resolved) is resolved
    by_stage = ZeroOptimizer(layer, optax.adamw(1e-3), mesh=mesh, zero=1)
    by_options = ZeroOptimizer(layer, optax.adamw(1e-3), mesh=mesh, zero=resolved)
    assert (by_options.zero, by_options.fsdp_axis) == (by_stage.zero, by_stage.fsdp_axis) == (
        1, "fsdp"
    )  # fmt: skip
    spec = by_options.opt_state[0].mu["kernel"][...].sharding.spec
    assert spec == by_stage.opt_state[0].mu["kernel"][...].sharding.spec == P("fsdp", "model")
    assert fsdp.zero_options(jax.make_mesh((8,), ("data",)), zero=2).fsdp_axis is None
    with pytest.raises(ValueError, match="fsdp_axis='shard' is not an axis of the mesh"):
        fsdp.zero_options(mesh, zero=2, fsdp_axis="shard")
