"""Memory: the xla path's forward+backward temp bytes grow linearly in S, the reference's
quadratically (compiled, never run). Runs in a subprocess because XLA_FLAGS must be set
before JAX starts (YNNPACK fusion on XLA:CPU hides temporaries otherwise)."""

import json
import subprocess
import sys

import pytest

TOOL = "shardfuse.bench.tools.attention_memory"


def test_xla_memory_linear_reference_quadratic():
    result = subprocess.run(
        [sys.executable, "-m", TOOL, "--seq-lens", "4096", "16384", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    temp = json.loads(result.stdout.strip().splitlines()[-1])
    xla, ref = temp["xla"], temp["reference"]
    xla_ratio = xla["16384"] / xla["4096"]
    assert xla_ratio <= 4.5, f"xla temp memory grew {xla_ratio:.2f}x for 4x longer S: {xla}"
    # O(T*S) scores: 16x; allow for O(S) terms.
    assert ref["16384"] / ref["4096"] >= 12, ref
    # And the xla path holds no [H, T, S] float32 score tensor at S = 16384.
    assert xla["16384"] < 8 * 16384 * 16384 * 4 / 16, xla


def _scan_grad_temp(seq_len: int, ring: bool) -> int:
    """Compiled temp bytes of the gradient of two attention layers under `lax.scan`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from shardfuse.collectives.ring_attention import ring_attention
    from shardfuse.kernels.attention import api

    mesh = jax.make_mesh((1,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))

    def attention(x):
        if ring:
            per_shard = lambda x: ring_attention(x, x, x, "sequence", causal=True)  # noqa: E731
            spec = P(None, "sequence")
            return jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec)(x)
        return api.flash_attention(x, x, x, causal=True, implementation="xla")

    def loss(w, x):
        return jax.lax.scan(lambda x, w_l: (attention(x * w_l), None), x, w)[0].sum()

    x = jax.ShapeDtypeStruct((1, seq_len, 2, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((2, 16), jnp.float32)
    compiled = jax.jit(jax.grad(loss)).lower(w, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("ring", [False, True], ids=["flash", "ring"])
def test_memory_linear_inside_a_differentiated_layer_scan(ring):
    """A stack of layers (`lax.scan`) under `jax.grad`: still O(S), no per-tile masks kept.

    JAX's partial evaluation of a differentiated scan moves what does not depend on
    the carry out of the loop; the tile masks depend only on positions, and were
    computed for every tile at once and kept (13x the temp for 4x S, 765 MB at
    S = 8192 with 2 heads). The xla kernel ties them to q (`xla._tied`).
    """
    short, long = _scan_grad_temp(2048, ring), _scan_grad_temp(8192, ring)
    assert long / short <= 4.5, (short, long)
    assert long < 2 * 8192 * 8192 * 4 / 8, long  # far below one [H, S, S] float32 score tensor
