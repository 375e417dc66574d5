"""Ring attention benchmarks: the ring against all_gather and against one device.

Every group (one model's causal attention at one sequence length, forward or
forward + backward) times, in the same run, on a ring of all devices (8 CPU
devices by default) over the mesh axis "sequence":

- `shardfuse.ring.zigzag` and `shardfuse.ring.contiguous`: `sf.ring_attention`
  with strategy="ring" (K/V rotate by ppermute while blocks compute);
- `shardfuse.all_gather.zigzag`: strategy="all_gather" (K/V gathered once);
- `shardfuse.xla.1device`, the baseline: `sf.flash_attention` on one device
  holding the whole sequence, the computation the ring distributes.

Inputs are natural-order global arrays sharded over the ring (the baseline's
on one device); the layout permutation is inside the timed call, as users get
it. Each ring case records the layout's balance (`ring_balance`: max / mean
of the per-device pair work). On CPU the 8 "devices" share the host's cores
and a ppermute is a memcpy, so ratios show the ring's overhead and its
balance, not the speedup of 8 real devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.bench import flops
from shardfuse.bench.harness import BenchCase, with_backward
from shardfuse.collectives.ring_attention import ring_balance
from shardfuse.models import MODELS

OP = "ring_attention"
AXIS = "sequence"
BASELINE = "shardfuse.xla.1device"
IMPLEMENTATIONS = (
    "shardfuse.ring.zigzag",
    "shardfuse.ring.contiguous",
    "shardfuse.all_gather.zigzag",
    BASELINE,
)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_ring_attention":
        return
    params, ids = metafunc.config.bench_scale.grid(IMPLEMENTATIONS)
    metafunc.parametrize("model_name, seq_len, mode, implementation", params, ids=ids)


def _attention_fn(implementation, mesh, window, softcap):
    options = dict(causal=True, window=window, logit_softcap=softcap)
    if implementation == BASELINE:
        return lambda q, k, v: sf.flash_attention(q, k, v, implementation="xla", **options)
    _, strategy, layout = implementation.split(".")
    return lambda q, k, v: sf.ring_attention(
        q, k, v, mesh=mesh, sequence_axis=AXIS, layout=layout, strategy=strategy, **options
    )


def test_ring_attention(measure, benchmark, bench_scale, model_name, seq_len, mode, implementation):
    model = bench_scale.scaled(MODELS[model_name])
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    B, T = bench_scale.batch(seq_len), seq_len
    H, K, D = model.heads, model.kv_heads, model.head_dim
    dtype = jnp.dtype(bench_scale.dtype)
    window, variant = model.causal_mask
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=mode,
        shape={"B": B, "T": T, "S": T, "H": H, "K": K, "D": D, "ring": n},
        dtype=dtype.name,
        flops=flops.attention_flops(B, T, T, H, D, causal=True, window=window, mode=mode),
        bytes=flops.attention_bytes(B, T, T, H, K, D, dtype.itemsize, mode=mode),
        baseline=BASELINE,
        model=model.name,
        variant=variant,
        seq_len=seq_len,
    )
    if implementation == BASELINE:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    else:
        sharding = NamedSharding(mesh, P(None, AXIS))
    keys = jax.random.split(jax.random.key(seq_len), 4)
    q = jax.device_put(jax.random.normal(keys[0], (B, T, H, D), dtype), sharding)
    k = jax.device_put(jax.random.normal(keys[1], (B, T, K, D), dtype), sharding)
    v = jax.device_put(jax.random.normal(keys[2], (B, T, K, D), dtype), sharding)
    fn = _attention_fn(implementation, mesh, window, model.logit_softcap)
    args = (q, k, v)
    if mode == flops.FWD_BWD:
        fn = with_backward(fn)
        args += (jax.device_put(jax.random.normal(keys[3], (B, T, H, D), dtype), sharding),)
    measure(fn, args, case)
    if implementation != BASELINE:
        layout = implementation.split(".")[-1]
        multiple = n * (2 if layout == "zigzag" else 1)
        padded = -(-T // multiple) * multiple
        balance = ring_balance(padded, n, layout, causal=True, window=window)
        benchmark.extra_info["balance_max_over_mean"] = round(balance.max_over_mean, 4)
