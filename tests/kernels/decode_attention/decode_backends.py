"""The decode-attention implementations under test: capability flags, case budgets, runners.

Each `Backend` says what it supports (`dtypes`, `supports_head_dim`,
`supports_block_kv`, `supports_rows`) and which cases of `decode_cases.CASES`
it runs: `default` in the quick suite, `slow` under `-m slow` (the
interpreters are slow), `poisoned` with NaN where nothing may be read, and
`deterministic` twice. `unsupported(case)` is the skip reason the flags
give; `test_decode_backends.py` checks that the implementation really raises
NotImplementedError there (so that dispatch can fall back).

Every (backend, case) runs one jitted call (the Triton interpreter: eager, a
host callback per kernel), cached with its results.
"""

import contextlib
import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode
from tests.kernels.decode_attention.decode_cases import CASE, Case, make_inputs, poison

# Reads outside a buffer raise; fresh memory is NaN, so reading what a kernel never wrote shows.
STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # test id
    implementation: str  # sf.decode_attention(implementation=...)
    default: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    poisoned: tuple[str, ...] = ()
    deterministic: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    requires: tuple[str, ...] = ()
    marks: tuple = ()

    def supports_head_dim(self, head_dim: int, dtype: str) -> bool:
        return True

    def supports_block_kv(self, block_kv: int) -> bool:
        return True

    def supports_rows(self, case: Case) -> bool:
        return True

    def unsupported(self, case: Case) -> str | None:
        """Why this backend cannot run `case` (its capability flags), or None."""
        if case.dtype not in self.dtypes:
            return f"{self.name} does not support {case.dtype}"
        if not self.supports_head_dim(case.D, case.dtype):
            return f"{self.name} does not support head dim {case.D} in {case.dtype}"
        if case.block_kv is not None and not self.supports_block_kv(case.block_kv):
            return f"{self.name} does not chunk with block_kv={case.block_kv}"
        if not self.supports_rows(case):
            return f"{self.name} does not hold G * T = {case.H // case.K * case.T} rows"
        return None

    def require(self):
        for module in self.requires:
            pytest.importorskip(module, reason=f"{self.name} needs {module}")

    def attend(self, q, k, v, lengths, **kwargs):
        """`(out, lse)` of this implementation; kwargs as `sf.decode_attention`."""
        return sf.decode_attention(
            q, k, v, lengths, return_lse=True, implementation=self.implementation, **kwargs
        )

    def calling(self):
        """The context every call of this backend happens in."""
        return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class PallasTpu(Backend):
    """The Pallas TPU kernel in TPU interpret mode (STRICT) on CPU."""

    def supports_head_dim(self, head_dim, dtype):
        return head_dim % 128 == 0

    def supports_block_kv(self, block_kv):
        return block_kv % 128 == 0

    def calling(self):
        return interpret_mode(STRICT)


@dataclasses.dataclass(frozen=True)
class Triton(Backend):
    """The Triton kernel: jax-triton on an NVIDIA GPU, or the Triton interpreter on CPU."""

    interpreted: bool = False

    def supports_head_dim(self, head_dim, dtype):
        return head_dim <= (64 if dtype == "float32" else 256)

    def supports_rows(self, case):
        return case.H // case.K * case.T <= (128 if case.D <= 128 else 64)

    def attend(self, q, k, v, lengths, **kwargs):
        if not self.interpreted:
            return super().attend(q, k, v, lengths, **kwargs)
        from shardfuse.kernels.decode_attention import base, triton_gpu

        config = base.validate(q, k, v, lengths, scale=None, **kwargs)
        return triton_gpu.decode_attention(config, q, k, v, lengths, launcher=_interpret_launcher())


@functools.cache
def _interpret_launcher():
    from shardfuse.kernels.triton.launch import InterpretLauncher

    return InterpretLauncher()


