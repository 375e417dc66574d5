"""Sharded initialization: same values on every mesh; the compiled init within 1.1x of its state.

The layers create each parameter with a jitted initializer whose
`out_shardings` is the parameter's spec (`sf.layers.sharded_param`), and
`sf.parallel.zero.init` creates the whole model in one such program. With
`jax_threefry_partitionable` (JAX's default) the random values depend on the
key only, not on how the output is split (jax#40232 was values changing with
the mesh shape). The key reaches the initializer as `_init_random.fused_key`:
the same bits, computed by an unrolled threefry that XLA fuses with the
initializer, so each shard is generated in place (on CPU, JAX's own threefry
is a rolled loop that cannot fuse: the init program peaked at 2.6x).
"""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.layers import _init_random
from shardfuse.layers._init_random import FUSED_THREEFRY, fused_key
from shardfuse.layers.stack import Stack
from shardfuse.models import ModelSpec, Transformer
from shardfuse.parallel.zero import init, init_program, optimizer_state_program
from tests.parallel.memory_cases import make_lm, one_device_mesh

MESHES = [((8,), ("fsdp",)), ((2, 4), ("data", "fsdp")), ((4, 2), ("fsdp", "model"))]


def _values(model):
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="module")
def one_device_values():
    return _values(make_lm(one_device_mesh()))


@pytest.mark.parametrize(
    "shape, names, zero",
    [
        pytest.param(*MESHES[0], 3, marks=pytest.mark.slow),
        pytest.param(*MESHES[1], 3),
        pytest.param(*MESHES[2], 3, marks=pytest.mark.slow),
        pytest.param(*MESHES[2], 0, marks=pytest.mark.slow),
    ],
)
def test_same_seed_same_values_on_every_mesh(shape, names, zero, one_device_values):
    assert jax.config.jax_threefry_partitionable
    want = one_device_values
    got = _values(make_lm(jax.make_mesh(shape, names), zero))
    assert got.keys() == want.keys()
    for path in want:  # bitwise
        np.testing.assert_array_equal(got[path], want[path], err_msg=f"{shape} {path}")


INITIALIZERS = {
    "lecun_normal": nnx.initializers.lecun_normal(),  # truncated normal: uniform, erf_inv
    "normal": nnx.initializers.normal(0.02),
    "uniform": nnx.initializers.uniform(),
    "bits8": lambda key, shape, dtype: jax.random.bits(key, shape, jnp.uint8),
}


DRAWS = [  # (initializer, shape, dtype)
    ("lecun_normal", (257, 3), jnp.float32),
    ("normal", (), jnp.float32),
    ("normal", (2, 9, 13), jnp.float32),
    ("uniform", (3, 5), jnp.bfloat16),
    ("bits8", (9, 13), None),
]


def _draws(key, fuse):
    """Every draw of `DRAWS`, and a vmapped one (a `Stack`'s layers), in one program."""
    wrap = fused_key if fuse else lambda k: k
    draws = [INITIALIZERS[name](wrap(key), shape, dtype) for name, shape, dtype in DRAWS]
    keys = jax.random.split(key, 3)
    return [*draws, jax.vmap(lambda k: jax.random.normal(wrap(k), (4, 6)))(keys)]


def _ulps(a, b) -> int:
    """The largest distance between `a` and `b` in units in the last place (float32)."""
    a, b = (np.asarray(x, np.float32).view(np.int32).astype(np.int64) for x in (a, b))
    return int(np.max(np.abs(a - b), initial=0))


