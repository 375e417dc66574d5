"""Context-parallel strategies side by side: ring vs all_gather vs Ulysses vs USP.

Every group (llama3-8b's causal attention at one sequence length, forward or
forward + backward) times, in the same run, `sf.ring_attention` over all
devices (8 CPU devices by default) with:

- `shardfuse.ring` (the baseline): strategy="ring", zigzag, K/V rotating by ppermute;
- `shardfuse.all_gather`: K/V gathered once, one block per device;
- `shardfuse.ulysses`: all-to-alls trade the sequence shard for H / N heads;
- `shardfuse.ulysses_ring`: USP on a (ring N/4, ulysses 4) mesh, zigzag.

Each case records the cost rule's prediction for the chip it runs on
(`strategy.py`; on CPU, which `shardfuse.hardware` does not know, the H100
SXM figures) in `predicted_ms` and `predicted_winner`. The heads are the
model's divided by 4 on CPU (8 query, 2 kv heads of dim 128 / 4 = 32: Ulysses
over 8 devices needs 8 heads), the real ones on a device. On CPU the 8
"devices" share the host's cores and a collective is a memcpy, so the ratios
show each strategy's overhead, not the speed of 8 real devices.

`test_predicted_crossovers` prints the cost rule's predicted winner for
llama3-8b on H100 NVLink and TPU v5p from 8k to 1M tokens (8 devices, and 4 x 2
for USP), the table the README quotes (`strategy.main()` prints it too).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.bench import flops
from shardfuse.bench.harness import BenchCase, with_backward
from shardfuse.collectives.ring_attention import strategy
from shardfuse.models import MODELS

OP = "context_parallel"
MODEL = "llama3-8b"
BASELINE = "shardfuse.ring"
IMPLEMENTATIONS = (BASELINE, "shardfuse.all_gather", "shardfuse.ulysses", "shardfuse.ulysses_ring")
USP_ULYSSES = 4


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_context_parallel":
        return
    params, ids = metafunc.config.bench_scale.grid(IMPLEMENTATIONS, models=[MODEL])
    metafunc.parametrize("model_name, seq_len, mode, implementation", params, ids=ids)


def _model(scale, name):
    model = MODELS[name]
    if scale.divisor == 1:
        return model
    return dataclasses.replace(
        model, heads=model.heads // 4, kv_heads=model.kv_heads // 4, head_dim=model.head_dim // 4
    )


def _mesh_and_axis(implementation, n):
    devices = np.array(jax.devices()[:n])
    if implementation == "shardfuse.ulysses_ring":
        mesh = Mesh(devices.reshape(n // USP_ULYSSES, USP_ULYSSES), ("ring", "ulysses"))
        return mesh, ("ulysses", "ring"), P(None, ("ring", "ulysses"))
    return Mesh(devices, ("sequence",)), "sequence", P(None, "sequence")


def test_context_parallel(
    measure, benchmark, bench_scale, model_name, seq_len, mode, implementation
):
    model = _model(bench_scale, model_name)
    n = jax.device_count()
    B, T, H, K, D = bench_scale.batch(seq_len), seq_len, model.heads, model.kv_heads, model.head_dim
    dtype = jnp.dtype(bench_scale.dtype)
    name = implementation.split(".")[-1]
    if name == "ulysses_ring" and (n % USP_ULYSSES or n == USP_ULYSSES):
        pytest.skip(f"USP over {USP_ULYSSES} x ring needs a multiple of {2 * USP_ULYSSES} devices")
    if name.startswith("ulysses") and H % (n if name == "ulysses" else USP_ULYSSES):
        pytest.skip(f"{H} heads do not split over the Ulysses devices")
    mesh, axis, spec = _mesh_and_axis(implementation, n)
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=mode,
        shape={"B": B, "T": T, "S": T, "H": H, "K": K, "D": D, "N": n},
        dtype=dtype.name,
        flops=flops.attention_flops(B, T, T, H, D, causal=True, mode=mode),
        bytes=flops.attention_bytes(B, T, T, H, K, D, dtype.itemsize, mode=mode),
        baseline=BASELINE,
        model=model.name,
        variant="causal",
        seq_len=seq_len,
    )
    sharding = NamedSharding(mesh, spec)
    keys = jax.random.split(jax.random.key(seq_len), 4)
    q = jax.device_put(jax.random.normal(keys[0], (B, T, H, D), dtype), sharding)
    k = jax.device_put(jax.random.normal(keys[1], (B, T, K, D), dtype), sharding)
    v = jax.device_put(jax.random.normal(keys[2], (B, T, K, D), dtype), sharding)

    def fn(q, k, v):
        return sf.ring_attention(
            q, k, v, mesh=mesh, sequence_axis=axis, strategy=name, layout="zigzag", causal=True
        )

    args = (q, k, v)
    if mode == flops.FWD_BWD:
        fn = with_backward(fn)
        args += (jax.device_put(jax.random.normal(keys[3], (B, T, H, D), dtype), sharding),)
    measure(fn, args, case)
    costs = strategy.strategy_costs(
        batch=B, seq_len=T, heads=H, kv_heads=K, head_dim=D, sequence_size=n,
        ulysses_size=USP_ULYSSES, dtype_bytes=dtype.itemsize, causal=True,
    )  # fmt: skip
    by_name = {c.strategy: c for c in costs}
    predicted = by_name[name]
    seconds = predicted.forward_s if mode == flops.FWD else predicted.total_s
    benchmark.extra_info["predicted_ms"] = round(seconds * 1e3, 6)
    benchmark.extra_info["predicted_winner"] = strategy.choose(costs)


def test_predicted_crossovers():
    """The cost rule's winner for llama3-8b, 8k to 1M tokens, on H100 NVLink and TPU v5p."""
    lens = [8192 << i for i in range(8)]
    print()
    for hardware in ("h100-sxm", "tpu-v5p"):
        rows = strategy.predicted_winners(
            MODELS[MODEL], hardware=hardware, seq_lens=lens, sequence_size=8, ulysses_size=4
        )
        print(f"{MODEL} on {strategy.resolve_hardware(hardware).name}, 8 devices (USP 4 x 2):")
        print(f"  {'T':>8} {'winner':12} " + " ".join(f"{s:>12}" for s in strategy.STRATEGIES))
        for row in rows:
            times = " ".join(f"{row[s]:12.3f}" for s in strategy.STRATEGIES)
            print(f"  {row['seq_len']:>8} {row['winner']:12} {times}   (ms, fwd + bwd)")
        print(f"  crossovers: {strategy.crossovers(rows)}")
        assert {row["winner"] for row in rows} <= set(strategy.STRATEGIES)