REFERENCE = Backend("reference", "reference")
_XLA_DEFAULT = (
    "gqa4_t1_d128",
    "mqa_t3_window_d128",
    "lengths_0_1_full_softcap_d128",
    "bf16_gqa4_t4_window_softcap_d128",
    "f16_mqa_t1_d32",
)
XLA = Backend(
    "xla",
    "xla",
    default=_XLA_DEFAULT,
    slow=tuple(name for name in CASE if name not in _XLA_DEFAULT),  # everything else
    poisoned=("gqa4_t1_d128", "mqa_t3_window_d128", "lengths_0_1_full_softcap_d128"),
    deterministic=("bf16_gqa4_t4_window_softcap_d128",),
)
PALLAS_TPU = PallasTpu(
    "pallas_tpu",
    "pallas_tpu",
    dtypes=("float32", "bfloat16"),
    default=("gqa4_t1_d128", "mqa_t3_window_d128", "bf16_gqa4_t4_window_softcap_d128"),
    slow=("lengths_0_1_full_softcap_d128", "bf16_gqa8_t8_long_d128"),
    poisoned=("mqa_t3_window_d128",),
    deterministic=("gqa4_t1_d128",),
    marks=(pytest.mark.timeout(300),),
)
TRITON_INTERPRET = Triton(
    "triton_interpret",
    "triton",
    interpreted=True,
    requires=("torch", "triton"),
    default=("gqa4_t2_window_softcap_d64", "bf16_gqa2_t1_d64"),
    slow=("f16_mqa_t1_d32", "mha_t16_d64", "bf16_gqa4_t4_window_softcap_d128", "single_key_d16"),
    poisoned=("gqa4_t2_window_softcap_d64",),
    deterministic=("bf16_gqa2_t1_d64",),
    marks=(pytest.mark.timeout(300),),
)
TRITON_GPU = Triton(
    "triton_gpu",
    "triton",
    requires=("jax_triton",),
    default=tuple(CASE),
    poisoned=("gqa4_t1_d128", "mqa_t3_window_d128", "gqa4_t2_window_softcap_d64"),
    deterministic=("bf16_gqa8_t8_long_d128",),
    marks=(pytest.mark.gpu,),
)
BACKENDS = (XLA, PALLAS_TPU, TRITON_INTERPRET, TRITON_GPU)
BY_NAME = {backend.name: backend for backend in (REFERENCE, *BACKENDS)}


@functools.cache
def _runner(backend_name: str, case_name: str):
    backend, case = BY_NAME[backend_name], CASE[case_name]

    def run(q, k, v, lengths):
        return backend.attend(q, k, v, lengths, **case.options())

    # The Triton interpreter runs each kernel in a host callback: no jit needed around it.
    if isinstance(backend, Triton) and backend.interpreted:
        return run
    return jax.jit(run)


def run(backend: Backend, case: Case, inputs, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """`(out, lse)` of `backend` on `inputs` with q, k, v cast to `dtype`."""
    q, k, v = (x.astype(dtype) for x in inputs[:3])
    with backend.calling():
        out = jax.block_until_ready(_runner(backend.name, case.name)(q, k, v, inputs.lengths))
    return tuple(np.asarray(x) for x in out)


@functools.cache
def results(backend_name: str, case_name: str, variant: str = "clean"):
    """Cached `run`: `variant` "clean" or "poisoned"; for the reference also "clean-float32",
    the reference on the inputs rounded to the case's dtype and upcast (`ref32`)."""
    backend, case = BY_NAME[backend_name], CASE[case_name]
    inputs = make_inputs(case)
    if variant.startswith("poisoned"):
        inputs = poison(case, inputs)
    dtype = case.dtype
    if variant.endswith("-float32"):
        rounded = (x.astype(case.dtype).astype("float32") for x in inputs[:3])
        inputs, dtype = inputs._replace(**dict(zip("qkv", rounded, strict=True))), "float32"
    return run(backend, case, inputs, dtype)
