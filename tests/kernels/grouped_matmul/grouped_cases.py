"""The one grouped matmul case matrix, its float64 oracle and the implementations tested on it.

A `Case` is `lhs [M, K]` by group against `rhs [G, K, N]` (`[G, N, K]` transposed)
with `group_sizes` of `G_all` groups, an optional offset (rhs holds groups
`[offset, offset + G)`), a dtype and an optional result dtype; `traced` passes
the sizes and the offset to `jax.jit` as arguments (one program for every
routing), else they are constants the validation sees. Each `Backend` has
capability flags (`dtypes`) and a budget of cases by name: `default`, `slow`
(under `-m slow`) and `deterministic`. Inputs are scaled so that outputs and
gradients are O(1).

Each (backend, case) compiles one jitted function computing the output and the
vjp of a random cotangent together; it is cached with its results.
"""

import contextlib
import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels.grouped_matmul import base, tiles
from shardfuse.testing import F32_TOLERANCE, assert_close, assert_close_low_precision


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    M: int
    K: int
    N: int
    sizes: tuple[int, ...]  # group_sizes, all G_all groups
    local: int | None = None  # rhs's groups (None: all of them)
    offset: int | None = None
    transpose: bool = False
    dtype: str = "float32"
    out_dtype: str | None = None
    traced: bool = True

    @property
    def groups(self) -> int:
        return len(self.sizes) if self.local is None else self.local

    @property
    def rhs_shape(self) -> tuple[int, int, int]:
        K, N = self.K, self.N
        return (self.groups, N, K) if self.transpose else (self.groups, K, N)


