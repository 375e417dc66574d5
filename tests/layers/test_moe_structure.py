"""What the compiled ParallelMoE moves and holds: all-to-all bytes and the largest buffer.

Measured in the optimized HLO of one MoE layer (per device):

- all-to-all: the dense CPU path sends `EP x C x F` floats each way (`A = tokens x k`
  routed rows a device, `C = expert_dispatch.dense_chunk(A, EP)` a destination: `2 A /
  EP` where that is below `A`), `2 EP / (EP - 1)` times the ideal `2 x A x F x bytes x
  (EP - 1) / EP` in operand bytes and twice it in bytes that leave the device; where a
  destination would get more than `C` rows the layer falls back to chunks of `A` (the
  compiled program holds both: `EP^2 / (EP - 1)` and `EP` times the ideal). The expert ids
  ride in the dispatch as two more columns of the rows' dtype (`(F + 2) / F` of the
  dispatch's bytes, no separate all-to-all). On GPU/TPU the ragged path sends only the
  routed rows (not measurable here: XLA:CPU has no ragged-all-to-all).
- executed FLOPs: forward and backward on expert x data and expert x model x data (shared
  experts) are the active-parameter FLOPs plus the router's within 1.1x (measured: 1.003
  and 1.019): the HLO's dots plus the multiply-adds the grouped matmul kernels count
  (`native_cpu.executed_macs`), which is exactly every routed copy once;
- no buffer of tokens x experts x F elements exists, forward or backward (dispatch memory
  O(EP x tokens x k x F)); the xla grouped matmul's CPU lowering (a dense [G, M, K]
  expansion) would make one, and the test shows that it catches it.
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.collectives import expert_dispatch
from shardfuse.kernels import registry

_SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|pred|s8|u8)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def _shapes(text):
    for dtype, dims in _SHAPE.findall(text):
        yield dtype, tuple(int(d) for d in dims.split(",") if d)


def _all_to_all_results(hlo: str):
    """`(dtype, shape)` of every element of every all-to-all's result in `hlo`."""
    for line in hlo.splitlines():
        if " all-to-all(" in line and "=" in line:
            yield from _shapes(line.split("=", 1)[1].split(" all-to-all(", 1)[0])


def all_to_all_bytes(hlo: str) -> dict:
    """Result bytes of every all-to-all in `hlo`, by dtype (a tuple result: its elements)."""
    out = {}
    for dtype, shape in _all_to_all_results(hlo):
        out[dtype] = out.get(dtype, 0) + math.prod(shape) * _BYTES[dtype]
    return out


def all_to_all_bytes_by_rows(hlo: str) -> dict:
    """`{rows: bytes}`: the result bytes of the all-to-alls whose elements are `[1, rows,
    columns]` (the dense dispatch's chunks of `rows` a destination), every dtype."""
    out = {}
    for dtype, shape in _all_to_all_results(hlo):
        out[shape[1]] = out.get(shape[1], 0) + math.prod(shape) * _BYTES[dtype]
    return out


def _compiled(moe, x, *, grad: bool):
    graphdef, state, rest = nnx.split(moe, nnx.Param, ...)

    def forward(state, x):
        return nnx.merge(graphdef, state, rest).forward_with_stats(x)

    def loss(state, x):
        y, stats = forward(state, x)
        return jnp.sum(y**2) + stats["load_balancing_loss"] + stats["router_z_loss"]

    fn = jax.grad(loss, argnums=(0, 1)) if grad else forward
    return jax.jit(fn).lower(state, x).compile()


def test_dense_dispatch_moves_the_stated_all_to_all_bytes():
    ep, k, F = 4, 2, 16
    mesh = jax.make_mesh((2, ep), ("data", "expert"))
    moe = sf.layers.ParallelMoE(F, 8, num_experts=8, top_k=k, mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 8, F))  # 8 tokens per device
    A = 8 * k  # routed rows per device
    C = expert_dispatch.dense_chunk(A, ep)
    assert C == 2 * A // ep < A
    hlo = _compiled(moe, x, grad=False).as_text()
    moved = all_to_all_bytes(hlo)
    assert "s32" not in moved  # one all-to-all carries rows and ids (the counts: removed)
    # the capped dispatch (the rows and their two id columns) and combine, and the
    # fallback's, both in the program (a conditional): nothing else
    by_rows = all_to_all_bytes_by_rows(hlo)
    assert by_rows == {rows: ep * rows * (F + 2) * 4 + ep * rows * F * 4 for rows in (C, A)}
    ideal = 2 * A * F * 4 * (ep - 1) / ep  # ragged, balanced routing
    for rows, factor in ((C, 2 * ep / (ep - 1)), (A, ep**2 / (ep - 1))):
        sent = 2 * ep * rows * F * 4  # the rows alone
        assert sent / ideal == pytest.approx(factor)  # the CPU path's factor
        assert by_rows[rows] / sent == pytest.approx((2 * F + 2) / (2 * F))  # the ids
    leaving = 2 * ep * C * F * 4 * (ep - 1) / ep  # bytes leaving a device, capped
    assert leaving == pytest.approx(expert_dispatch.DENSE_CHUNK_FACTOR * ideal)


