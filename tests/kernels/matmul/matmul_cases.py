"""The one matmul case matrix and the implementations tested on it.

A `Case` is `a [..., M, C] @ b [C, N] (+ addend [..., M, N]) (+ bias [N])`
with a dtype, an optional `out_dtype` and block sizes. Each `Backend` has
capability flags (`supports_dtype`, `supports_block_sizes`, `supports_vjp`)
and a budget of cases by name: `default`, `slow` (under `-m slow`) and
`deterministic`. Inputs are scaled so that outputs and gradients are O(1):
the bfloat16 absolute caps of TESTING.md (1e-2 outputs, 5e-2 gradients)
then bound real errors, not rounding of large values.

Each (backend, case) compiles one jitted function computing the output and
the vjp (a random cotangent) together; it is cached with its results.
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
from shardfuse.kernels.matmul import MatmulBlockSizes


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape_a: tuple[int, ...]  # [..., M, C]
    N: int
    dtype: str = "float32"
    addend: bool = True
    bias: bool = True
    epilogue_dtype: str = "float32"  # of addend and bias; "same": the inputs' dtype
    out_dtype: str | None = None
    block: tuple[int, int, int] | None = None  # (block_m, block_n, block_k)

    def block_sizes(self):
        return None if self.block is None else MatmulBlockSizes(*self.block)


CASES = (
    # float32: tiny, odd sizes, batch dims, with and without addend / bias
    Case("one_by_one", (1, 1), 1),
    Case("odd_7x97x113_addend", (7, 97), 113, bias=False),
    Case("batched_2x3x127x64x257_bias", (2, 3, 127, 64), 257, addend=False),
    Case("square_128x256x128", (128, 256), 128),
    Case("addend_bias_2x24x40x48", (2, 24, 40), 48),
    Case("deterministic_64x96x32", (64, 96), 32),
    # bfloat16 / float16, out_dtype default and float32
    Case("bf16_2x33x96x80", (2, 33, 96), 80, "bfloat16"),
    Case("bf16_2x33x96x80_out_f32", (2, 33, 96), 80, "bfloat16", out_dtype="float32"),
    Case("f16_2x33x96x80", (2, 33, 96), 80, "float16"),
    Case("f16_2x33x96x80_out_f32", (2, 33, 96), 80, "float16", out_dtype="float32"),
    Case("bf16_epilogue_bf16_2x24x40x48", (2, 24, 40), 48, "bfloat16", epilogue_dtype="same"),
    # 16-wide tiles: several tiles, ragged edges and K steps on tiny shapes (interpreters)
    Case("tiles16_2x37x45x29", (2, 37, 45), 29, block=(16, 16, 16)),
    Case("bf16_tiles16_33x40x24", (33, 40), 24, "bfloat16", bias=False, block=(16, 16, 16)),
    Case("f16_tiles16_33x40x24", (33, 40), 24, "float16", bias=False, block=(16, 16, 16)),
    Case("tiles16_20x24x18", (20, 24), 18, block=(16, 16, 16)),
    # 3 x 2 x 3 grid of TPU tiles, padded M, N and C
    Case("multi_tile_40x300x200", (40, 300), 200, block=(16, 128, 128)),
    # default tiles, several of them
    Case("bf16_2x300x256x384", (2, 300, 256), 384, "bfloat16"),
)
CASE = {case.name: case for case in CASES}
assert len(CASE) == len(CASES), "case names must be unique"


class Inputs(typing.NamedTuple):
    a: jax.Array  # [..., M, C] float32 (cast by the runner)
    b: jax.Array  # [C, N]
    addend: jax.Array | None  # [..., M, N]
    bias: jax.Array | None  # [N]
    cotangent: jax.Array  # [..., M, N]


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    keys = jax.random.split(jax.random.key(seed), 5)
    C, out_shape = case.shape_a[-1], (*case.shape_a[:-1], case.N)
    a = 0.5 * jax.random.normal(keys[0], case.shape_a, jnp.float32)
    b = jax.random.normal(keys[1], (C, case.N), jnp.float32) / max(C, 1) ** 0.5
    addend = 0.1 * jax.random.normal(keys[2], out_shape, jnp.float32)
    bias = 0.1 * jax.random.normal(keys[3], (case.N,), jnp.float32)
    cotangent = jax.random.normal(keys[4], out_shape, jnp.float32)
    return Inputs(a, b, addend if case.addend else None, bias if case.bias else None, cotangent)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # test id
    implementation: str  # sf.matmul(implementation=...)
    default: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    deterministic: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    supports_vjp: bool = True
    requires: tuple[str, ...] = ()
    marks: tuple = ()

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def supports_block_sizes(self, block: tuple[int, int, int]) -> bool:
        return True

    def unsupported(self, case: Case) -> str | None:
        """Why this backend cannot run `case` (its capability flags), or None."""
        if not self.supports_dtype(case.dtype):
            return f"{self.name} does not support {case.dtype}"
        if case.block is not None and not self.supports_block_sizes(case.block):
            return f"{self.name} does not tile with blocks {case.block}"
        return None

    def require(self):
        for module in self.requires:
            pytest.importorskip(module, reason=f"{self.name} needs {module}")

    def matmul(self, a, b, addend, bias, *, out_dtype=None, block_sizes=None):
        return sf.matmul(
            a,
            b,
            addend=addend,
            bias=bias,
            out_dtype=out_dtype,
            block_sizes=block_sizes,
            implementation=self.implementation,
        )

    def calling(self):
        return contextlib.nullcontext()


class PallasTpu(Backend):
    """The Pallas TPU kernel in TPU interpret mode (every dtype; Mosaic refuses float16)."""

    def supports_block_sizes(self, block):
        block_m, block_n, block_k = block
        return block_m % 16 == 0 and block_n % 128 == 0 and block_k % 128 == 0


@dataclasses.dataclass(frozen=True)
class Triton(Backend):
    """The Triton kernel: jax-triton on an NVIDIA GPU, or the Triton interpreter on CPU."""

    interpreted: bool = False

    def supports_block_sizes(self, block):
        return all(size >= 16 and size & (size - 1) == 0 for size in block)

    def matmul(self, a, b, addend, bias, *, out_dtype=None, block_sizes=None):
        if not self.interpreted:
            return super().matmul(a, b, addend, bias, out_dtype=out_dtype, block_sizes=block_sizes)
        from shardfuse.kernels.matmul import base, triton_gpu
        from shardfuse.kernels.triton.launch import InterpretLauncher

        config = base.validate(
            a, b, addend=addend, bias=bias, out_dtype=out_dtype, block_sizes=block_sizes
        )
        return triton_gpu.matmul(config, a, b, addend, bias, launcher=InterpretLauncher())


REFERENCE = Backend("reference", "reference")

_XLA_AND_PALLAS = (
    "one_by_one",
    "odd_7x97x113_addend",
    "batched_2x3x127x64x257_bias",
    "square_128x256x128",
    "addend_bias_2x24x40x48",
    "deterministic_64x96x32",
    "bf16_2x33x96x80",
    "bf16_2x33x96x80_out_f32",
    "f16_2x33x96x80",
    "f16_2x33x96x80_out_f32",
    "bf16_epilogue_bf16_2x24x40x48",
    "multi_tile_40x300x200",
)
_TILES16 = (
    "tiles16_2x37x45x29",
    "bf16_tiles16_33x40x24",
    "f16_tiles16_33x40x24",
    "tiles16_20x24x18",
)

XLA = Backend(
    "xla",
    "xla",
    default=_XLA_AND_PALLAS,
    slow=tuple(name for name in CASE if name not in _XLA_AND_PALLAS),
    deterministic=("deterministic_64x96x32",),
)
PALLAS_TPU = PallasTpu(
    "pallas_tpu",
    "pallas_tpu",
    default=_XLA_AND_PALLAS,
    slow=tuple(name for name in CASE if name not in _XLA_AND_PALLAS),
    deterministic=("deterministic_64x96x32",),
    marks=(pytest.mark.timeout(300),),
)
TRITON_INTERPRET = Triton(
    "triton_interpret",
    "triton",
    interpreted=True,
    requires=("torch", "triton"),
    default=_TILES16,
    slow=tuple(name for name in CASE if name not in _TILES16),
    deterministic=("tiles16_20x24x18",),
)
TRITON_GPU = Triton(
    "triton_gpu",
    "triton",
    requires=("jax_triton",),
    default=tuple(CASE),
    deterministic=("bf16_2x300x256x384",),
    marks=(pytest.mark.gpu,),
)

BACKENDS = (XLA, PALLAS_TPU, TRITON_INTERPRET, TRITON_GPU)
BY_NAME = {backend.name: backend for backend in (REFERENCE, *BACKENDS)}


@functools.cache
def _runner(backend_name: str, case_name: str):
    """Jitted `(a, b, addend, bias, cotangent) -> (out, da, db, daddend, dbias)`."""
    backend, case = BY_NAME[backend_name], CASE[case_name]
    block_sizes = None if backend is REFERENCE else case.block_sizes()

    @functools.partial(jax.jit, static_argnames="out_dtype")
    def run(a, b, addend, bias, cotangent, out_dtype):
        def f(a, b, addend, bias):
            return backend.matmul(a, b, addend, bias, out_dtype=out_dtype, block_sizes=block_sizes)

        out, vjp = jax.vjp(f, a, b, addend, bias)
        return (out, *vjp(cotangent.astype(out.dtype)))

    return run


def run(backend, case: Case, inputs: Inputs, dtype: str, out_dtype: str | None):
    """`(out, da, db, daddend, dbias)` of `backend`, inputs cast to `dtype` (None for absent)."""
    epilogue = dtype if case.epilogue_dtype == "same" else case.epilogue_dtype
    a, b = (x.astype(dtype) for x in inputs[:2])
    addend, bias = (None if x is None else x.astype(epilogue) for x in inputs[2:4])
    run_jitted = _runner(backend.name, case.name)
    with backend.calling():
        results = run_jitted(a, b, addend, bias, inputs.cotangent, out_dtype=out_dtype)
        results = jax.block_until_ready(results)
    return tuple(None if x is None else np.asarray(x) for x in results)


@functools.cache
def exact_results(case_name: str):
    """The exact `(out, da, db, daddend, dbias)` of a float32 case, and each one's summation slack.

    Returns `(values, slack)`: float64 numpy results rounded to float32 (None for
    absent), and per entry `sqrt(K) * 2**-24 * sum_k |term_k|`, the rounding
    error a float32 sum of those K terms reaches in any order (the probabilistic
    bound; the worst case has K for sqrt(K)). Two float32 implementations that
    sum in different orders (a GPU's tiles against cuBLAS) each stay near the
    exact result but not always within the fixed tolerance of it when terms
    cancel: seen on an H200, `db` of the 762-row batched case, one entry of 16448.
    The slack is added to atol; a wrong or missing term is of the order of a
    term itself, thousands of times larger.
    """
    case = CASE[case_name]
    inputs = make_inputs(case)
    a, b, addend, bias, g = (None if x is None else np.asarray(x, np.float64) for x in inputs)
    out = a @ b + (0.0 if addend is None else addend) + (0.0 if bias is None else bias)
    rows_a, rows_g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    values = (
        out,
        g @ b.T,
        rows_a.T @ rows_g,
        None if addend is None else g,
        None if bias is None else rows_g.sum(0),
    )
    rows = rows_g.shape[0]
    unit = 2.0**-24
    magnitudes = (
        (np.abs(a) @ np.abs(b), a.shape[-1]),
        (np.abs(g) @ np.abs(b.T), b.shape[-1]),
        (np.abs(rows_a.T) @ np.abs(rows_g), rows),
        (np.abs(g), 1),
        (np.abs(rows_g).sum(0), rows),
    )
    values = tuple(None if x is None else x.astype(np.float32) for x in values)
    slack = tuple(
        None if x is None else np.sqrt(terms) * unit * total
        for x, (total, terms) in zip(values, magnitudes, strict=True)
    )
    return values, slack


@functools.cache
def results(backend_name: str, case_name: str, variant: str = "case"):
    """Cached `run` on the case's inputs.

    `variant`: "case" (the case's dtype and out_dtype); for the reference also
    "float32" (the inputs rounded to the case's dtype, then upcast: `ref32` of
    TESTING.md) and "low" (in the case's dtype with `out_dtype` that dtype too:
    the low-precision reference).
    """
    backend, case = BY_NAME[backend_name], CASE[case_name]
    inputs = make_inputs(case)
    if variant == "float32":
        epilogue = case.dtype if case.epilogue_dtype == "same" else case.epilogue_dtype
        rounded = [None if x is None else x.astype(case.dtype) for x in inputs[:2]]
        rounded += [None if x is None else x.astype(epilogue) for x in inputs[2:4]]
        inputs = Inputs(*rounded, inputs.cotangent)
        case32 = dataclasses.replace(case, dtype="float32", epilogue_dtype="float32")
        return run(backend, case32, inputs, "float32", "float32")
    out_dtype = case.out_dtype
    if variant == "low":
        if out_dtype in (None, case.dtype):
            return results(backend_name, case_name)  # the same computation
        out_dtype = case.dtype
    return run(backend, case, inputs, case.dtype, out_dtype)