def zipf_sizes(groups: int, rows: int, exponent: float = 1.2, seed: int = 0) -> tuple[int, ...]:
    """`groups` sizes summing to `rows`, group i drawn with probability ~ 1 / (i + 1)^exponent
    (the skewed routing of an untrained router), in a shuffled order."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, groups + 1) ** exponent
    sizes = rng.multinomial(rows, weights / weights.sum())
    return tuple(int(s) for s in rng.permutation(sizes))


CASES = (
    # float32: an empty group and 5 rows past the sum; both rhs layouts; traced and concrete
    Case("f32_empty_group_and_tail", 37, 19, 23, (5, 0, 20, 7)),
    Case("f32_transposed", 37, 19, 23, (5, 0, 20, 7), transpose=True),
    Case("f32_concrete_sizes", 37, 19, 23, (5, 0, 20, 7), traced=False),
    # expert parallelism: rhs holds groups 1 and 2 of 4 (traced), 2 and 3 (concrete)
    Case("f32_offset", 37, 19, 23, (5, 3, 20, 7), local=2, offset=1),
    Case(
        "f32_offset_transposed_concrete",
        37,
        19,
        23,
        (5, 3, 20, 6),
        local=2,
        offset=2,
        transpose=True,
        traced=False,
    ),
    # every row in one group; one group; no rows
    Case("f32_one_group_holds_all", 40, 16, 24, (0, 40, 0)),
    Case("f32_single_group", 33, 20, 17, (30,)),
    Case("f32_no_rows", 0, 8, 8, (0, 0)),
    # K and N odd and larger than a tile, M not a multiple of one
    Case("f32_odd_257x129", 301, 257, 129, (100, 0, 57, 143, 1)),
    # 256 experts, Zipf-skewed routing (many empty), rows past the sum
    Case("f32_256_groups_zipf", 700, 24, 16, zipf_sizes(256, 650)),
    # 16-bit inputs
    Case("bf16_empty_group_and_tail", 37, 19, 23, (5, 0, 20, 7), dtype="bfloat16"),
    Case(
        "bf16_offset_transposed_out_f32",
        70,
        40,
        36,
        (9, 30, 0, 20),
        local=3,
        offset=1,
        transpose=True,
        dtype="bfloat16",
        out_dtype="float32",
    ),
    Case("bf16_odd_257x129", 301, 257, 129, (100, 0, 57, 143, 1), dtype="bfloat16"),
    Case("f16_empty_group_and_tail", 37, 19, 23, (5, 0, 20, 7), dtype="float16"),
)
CASE = {case.name: case for case in CASES}
assert len(CASE) == len(CASES), "case names must be unique"


class Inputs(typing.NamedTuple):
    lhs: jax.Array  # [M, K] float32 (cast by the runner)
    rhs: jax.Array  # [G, K, N] or [G, N, K]
    cotangent: jax.Array  # [M, N]


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    keys = jax.random.split(jax.random.key(seed), 3)
    lhs = 0.5 * jax.random.normal(keys[0], (case.M, case.K), jnp.float32)
    rhs = jax.random.normal(keys[1], case.rhs_shape, jnp.float32) / max(case.K, 1) ** 0.5
    cotangent = jax.random.normal(keys[2], (case.M, case.N), jnp.float32)
    return Inputs(lhs, rhs, cotangent)


def exact(case: Case, inputs: Inputs | None = None):
    """The float64 `(out, d_lhs, d_rhs)` of `case` and each entry's summation slack.

    An explicit loop over the local groups in numpy (the definition, independent of
    every implementation): group `g`'s rows are `[ends[g] - sizes[g], ends[g])`; rows of
    other groups and past the sum give zeros. The slack is `sqrt(terms) 2^-24 sum |terms|`,
    the rounding a float32 sum of those terms reaches in any order (as the matmul tests).
    """
    inputs = make_inputs(case) if inputs is None else inputs
    lhs, rhs, g = (np.asarray(x, np.float64) for x in inputs)
    sizes = np.asarray(case.sizes, np.int64)
    ends = np.cumsum(sizes)
    offset = case.offset or 0
    out, d_lhs = np.zeros((case.M, case.N)), np.zeros((case.M, case.K))
    d_rhs = np.zeros(case.rhs_shape)
    slack = [np.zeros_like(out), np.zeros_like(d_lhs), np.zeros_like(d_rhs)]
    unit = 2.0**-24
    for j in range(case.groups):
        rows = slice(ends[offset + j] - sizes[offset + j], ends[offset + j])
        w = rhs[j].T if case.transpose else rhs[j]  # [K, N]
        out[rows] = lhs[rows] @ w
        d_lhs[rows] = g[rows] @ w.T
        dw = lhs[rows].T @ g[rows]  # [K, N]
        d_rhs[j] = dw.T if case.transpose else dw
        slack[0][rows] = np.sqrt(case.K) * unit * (np.abs(lhs[rows]) @ np.abs(w))
        slack[1][rows] = np.sqrt(case.N) * unit * (np.abs(g[rows]) @ np.abs(w.T))
        terms = np.abs(lhs[rows]).T @ np.abs(g[rows])
        terms = np.sqrt(max(rows.stop - rows.start, 1)) * unit * terms
        slack[2][j] = terms.T if case.transpose else terms
    return tuple(x.astype(np.float32) for x in (out, d_lhs, d_rhs)), tuple(slack)


NAMES = ("out", "d_lhs", "d_rhs")
KINDS = ("output", "grad", "grad")


def assert_matches(got, case: Case, label: str, references) -> None:
    """`(out, d_lhs, d_rhs)` of a float32 case against the float64 loop (`exact`: 1e-5 /
    2e-5 plus the summation slack); of a 16-bit case by the 2x / 3x rule against
    `references()`, the reference implementation's `(ref32, ref_lp)`."""
    if case.dtype == "float32":
        values, slack = exact(case)
        for i, name in enumerate(NAMES):
            atol = F32_TOLERANCE[KINDS[i]] + slack[i]
            assert_close(got[i], values[i], atol=atol, kind=KINDS[i], name=f"{label} {name}")
        return
    ref32, ref_lp = references()
    for i, name in enumerate(NAMES):
        assert_close_low_precision(
            got[i], ref32[i], ref_lp[i], kind=KINDS[i], name=f"{label} {name}", relative_cap=i > 0
        )


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # test id
    implementation: str  # sf.grouped_matmul(implementation=...)
    default: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    deterministic: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    requires: tuple[str, ...] = ()
    block_sizes: tiles.BlockSizes | None = None
    marks: tuple = ()

    def unsupported(self, case: Case) -> str | None:
        """Why this backend cannot run `case` (its capability flags), or None."""
        if case.dtype not in self.dtypes or (case.out_dtype or case.dtype) not in self.dtypes:
            return f"{self.name} does not support {case.dtype} -> {case.out_dtype or case.dtype}"
        return None

    def require(self):
        for module in self.requires:
            pytest.importorskip(module, reason=f"{self.name} needs {module}")

    def grouped_matmul(self, lhs, rhs, sizes, offset, *, transpose, out_dtype):
        return sf.grouped_matmul(
            lhs,
            rhs,
            sizes,
            group_offset=offset,
            transpose_rhs=transpose,
            preferred_element_type=out_dtype,
            implementation=self.implementation,
        )

    def calling(self):
        if self.block_sizes is None:
            return contextlib.nullcontext()
        return tiles.block_sizes(self.block_sizes)


@dataclasses.dataclass(frozen=True)
class NativeCpu(Backend):
    def require(self):
        from shardfuse.kernels.attention import native_cpu

        ok, why = native_cpu.status("cpu")
        if not ok:
            pytest.skip(why)


@dataclasses.dataclass(frozen=True)
class TritonInterpreted(Backend):
    """The Triton kernels under the Triton interpreter on CPU (the JAX wrapper as on a GPU)."""

    def grouped_matmul(self, lhs, rhs, sizes, offset, *, transpose, out_dtype):
        from shardfuse.kernels.grouped_matmul import triton_gpu
        from shardfuse.kernels.triton.launch import InterpretLauncher

        config, sizes, offset = base.validate(
            lhs,
            rhs,
            sizes,
            group_offset=offset,
            transpose_rhs=transpose,
            preferred_element_type=out_dtype,
        )
        local, start = base.local_groups(sizes, offset, rhs.shape[0], lhs.shape[0])
        return triton_gpu.grouped_matmul(
            config, lhs, rhs, local, start, launcher=InterpretLauncher()
        )


