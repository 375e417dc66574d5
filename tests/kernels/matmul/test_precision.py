"""`precision=` of sf.matmul, the collective matmuls and the layers reaches every dot_general.

On CPU every float32 precision computes the same, so the tests read the
precision off the traced program instead of off the numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.testing import dot_precisions

A = jnp.ones((8, 16), jnp.float32)
B = jnp.ones((16, 4), jnp.float32)


@pytest.mark.parametrize(
    "precision, expected",
    [(None, {"HIGHEST"}), ("default", {"DEFAULT"}), (jax.lax.Precision.HIGH, {"HIGH"})],
)
def test_matmul_precision(precision, expected):
    for implementation in ("reference", "xla"):
        fn = lambda a, b, i=implementation: sf.matmul(a, b, precision=precision, implementation=i)
        assert dot_precisions(fn, A, B) == expected
        grad = jax.grad(lambda a, b, f=fn: f(a, b).sum(), (0, 1))
        assert dot_precisions(grad, A, B) == expected


def test_bfloat16_default_is_default():
    assert dot_precisions(
        lambda a, b: sf.matmul(a, b), A.astype(jnp.bfloat16), B.astype(jnp.bfloat16)
    ) == {"DEFAULT"}


def test_bad_precision():
    with pytest.raises(ValueError, match=r"precision='fast' must be None, a jax.lax.Precision"):
        sf.matmul(A, B, precision="fast")


def test_fixed_precision_kernels_refuse_and_dispatch_falls_back():
    with pytest.raises(NotImplementedError, match="precision=DEFAULT needs the xla implementation"):
        sf.matmul(A, B, precision="default", implementation="pallas_tpu")
    np.testing.assert_allclose(sf.matmul(A, B, precision="default"), A @ B)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"])
@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_collective_precision_forward_and_backward(op, implementation):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("model",))
    collective = getattr(sf.collectives, op)
    in_specs = (P("model"), P()) if op == "all_gather_matmul" else (P(None, "model"), P("model"))
    out_spec = {
        "all_gather_matmul": P(),
        "matmul_reduce_scatter": P("model"),
        "matmul_all_reduce": P(),
    }[op]
    f = jax.shard_map(
        lambda x, w: collective(x, w, "model", precision="default", implementation=implementation),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_spec,
        check_vma=False,
    )
    assert dot_precisions(f, A, B) == {"DEFAULT"}
    assert dot_precisions(jax.grad(lambda x, w: f(x, w).sum(), (0, 1)), A, B) == {"DEFAULT"}


@pytest.mark.slow
def test_layers_pass_precision():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
    for precision, expected in ((None, {"HIGHEST"}), ("high", {"HIGH"})):
        block = sf.layers.ParallelTransformerBlock(
            16, 2, 32, mesh=mesh, precision=precision, rngs=nnx.Rngs(0)
        )
        graphdef, state = nnx.split(block)
        found = dot_precisions(
            lambda s, x, g=graphdef: nnx.merge(g, s)(x), state, jnp.ones((1, 8, 16))
        )
        # Attention scores keep the attention kernel's own precision (HIGHEST for float32).
        assert found - {"HIGHEST"} == expected - {"HIGHEST"} and expected <= found