def test_fused_key_gives_threefry_values_bitwise():
    """The same bits as the threefry key, bitwise; the same values (both jitted: eager rounding
    may differ) to the last place or two: newer XLA compiles `erf_inv` (the truncated normal)
    differently once it is fused with the hash into one loop, e.g. 19 of 771 lecun_normal
    values 1-2 ulps apart on jax 0.12 (bitwise on jax 0.10), from bitwise equal uniforms."""
    key = jax.random.key(7)
    bits = [jax.random.bits(key, shape) for _, shape, _ in DRAWS]
    fused_bits = jax.jit(lambda k: [jax.random.bits(fused_key(k), s) for _, s, _ in DRAWS])(key)
    for case, a, b in zip(DRAWS, fused_bits, bits, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"bits {case}")
    want = jax.jit(_draws, static_argnums=1)(key, False)
    got = jax.jit(_draws, static_argnums=1)(key, True)
    for case, a, b in zip([*DRAWS, "vmap"], got, want, strict=True):
        if jnp.issubdtype(a.dtype, jnp.floating):
            assert _ulps(a, b) <= 2, (case, _ulps(a, b))
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(case))
    normal = INITIALIZERS["normal"]  # a raw uint32[2] key too
    from_raw = jax.jit(lambda k: normal(fused_key(k), (2, 9, 13)))(jax.random.PRNGKey(7))
    np.testing.assert_array_equal(np.asarray(from_raw), np.asarray(want[2]))
    # split keys stay fused, with threefry's key data
    split = jax.random.split(fused_key(key))
    assert jax.random.key_impl(split) == FUSED_THREEFRY
    np.testing.assert_array_equal(
        jax.random.key_data(split), jax.random.key_data(jax.random.split(key))
    )
    # other implementations pass through
    rbg = jax.random.key(0, impl="rbg")
    assert fused_key(rbg) is rbg

    # the fused hash lowers to elementwise ops, no loop (JAX's CPU threefry is a while
    # loop); 2**32 elements or more take threefry's own bits
    def lowered(shape):
        return jax.jit(lambda k: jax.random.bits(fused_key(k), shape)).lower(key).as_text()

    assert "stablehlo.while" not in lowered((4, 8))
    assert "stablehlo.while" in lowered((2**16, 2**16))


def _tiny_lm(mesh):
    """Issue 14's case: vocab 1024, F 256, hidden 1024, 2 blocks, ZeRO-3."""
    spec = ModelSpec.tiny(vocab_size=1024, hidden=256, ffn_hidden=1024, num_layers=2)
    return Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0), zero=3)


def _odd_lm(mesh):
    """Odd sizes: vocab 1000, F 96, 6 heads (2 kv), hidden 344, 3 blocks, ZeRO-3."""
    spec = ModelSpec.tiny(vocab_size=1000, hidden=96, heads=6, ffn_hidden=344, num_layers=3)
    return Transformer(spec, mesh=mesh, rngs=nnx.Rngs(0), zero=3)


def _pipeline_stack(mesh):
    """A `Stack` of 4 blocks over (pipeline 2, fsdp 4): each stage creates its own layers."""
    return Stack(
        lambda rngs: sf.layers.ParallelTransformerBlock(
            128, 4, 512, num_kv_heads=2, mesh=mesh, zero=3, rngs=rngs
        ),
        4,
        mesh=mesh,
        layer_axis="pipeline",
        rngs=nnx.Rngs(0),
    )


