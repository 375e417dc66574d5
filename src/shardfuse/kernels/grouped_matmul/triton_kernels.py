"""The Triton grouped matmul kernels (imported only on GPU paths and by the CPU checks).

- `grouped_matmul_kernel`: one program per (row-tile visit, column tile). The
  visits (`tiles.visits`, forward) cover every row exactly once: a program
  multiplies its tile's rows of lhs by its group's weights (float32 `tl.dot`
  accumulator over `BLOCK_K` steps) and stores the rows of its group only, so
  two programs sharing a tile across a group boundary write disjoint rows; a
  visit of group -1 stores zeros. Padding visits return at once.
- `grouped_matmul_transposed_kernel`: one program per (group, A tile, B tile)
  of the weights' gradient, looping over the group's rows (bounds read from
  memory) in `BLOCK_M` steps: `acc += x[rows]^T y[rows]`, rows outside the group
  masked on load; an empty group stores zeros.

Row-major operands; rhs's strides are arguments of the layout (`[G, K, N]`, or
`[G, N, K]` transposed). float32 inputs use IEEE dots unless a lower precision
was asked for (TF32). Sizes are `tl.constexpr`; edges are masked.
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_matmul_kernel(
    lhs_ref,
    rhs_ref,
    tile_ref,
    group_ref,
    begin_ref,
    end_ref,
    valid_ref,
    out_ref,
    M: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    RHS_STRIDE_K: tl.constexpr,
    RHS_STRIDE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    visit = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(valid_ref + visit) == 0:
        return
    group = tl.load(group_ref + visit)
    begin = tl.load(begin_ref + visit)
    end = tl.load(end_ref + visit)
    rows = tl.load(tile_ref + visit) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mine = (rows >= begin) & (rows < end)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if group >= 0:
        rhs_group = rhs_ref + group.to(tl.int64) * K * N
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a = tl.load(
                lhs_ref + rows[:, None] * K + k[None, :],
                mask=mine[:, None] & (k[None, :] < K),
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            b = tl.load(
                rhs_group + k[:, None] * RHS_STRIDE_K + cols[None, :] * RHS_STRIDE_N,
                mask=(k[:, None] < K) & (cols[None, :] < N),
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
            acc = _dot(a, b, acc, IEEE)
    tl.store(
        out_ref + rows[:, None] * N + cols[None, :],
        acc.to(out_ref.dtype.element_ty),
        mask=mine[:, None] & (cols[None, :] < N),
    )


@triton.jit
def grouped_matmul_transposed_kernel(
    x_ref,
    y_ref,
    begin_ref,
    end_ref,
    out_ref,
    A: tl.constexpr,
    B: tl.constexpr,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    group = tl.program_id(0)
    a = tl.program_id(1) * BLOCK_A + tl.arange(0, BLOCK_A)  # [BLOCK_A]
    b = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    begin = tl.load(begin_ref + group)
    end = tl.load(end_ref + group)
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    for m0 in range(begin, end, BLOCK_M):
        m = m0 + ms
        inside = m < end
        x = tl.load(
            x_ref + m[:, None] * A + a[None, :], mask=inside[:, None] & (a[None, :] < A), other=0.0
        )  # [BLOCK_M, BLOCK_A]
        y = tl.load(
            y_ref + m[:, None] * B + b[None, :], mask=inside[:, None] & (b[None, :] < B), other=0.0
        )  # [BLOCK_M, BLOCK_B]
        acc = _dot(tl.trans(x), y, acc, IEEE)
    out = out_ref + group.to(tl.int64) * A * B + a[:, None] * B + b[None, :]
    tl.store(out, acc.to(out_ref.dtype.element_ty), mask=(a[:, None] < A) & (b[None, :] < B))
