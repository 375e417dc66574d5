"""Demo section: sf.matmul and the overlapped collective matmuls vs their references.

xla rows time the real thing on CPU; pallas_tpu rows run the TPU kernels in
TPU interpret mode (a simulator: their times say nothing about a TPU).

The collectives run a sequence-parallel MLP on a ring of every device (8 CPU
devices under `shardfuse demo`): all-gather-matmul up, matmul-reduce-scatter
down, and the matmul-all-reduce down projection, each against JAX's own
collective and a reference matmul in the same shard_map. The case column also
shows the cost model's predicted overlap for Llama-3 70B at 8k tokens on 8
H100s (NVLink) and 8 TPU v5p chips (ICI).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.collectives import collective_matmul
from shardfuse.demos import time_call
from shardfuse.kernels.matmul import matmul
from shardfuse.testing import max_abs_error

AXIS = "model"


def _prediction(op: str) -> str:
    from shardfuse.collectives.collective_matmul import cost_model
    from shardfuse.models import get as model_spec

    model = model_spec("llama3-70b")
    sizes = (
        (model.hidden, model.ffn_hidden)
        if op == "all_gather_matmul"
        else (model.ffn_hidden, model.hidden)
    )
    hidden = []
    for preset, label in (("h100_nvlink", "H100"), ("tpu_v5p_ici", "v5p")):
        cost = cost_model.ring_cost(
            op, rows=8192, contract=sizes[0], cols=sizes[1], ring_size=8,
            hardware=preset, bidirectional=True,
        )  # fmt: skip
        hidden.append(f"{label} {cost.hidden_fraction:.0%}")
    return "predicted overlap (70B, 8k tokens, 8 devices): " + ", ".join(hidden)


def _matmul_rows(seq_len):
    keys = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(keys[0], (seq_len, 512), jnp.float32)
    b = jax.random.normal(keys[1], (512, 1024), jnp.float32) / 512**0.5
    c = jax.random.normal(keys[2], (seq_len, 1024), jnp.float32)
    expected = matmul(a, b, addend=c, implementation="reference")
    fn = jax.jit(lambda a, b, c: matmul(a, b, addend=c, implementation="xla"))
    return [
        dict(
            op="matmul",
            implementation="xla",
            case="a @ b + addend (float32 partial sum)",
            shape=f"a {tuple(a.shape)} b {tuple(b.shape)}",
            error=max_abs_error(fn(a, b, c), expected),
            seconds=time_call(fn, a, b, c),
        )
    ]


def _pallas_rows():
    """pallas_tpu (TPU interpret mode off TPU: a simulator, so tiny shapes and slow times)."""
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    a = jax.random.normal(jax.random.key(2), (64, 256), jnp.float32)
    b = jax.random.normal(jax.random.key(3), (256, 128), jnp.float32) / 16
    c = jnp.ones((64, 128), jnp.float32)
    fn = jax.jit(lambda a, b, c: matmul(a, b, addend=c, implementation="pallas_tpu"))
    expected = matmul(a, b, addend=c, implementation="reference")
    result = [
        dict(
            op="matmul",
            implementation="pallas_tpu",
            case="a @ b + addend, TPU interpret mode",
            shape=f"a {tuple(a.shape)} b {tuple(b.shape)}",
            error=max_abs_error(fn(a, b, c), expected),
            seconds=time_call(fn, a, b, c),
        )
    ]
    layouts = {
        "all_gather_matmul": ((8 * n, 64), (64, 16 * n), P(AXIS), P(None, AXIS), P(None, AXIS)),
        "matmul_reduce_scatter": ((8 * n, 16 * n), (16 * n, 64), P(None, AXIS), P(AXIS), P(AXIS)),
    }
    for op, (x_shape, w_shape, x_spec, w_spec, out_spec) in layouts.items():
        x = jax.device_put(
            jax.random.normal(jax.random.key(4), x_shape), NamedSharding(mesh, x_spec)
        )
        w = jax.random.normal(jax.random.key(5), w_shape) / w_shape[0] ** 0.5
        w = jax.device_put(w, NamedSharding(mesh, w_spec))
        specs = (x_spec, w_spec, out_spec)
        expected = _sharded(op, "reference", mesh, specs)(x, w)
        fn = _sharded(op, "pallas_tpu", mesh, specs, bidirectional=True)
        result.append(
            dict(
                op=op,
                implementation="pallas_tpu bidirectional",
                case=f"fused remote-DMA ring of {n}, TPU interpret mode",
                shape=f"x {x_shape} w {w_shape}",
                error=max_abs_error(fn(x, w), expected),
                seconds=time_call(fn, x, w),
            )
        )
    return result


def _sharded(op, implementation, mesh, specs, **options):
    x_spec, w_spec, out_spec = specs

    def per_shard(x, w):
        fn = getattr(collective_matmul, op)
        return fn(x, w, AXIS, implementation=implementation, **options)

    return jax.jit(
        jax.shard_map(per_shard, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
    )


def rows(seq_len: int = 512):
    """sf.matmul, then each collective matmul (xla rings) vs its reference on all devices."""
    result = _matmul_rows(seq_len)
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    tokens = max(seq_len - seq_len % n, n)
    hidden, ffn = 32 * n, 128 * n
    layouts = {
        "all_gather_matmul": (
            (tokens, hidden),
            (hidden, ffn),
            P(AXIS),
            P(None, AXIS),
            P(None, AXIS),
        ),
        "matmul_reduce_scatter": ((tokens, ffn), (ffn, hidden), P(None, AXIS), P(AXIS), P(AXIS)),
        "matmul_all_reduce": ((tokens, ffn), (ffn, hidden), P(None, AXIS), P(AXIS), P()),
    }
    for op, (x_shape, w_shape, x_spec, w_spec, out_spec) in layouts.items():
        kx, kw = jax.random.split(jax.random.key(1))
        x = jax.device_put(jax.random.normal(kx, x_shape), NamedSharding(mesh, x_spec))
        w = jax.random.normal(kw, w_shape) / w_shape[0] ** 0.5
        w = jax.device_put(w, NamedSharding(mesh, w_spec))

        specs = (x_spec, w_spec, out_spec)
        expected = _sharded(op, "reference", mesh, specs)(x, w)
        variants = {"xla": ({}, "ring")}
        if op != "matmul_all_reduce":
            variants["xla bidirectional"] = ({"bidirectional": True}, "bidirectional ring")
        for label, (options, what) in variants.items():
            fn = _sharded(op, "xla", mesh, specs, **options)
            result.append(
                dict(
                    op=op,
                    implementation=label,
                    case=f"{what} of {n}; {_prediction(op)}",
                    shape=f"x {x_shape} w {w_shape}",
                    error=max_abs_error(fn(x, w), expected),
                    seconds=time_call(fn, x, w),
                )
            )
    return result + _pallas_rows()
