"""Shared body of the fused TPU ring tests: run implementation="pallas_tpu_fused" per shard.

The fused kernels run in TPU interpret mode, which simulates every device's
VMEM, DMAs and semaphores in host callbacks. On the 2-core CI host that is
slow (seconds per ring) and, with 4 or more devices and large buffers, the
device threads can starve each other until the run deadlocks; so the cases
are tiny (local shards of 8 to 16 rows, head dim 64, rings of 2 and 4) and
every run waits for its results (`jax.block_until_ready`) before anything
else is dispatched to the CPU devices.

`check_fused(case)` runs the per-shard `sf.collectives.ring_attention` in
`jax.shard_map` on ring-ordered inputs (forward, lse, and gradients by
`jax.vjp` with random cotangents) and compares it, in natural order, with
`sf.attention_reference` on the gathered sequence (ring_cases.compare: the
TESTING.md tolerances).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode
from tests.collectives.ring_attention.ring_cases import (
    RingCase,
    compare,
    make_inputs,
    mesh_3d,
    ring_mesh,
    with_vjp,
)

FUSED = "pallas_tpu_fused"


def case(**kwargs) -> RingCase:
    """A fused-ring case: head dim 64 (the kernels take 64 or multiples of 128), local
    shards of 8 rows by default."""
    n = kwargs.get("N", 2)
    defaults = dict(D=64, T=8 * n, S=8 * n, implementation=FUSED)
    return RingCase(**{**defaults, **kwargs})


def _specs(case: RingCase):
    """(mesh, q spec, kv spec, segment spec, lse spec)."""
    if case.mesh == "3d":  # (data 2, sequence 2, model 2): batch and heads sharded too
        return (
            mesh_3d(),
            P("data", "sequence", "model"),
            P("data", "sequence", "model" if case.K % 2 == 0 else None),
            P("data", "sequence"),
            P("data", "model", "sequence"),
        )
    if case.mesh == "2d":  # (sequence N, model 2): heads sharded too, 2 N devices
        devices = np.array(jax.devices()[: 2 * case.N]).reshape(case.N, 2)
        mesh = Mesh(devices, ("sequence", "model"))
        heads = P(None, "sequence", "model")
        kv_heads = P(None, "sequence", "model" if case.K % 2 == 0 else None)
        return mesh, heads, kv_heads, P(None, "sequence"), P(None, "model", "sequence")
    seq = P(None, "sequence")
    if case.mesh == "explicit":  # what jax.make_mesh gives
        mesh = jax.make_mesh((case.N,), ("sequence",), devices=jax.devices()[: case.N])
        return mesh, seq, seq, seq, P(None, None, "sequence")
    return ring_mesh(case.N), seq, seq, seq, P(None, None, "sequence")  # Auto axes


def fused_fn(case: RingCase, kwargs, *, implementation=FUSED):
    """Natural-order `(q, k, v) -> (out, lse)` through the per-shard ring on ring-ordered shards."""
    n, layout = case.N, case.layout
    mesh, q_spec, kv_spec, seg_spec, lse_spec = _specs(case)
    options = dict(kwargs)
    q_seg, kv_seg = options.pop("q_segment_ids", None), options.pop("kv_segment_ids", None)

    def to_ring(x, spec, axis=1):
        """Ring order, on the mesh (an Explicit mesh's shard_map wants its in_specs)."""
        if x is None:
            return None
        # On the mesh first: to_ring_layout keeps x's sharding (and its transpose, the
        # cotangent's), where a reorder before the device_put would not on an Explicit mesh.
        return sf.to_ring_layout(jax.device_put(x, NamedSharding(mesh, spec)), n, layout, axis=axis)

    def shard(q, k, v, q_seg, kv_seg):
        return sf.collectives.ring_attention(
            q, k, v, "sequence", layout=layout, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
            return_lse=True, implementation=implementation, **options,
        )  # fmt: skip

    seg_specs = (None, None) if q_seg is None else (seg_spec, seg_spec)
    mapped = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, *seg_specs),
        out_specs=(q_spec, lse_spec),
    )

    def attend(q, k, v):
        out, lse = mapped(
            to_ring(q, q_spec), to_ring(k, kv_spec), to_ring(v, kv_spec),
            to_ring(q_seg, seg_spec), to_ring(kv_seg, seg_spec),
        )  # fmt: skip
        return sf.from_ring_layout(out, n, layout), sf.from_ring_layout(lse, n, layout, axis=2)

    return attend


def run_fused(case: RingCase, params=None, seed: int = 0, block_sizes=None):
    """`(actual (out, lse, dq, dk, dv), inputs)` of the fused ring under interpret `params`
    (`block_sizes`: the kernels' tiles within a shard, default theirs)."""
    q, k, v, kwargs, cotangents = make_inputs(case, seed)
    inputs = [x.astype(case.dtype) for x in (q, k, v)]
    params = params or pltpu.InterpretParams(dma_execution_mode="eager")
    attend = fused_fn(case, {**kwargs, "block_sizes": block_sizes})
    with interpret_mode(params):
        actual = jax.block_until_ready(with_vjp(attend)(*inputs, *cotangents))
    return actual, (q, k, v, kwargs, cotangents)


def check_fused(case: RingCase, params=None, seed: int = 0, block_sizes=None):
    """The fused ring vs the reference on the gathered sequence; returns its results."""
    actual, (q, k, v, kwargs, cotangents) = run_fused(case, params, seed, block_sizes)
    compare(case, actual, q, k, v, kwargs, cotangents)
    for name, x in zip(("out", "dq", "dk", "dv"), (actual[0], *actual[2:]), strict=True):
        assert bool(jnp.isfinite(x).all()), f"{case.id} {name} not finite"
    return actual