REFERENCE = Backend("reference", "reference")

XLA = Backend("xla", "xla", default=tuple(CASE), deterministic=("f32_empty_group_and_tail",))
NATIVE_CPU = NativeCpu(
    "native_cpu",
    "native_cpu",
    default=tuple(CASE),
    deterministic=("f32_odd_257x129", "bf16_odd_257x129"),
    dtypes=("float32", "bfloat16"),
)
_PALLAS_DEFAULT = (
    "f32_empty_group_and_tail",
    "f32_offset_transposed_concrete",
    "bf16_offset_transposed_out_f32",
)
PALLAS_TPU = Backend(
    "pallas_tpu",
    "pallas_tpu",
    default=_PALLAS_DEFAULT,
    slow=tuple(name for name in CASE if name not in _PALLAS_DEFAULT),
    deterministic=("f32_empty_group_and_tail",),
    block_sizes=tiles.BlockSizes(block_m=16, block_k=128, block_n=128),
    marks=(pytest.mark.timeout(600),),
)
_TRITON_DEFAULT = ("f32_offset", "bf16_offset_transposed_out_f32")
# The interpreter runs a Python program per tile: 301 x 257 x 129 takes 100 s there.
_TRITON_SKIPPED = ("f32_no_rows", "f32_odd_257x129", "bf16_odd_257x129")
TRITON_INTERPRET = TritonInterpreted(
    "triton_interpret",
    "triton",
    requires=("torch", "triton"),
    default=_TRITON_DEFAULT,
    slow=tuple(name for name in CASE if name not in (*_TRITON_DEFAULT, *_TRITON_SKIPPED)),
    deterministic=("f32_offset",),
    block_sizes=tiles.BlockSizes(block_m=16, block_k=16, block_n=16),
    marks=(pytest.mark.timeout(600),),
)
TRITON_GPU = Backend(
    "triton_gpu",
    "triton",
    requires=("jax_triton",),
    default=tuple(CASE),
    deterministic=("bf16_odd_257x129",),
    marks=(pytest.mark.gpu,),
)

BACKENDS = (XLA, NATIVE_CPU, PALLAS_TPU, TRITON_INTERPRET, TRITON_GPU)
BY_NAME = {backend.name: backend for backend in (REFERENCE, *BACKENDS)}


@functools.cache
def _runner(backend_name: str, case_name: str, dtype: str, out_dtype: str | None):
    """Jitted `(lhs, rhs, sizes, offset, cotangent) -> (out, d_lhs, d_rhs)`; with concrete
    routing the sizes and offset are constants of the traced function instead."""
    backend, case = BY_NAME[backend_name], CASE[case_name]
    sizes_const = np.asarray(case.sizes, np.int32)
    offset_const = case.offset

    def run(lhs, rhs, sizes, offset, cotangent):
        if not case.traced:
            sizes, offset = sizes_const, offset_const

        def f(lhs, rhs):
            return backend.grouped_matmul(
                lhs, rhs, sizes, offset, transpose=case.transpose, out_dtype=out_dtype
            )

        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(cotangent.astype(out.dtype)))

    return jax.jit(run)


def run(backend: Backend, case: Case, inputs: Inputs, dtype: str, out_dtype: str | None):
    """`(out, d_lhs, d_rhs)` of `backend` as numpy arrays, inputs cast to `dtype`."""
    lhs, rhs = (x.astype(dtype) for x in inputs[:2])
    sizes = jnp.asarray(case.sizes, jnp.int32)
    offset = None if case.offset is None else jnp.asarray(case.offset, jnp.int32)
    with backend.calling():
        got = _runner(backend.name, case.name, dtype, out_dtype)(
            lhs, rhs, sizes, offset, inputs.cotangent
        )
        got = jax.block_until_ready(got)
    return tuple(np.asarray(x) for x in got)


@functools.cache
def results(backend_name: str, case_name: str, variant: str = "case"):
    """Cached `run` on the case's inputs.

    `variant`: "case" (the case's dtype and out_dtype); for the reference also
    "float32" (inputs rounded to the case's dtype, then upcast: `ref32` of TESTING.md)
    and "low" (in the case's dtype, result in that dtype: the low-precision reference).
    """
    backend, case = BY_NAME[backend_name], CASE[case_name]
    inputs = make_inputs(case)
    if variant == "float32":
        rounded = Inputs(*(x.astype(case.dtype) for x in inputs[:2]), inputs.cotangent)
        return run(backend, case, rounded, "float32", "float32")
    out_dtype = case.out_dtype
    if variant == "low":
        if out_dtype in (None, case.dtype):
            return results(backend_name, case_name)
        out_dtype = case.dtype
    return run(backend, case, inputs, case.dtype, out_dtype)
