"""pallas_tpu decode attention lowers for TPU (Mosaic) from this CPU host: `jax.export` with
`platforms=["tpu"]` runs the Pallas -> Mosaic lowering (block shapes, the tiling rule, the ops
the kernel uses), so a Mosaic mistake fails here rather than on a TPU."""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode
from tests.kernels.decode_attention.decode_backends import PALLAS_TPU
from tests.kernels.decode_attention.decode_cases import CASE


@pytest.mark.parametrize("name", [*PALLAS_TPU.default, *PALLAS_TPU.slow])
def test_lowers_for_tpu(name):
    case = CASE[name]
    dtype = jnp.dtype(case.dtype)
    q = jax.ShapeDtypeStruct((case.B, case.T, case.H, case.D), dtype)
    kv = jax.ShapeDtypeStruct((case.B, case.S, case.K, case.D), dtype)
    lengths = jax.ShapeDtypeStruct((case.B,), jnp.int32)

    def decode(q, k, v, lengths):
        return sf.decode_attention(
            q, k, v, lengths, implementation="pallas_tpu", return_lse=True, **case.options()
        )

    with interpret_mode(False):
        exported = jax.export.export(jax.jit(decode), platforms=["tpu"])(q, kv, kv, lengths)
    text = exported.mlir_module()
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
    assert "shardfuse_decode_attention" in text
    assert exported.platforms == ("tpu",)
