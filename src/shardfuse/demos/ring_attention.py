"""Demo section: ring attention on a ring of every device vs the one-device reference.

`sf.ring_attention` splits the sequence over all devices (8 CPU devices under
`shardfuse demo`) in each layout, with the ring and the all_gather strategy;
every row is checked against `sf.attention_reference` on the whole sequence.
The case column shows each layout's causal load balance (max / mean of the
per-device work, `ring_balance`). A final row checks gradients (fwd+bwd).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.ring_attention import ring_balance
from shardfuse.collectives.ring_attention.sharded import ring_attention
from shardfuse.demos import time_call
from shardfuse.kernels.attention import attention_reference
from shardfuse.testing import max_abs_error

AXIS = "sequence"


def rows(seq_len: int = 512):
    """Ring attention (each layout, both strategies, and gradients) vs the reference."""
    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    B, H, K, D = 1, 8, 2, 64
    T = max(seq_len - seq_len % (2 * n), 2 * n)
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, K, D), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, K, D), jnp.float32)
    expected = jax.jit(lambda q, k, v: attention_reference(q, k, v, causal=True))(q, k, v)
    sharding = NamedSharding(mesh, P(None, AXIS))
    q_s, k_s, v_s = (jax.device_put(x, sharding) for x in (q, k, v))
    shape = f"q {tuple(q.shape)} kv {tuple(k.shape)}, ring of {n}"
    result = []
    for strategy, layout in (
        ("ring", "zigzag"),
        ("ring", "contiguous"),
        ("ring", "striped"),
        ("all_gather", "zigzag"),
    ):
        fn = jax.jit(
            lambda q, k, v, s=strategy, lay=layout: ring_attention(
                q, k, v, mesh=mesh, sequence_axis=AXIS, layout=lay, strategy=s, causal=True
            )
        )
        balance = ring_balance(T, n, layout).max_over_mean
        result.append(
            dict(
                op="ring_attention",
                implementation=f"{strategy} (xla blocks)",
                case=f"causal GQA 8:2, {layout} (work max/mean {balance:.2f})",
                shape=shape,
                error=max_abs_error(fn(q_s, k_s, v_s), expected),
                seconds=time_call(fn, q_s, k_s, v_s),
            )
        )

    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)

    def grads(attend):
        def run(q, k, v, d_out):
            return jax.vjp(attend, q, k, v)[1](d_out)

        return jax.jit(run)

    ring_grads = grads(
        lambda q, k, v: ring_attention(q, k, v, mesh=mesh, sequence_axis=AXIS, causal=True)
    )
    ref_grads = grads(lambda q, k, v: attention_reference(q, k, v, causal=True))
    got, want = ring_grads(q_s, k_s, v_s, d_out), ref_grads(q, k, v, d_out)
    result.append(
        dict(
            op="ring_attention fwd+bwd",
            implementation="ring (xla blocks)",
            case="causal GQA 8:2, zigzag: max |err| of dq, dk, dv",
            shape=shape,
            error=max(max_abs_error(a, b) for a, b in zip(got, want, strict=True)),
            seconds=time_call(ring_grads, q_s, k_s, v_s, d_out),
        )
    )
    return result