def _state_bytes_per_device(tree) -> int:
    """Bytes of this device's shards of `tree`'s arrays (abstract, with shardings)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard)) * jnp.dtype(leaf.dtype).itemsize
    return total


def _whole_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _peak_over_state(memory, state_bytes) -> float:
    """(output + temporaries) / sharded state, after checking that the output IS that state."""
    assert memory.argument_size_in_bytes == 0
    assert state_bytes <= memory.output_size_in_bytes <= 1.01 * state_bytes + 4096
    return (memory.output_size_in_bytes + memory.temp_size_in_bytes) / state_bytes


CASES = {
    "tiny-fsdp8": (_tiny_lm, (8,), ("fsdp",), False),
    "odd-fsdp4-model2-auto": (_odd_lm, (4, 2), ("fsdp", "model"), True),
    "stack-pipeline2-fsdp4": (_pipeline_stack, (2, 4), ("pipeline", "fsdp"), False),
}


@pytest.mark.parametrize(
    "case",
    [
        "tiny-fsdp8",
        "stack-pipeline2-fsdp4",
        pytest.param("odd-fsdp4-model2-auto", marks=pytest.mark.slow),
    ],
)
def test_init_peak_within_1_1x_of_the_sharded_state(case):
    """Compiled init: output == the sharded state, peak (output + temp) <= 1.1x it.

    Measured (8 CPU devices, jax 0.10.2), bytes per device:

    | case (`CASES`; ZeRO-3) | sharded state | temp | peak/state | before |
    |---|---|---|---|---|
    | tiny LM, fsdp 8 | 1,246,720 | 6,660 | 1.006 | 2.58 |
    | its AdamW state, fsdp 8 | 2,491,652 | 0 | 1.000 | 1.000 |
    | odd LM, fsdp 4 x model 2 (Auto) | 330,432 | 9,220 | 1.029 | 2.94 |
    | Stack of 4 blocks, pipeline 2 x fsdp 4 | 492,032 | 3,204 | 1.007 | 3.40 |

    "before": JAX's own threefry key, whose CPU lowering is a rolled loop
    carrying both 32-bit words of every element (1.97 MB for the tiny LM);
    the Stack was at about 5x before it also split the layer axis (every
    pipeline stage used to create every layer). What is left are the key
    splits: a few kB, whatever the model's size. Arguments: none.
    """
    make_model, shape, names, auto = CASES[case]
    types = (AxisType.Auto,) * len(shape) if auto else None
    mesh = jax.make_mesh(shape, names, axis_types=types)
    graphdef, create = init_program(lambda: make_model(mesh))
    abstract = jax.eval_shape(create)
    sharded = _state_bytes_per_device(abstract)
    memory = create.lower().compile().memory_analysis()
    ratio = _peak_over_state(memory, sharded)
    assert ratio <= 1.1, (case, ratio, memory)
    if case != "tiny-fsdp8":
        return
    # ZeRO-3 on fsdp 8: every parameter but the norm scales is split 8 ways
    assert sharded <= 1.01 * _whole_bytes(abstract) / 8 + 4096
    # the AdamW state (ZeRO-3): its init program holds nothing but its output
    model = nnx.merge(graphdef, create())
    make_state, params = optimizer_state_program(model, optax.adamw(1e-3), mesh=mesh, zero=3)
    compiled = make_state.lower(params).compile()
    state_bytes = _state_bytes_per_device(jax.eval_shape(make_state, params))
    memory = compiled.memory_analysis()
    peak = memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert state_bytes <= memory.output_size_in_bytes <= 1.01 * state_bytes + 4096
    assert peak <= 1.1 * state_bytes, (peak, state_bytes)
    assert state_bytes <= 2.02 * sharded + 4096  # mu and nu, sharded like the parameters


@pytest.mark.slow
def test_init_program_equals_eager_and_shards_the_optimizer():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    model, optimizer = init(lambda: make_lm(mesh, 3), tx=optax.adamw(1e-3), mesh=mesh, zero=3)
    eager = _values(make_lm(mesh, 3))
    for path, value in _values(model).items():
        np.testing.assert_array_equal(value, eager[path], err_msg=str(path))
    # the blocks are one scanned Stack: kernels [layers, in, out], ZeRO-3 shards `in`
    kernel = model.blocks.blocks.mlp.up.kernel[...]
    assert tuple(kernel.sharding.spec) + (None,) * (3 - len(kernel.sharding.spec)) == (
        None, "fsdp", None,
    )  # fmt: skip
    mu = optimizer.opt_state[0].mu["blocks"]["blocks"]["mlp"]["up"]["kernel"][...]
    assert tuple(mu.sharding.spec) + (None,) * (3 - len(mu.sharding.spec)) == (None, "fsdp", None)


def _mlp_stack(mesh, layer_axis):
    return Stack(
        lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=mesh, zero=3, rngs=rngs),
        4,
        mesh=mesh,
        layer_axis=layer_axis,
        rngs=nnx.Rngs(0),
    )


def test_stack_values_are_the_blocks_and_mesh_invariant():
    """Layer l is `make_block(nnx.Rngs(key l))`, on a pipeline x fsdp mesh as on one device."""
    mesh = jax.make_mesh((2, 4), ("pipeline", "fsdp"))
    stack = _mlp_stack(mesh, "pipeline")
    kernel = stack.blocks.up.kernel[...]
    assert kernel.sharding == NamedSharding(mesh, P("pipeline", "fsdp", None))
    one = _mlp_stack(one_device_mesh(), None)
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(one.blocks.up.kernel[...]))
    keys = jax.random.split(nnx.Rngs(0).params(), 4)
    block = sf.layers.ParallelMLP(16, 32, mesh=one_device_mesh(), rngs=nnx.Rngs(keys[2]))
    np.testing.assert_array_equal(np.asarray(kernel)[2], np.asarray(block.up.kernel[...]))


def test_docstring_examples():
    result = doctest.testmod(_init_random, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