def _largest_buffer(hlo: str) -> int:
    return max(math.prod(shape) for _, shape in _shapes(hlo))


@pytest.mark.parametrize("implementation", ["native_cpu", "xla"])
def test_no_tokens_by_experts_by_features_buffer(implementation):
    if implementation == "native_cpu" and not registry.native_cpu_status("cpu")[0]:
        pytest.skip("the C++ grouped matmul is not built")
    ep, E, F, n = 2, 8, 16, 16
    mesh = jax.make_mesh((ep,), ("expert",))
    moe = sf.layers.ParallelMoE(F, 8, num_experts=E, top_k=2, mesh=mesh, rngs=nnx.Rngs(0),
                                grouped_matmul_implementation=implementation)  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (ep, n, F))  # n tokens per device
    compiled = _compiled(moe, x, grad=True)
    largest = _largest_buffer(compiled.as_text())
    forbidden = n * E * F  # tokens x experts x F, per device
    temp = compiled.memory_analysis().temp_size_in_bytes
    if implementation == "xla":  # the control: a [G, M, K] expansion is found
        assert largest >= forbidden, (largest, forbidden)
    else:
        assert largest < forbidden, f"largest buffer {largest} elements; temp {temp} bytes"


def test_ragged_path_lowers_forward_and_backward():
    """The GPU/TPU path, checked as far as this CPU goes: it traces and lowers, its forward
    and backward moving rows only by ragged all-to-all (rows, ids and results forward; the
    two row transfers transposed backward), no dense all-to-all of rows."""
    mesh = jax.make_mesh((4, 2), ("expert", "model"))
    moe = sf.layers.ParallelMoE(16, 8, num_experts=8, top_k=2, dispatch_implementation="ragged",
                                mesh=mesh, rngs=nnx.Rngs(0))  # fmt: skip
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    graphdef, state, rest = nnx.split(moe, nnx.Param, ...)

    def loss(state, x):
        y, stats = nnx.merge(graphdef, state, rest).forward_with_stats(x)
        return jnp.sum(y**2) + stats["load_balancing_loss"]

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x).as_text()
    assert text.count("ragged_all_to_all") == 5
    dense = [line for line in text.splitlines() if "all_to_all" in line and "ragged" not in line]
    assert all("xf32>" not in line.split("->")[-1] for line in dense), dense  # only counts


@pytest.mark.parametrize(
    "shape, names, shared",
    [((4, 2), ("expert", "data"), 0), ((2, 2, 2), ("expert", "model", "data"), 1)],
    ids=["expert-data", "expert-model-data-shared"],
)
def test_expert_parallel_flops_are_the_active_flops_plus_the_router(shape, names, shared):
    """Forward and backward of an expert-parallel MoE layer execute, over all devices, the
    active-parameter FLOPs (each routed copy through its expert's three SwiGLU matrices,
    the shared experts for every token, 6 FLOPs per weight: forward, input and weight
    gradients) plus the router's, within 1.1x: the HLO's dots (router, shared experts)
    times the devices, plus what the grouped matmul kernels report executing
    (`native_cpu.executed_macs`: their custom calls are opaque to XLA). No padded row of
    the dispatch buffer (`EP x A` rows, a quarter of them routed at EP = 4) is computed.
    The xla grouped matmul, whose CPU lowering is a dense expansion over the experts,
    fails the same bound."""
    from shardfuse.kernels.grouped_matmul import native_cpu
    from tests.parallel.pipeline_flops import executed_flops

    F, H, E, k, B, T = 32, 64, 8, 2, 8, 16
    N = B * T
    mesh = jax.make_mesh(shape, names)
    x = jax.random.normal(jax.random.key(0), (B, T, F))
    router = 6 * N * F * E
    active = 6 * N * k * 3 * F * H + 6 * N * 3 * F * H * shared + router

    def executed(implementation):
        moe = sf.layers.ParallelMoE(F, H, num_experts=E, top_k=k, shared_experts=shared,
                                    mesh=mesh, grouped_matmul_implementation=implementation,
                                    rngs=nnx.Rngs(0))  # fmt: skip
        graphdef, state, rest = nnx.split(moe, nnx.Param, ...)
        with jax.set_mesh(mesh):
            xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, moe.io_spec()))
            compiled = _compiled(moe, xs, grad=True)
            dots = executed_flops(compiled.as_text()) * mesh.size
            before = native_cpu.executed_macs()
            jax.block_until_ready(compiled(state, xs))
        return dots, 2 * (native_cpu.executed_macs() - before)

    dots, kernels = executed("native_cpu")
    assert kernels == 6 * N * k * 3 * F * H  # every routed copy once, no padding row
    assert active <= dots + kernels <= 1.1 * active, (dots, kernels, active)
    dots, kernels = executed("xla")
    assert kernels == 0 and dots + kernels > 1.1 * active  # the bound has teeth
