"""Sharded initialization: the same seed gives the same values on every mesh; nothing born whole.

The layers create each parameter with a jitted initializer whose
`out_shardings` is the parameter's spec, and `sf.parallel.zero.init` creates
the whole model in one such program. With `jax_threefry_partitionable` (JAX's
default) the random values depend on the key only, not on how the output is
split (jax#40232 was values changing with the mesh shape).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse.demos.tiny_lm import TinyLM
from shardfuse.parallel.zero import init, init_program
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


@pytest.mark.slow
def test_init_program_equals_eager_and_shards_the_optimizer():
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    model, optimizer = init(lambda: make_lm(mesh, 3), tx=optax.adamw(1e-3), mesh=mesh, zero=3)
    eager = _values(make_lm(mesh, 3))
    for path, value in _values(model).items():
        np.testing.assert_array_equal(value, eager[path], err_msg=str(path))
    kernel = model.blocks[0].mlp.up.kernel[...]
    assert kernel.sharding.spec == P("fsdp", None)
    mu = optimizer.opt_state[0].mu["blocks"][0]["mlp"]["up"]["kernel"][...]
    assert mu.sharding.spec == P("fsdp", None)


@pytest.mark.slow
def test_init_never_holds_a_whole_parameter():
    """Peak memory per device of the compiled init, against the sharded and the whole state.

    Measured (8 CPU devices, F=256, 2 blocks, zero=3): output 1.25 MB per device,
    temporaries 1.97 MB: the threefry bits take about 3x a parameter's shard while
    it is generated. The 1.1x target of issue 14 is not met; what is guaranteed is
    that no device ever holds a parameter whole (the replicated state is 8x).
    """
    mesh = jax.make_mesh((8,), ("fsdp",))

    def make():
        return TinyLM(
            vocab=1024,
            features=256,
            heads=4,
            kv_heads=2,
            hidden=1024,
            layers=2,
            mesh=mesh,
            rngs=nnx.Rngs(0),
            zero=3,
        )

    graphdef, create = init_program(make)
    memory = create.lower().compile().memory_analysis()
    sharded = memory.output_size_in_bytes
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(create)))
    peak = memory.output_size_in_bytes + memory.temp_size_in_bytes
    assert sharded <= 1.02 * whole / 8 + 4096
    assert peak < whole / 2, (peak, sharded, whole)
