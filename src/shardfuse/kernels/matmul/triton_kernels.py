"""The Triton matmul-plus-reduce kernel (imported only on GPU paths and by the CPU checks).

A tiled GEMM in the style of the Triton matmul tutorial: one program per
`[BLOCK_M, BLOCK_N]` output tile, programs ordered in groups of `GROUP_M` tile
rows so that neighbouring programs share B tiles in L2, a float32 register
accumulator over `BLOCK_K` steps (`tl.dot`, software-pipelined by
`num_stages`), and the epilogue fused: `+ addend` tile (a reduce-scatter ring
step's partial sum), `+ bias`, one cast, masked store. float32 inputs use IEEE
dots (no TF32), as the HIGHEST-precision reference. Sizes are `tl.constexpr`;
edges are masked, so any M, N, C work. Row-major contiguous operands:
a `[M, C]`, b `[C, N]`, addend and out `[M, N]`, bias `[N]`.
"""

import triton
import triton.language as tl


@triton.jit
def matmul_plus_reduce_kernel(
    a_ref,
    b_ref,
    addend_ref,
    bias_ref,
    out_ref,
    M: tl.constexpr,
    N: tl.constexpr,
    C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_ADDEND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * num_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % programs_per_group) % group_rows
    pid_n = (pid % programs_per_group) // group_rows

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        k = k0 + ks
        a = tl.load(
            a_ref + rows[:, None] * C + k[None, :],
            mask=(rows[:, None] < M) & (k[None, :] < C),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        b = tl.load(
            b_ref + k[:, None] * N + cols[None, :],
            mask=(k[:, None] < C) & (cols[None, :] < N),
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)

    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if HAS_ADDEND:
        addend = tl.load(addend_ref + rows[:, None] * N + cols[None, :], mask=inside, other=0.0)
        acc += addend.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ref + cols, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    tl.store(
        out_ref + rows[:, None] * N + cols[None, :], acc.to(out_ref.dtype.element_ty), mask=inside
    )
