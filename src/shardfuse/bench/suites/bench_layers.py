"""Layer benchmarks: a transformer-block training step, sharded vs one device.

Each group (one model's block at one sequence length) times, in the same run,
the forward and backward (gradients of every parameter and of the input) of:

- `shardfuse.block.2x2x2`: `sf.layers.ParallelTransformerBlock` on a
  (data, sequence, model) = 2x2x2 mesh of the 8 CPU devices: batch over
  data, zigzag ring attention over sequence, tensor parallelism with Megatron
  sequence parallelism over model (overlapped collective matmuls);
- `reference.block.1device`, the baseline: the same parameters through the
  unsharded `shardfuse.layers.reference.transformer_block` on one device.

On CPU the 8 "devices" share the host's two cores and collectives are
memcpys, so the ratio shows the overhead of the sharded program (and of the
blockwise attention against the reference's dense one), not the speedup of 8
accelerators.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse import flops
from shardfuse.bench.harness import BenchCase
from shardfuse.layers import reference
from shardfuse.models import MODELS

OP = "transformer_block"
BASELINE = "reference.block.1device"
IMPLEMENTATIONS = ("shardfuse.block.2x2x2", BASELINE)
MODEL = "llama3-8b"


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ != "test_transformer_block_step":
        return
    scale = metafunc.config.bench_scale
    # One model: a block's compile is long on CPU; the quick scale keeps one length.
    seq_lens = scale.seq_lens[-1:] if "quick" in scale.name else scale.seq_lens
    params = [(seq_len, impl) for seq_len in seq_lens for impl in IMPLEMENTATIONS]
    ids = [f"{MODEL}-T{seq_len}-{impl}" for seq_len, impl in params]
    metafunc.parametrize("seq_len, implementation", params, ids=ids)


def block_flops(B, T, model) -> float:
    """Forward + backward FLOPs of one block (`shardfuse.flops`: 3x its matmuls, causal attention).

    The block runs the model's swiglu MLP (`ParallelTransformerBlock`'s default),
    so its matmuls are the spec's (`flops.layer_matmul_flops`); attention counts
    the visible pairs of the causal mask (what the kernels compute).
    """
    matmuls = flops.TRAINING_OVER_FORWARD * B * T * flops.layer_matmul_flops(model)
    H, D = model.heads, model.head_dim
    return matmuls + flops.attention_flops(B, T, T, H, D, causal=True, mode=flops.FWD_BWD)


def test_transformer_block_step(measure, bench_scale, seq_len, implementation):
    model = bench_scale.scaled(MODELS[MODEL])
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "sequence", "model"))
    B, T, F = 2, seq_len, model.hidden
    dtype = jnp.dtype(bench_scale.dtype)
    block = sf.layers.ParallelTransformerBlock(
        F,
        model.heads,
        model.ffn_hidden,
        num_kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        mesh=mesh,
        layout="zigzag",
        dtype=dtype,
        rngs=nnx.Rngs(0),
    )
    case = BenchCase(
        op=OP,
        implementation=implementation,
        mode=flops.FWD_BWD,
        shape={
            "B": B,
            "T": T,
            "F": F,
            "H": model.heads,
            "K": model.kv_heads,
            "D": model.head_dim,
            "ffn": model.ffn_hidden,
            "mesh": "2x2x2",
        },
        dtype=dtype.name,
        flops=block_flops(B, T, model),
        bytes=4 * B * T * F * dtype.itemsize,
        baseline=BASELINE,
        model=model.name,
        variant="causal gqa swiglu",
        seq_len=seq_len,
    )
    x = jax.random.normal(jax.random.key(0), (B, T, F), dtype)
    if implementation == BASELINE:
        params = reference.params(block)

        def step(params, x):
            loss = lambda p, x: jnp.sum(
                reference.transformer_block(block, p, x).astype(jnp.float32)
            )
            return jax.grad(loss, (0, 1))(params, x)

        measure(step, (params, jax.device_put(x, jax.devices()[0])), case)
        return
    graphdef, state = nnx.split(block)

    def step(state, x):
        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32))

        return jax.grad(loss, (0, 1))(state, x)

    x = jax.device_put(x, NamedSharding(mesh, P("data", ("sequence", "model"))))
    measure(step, (state, x), case)
