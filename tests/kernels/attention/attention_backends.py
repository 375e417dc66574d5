"""The attention implementations under test: capability flags, case budgets, cached runners.

Each `Backend` says what it supports (`supports_dtype`, `supports_head_dim`,
`supports_block_sizes`, `supports_vjp`, `supports_segment_ids`,
`supports_positions`) and which cases of `attention_cases.CASES` it runs:
`default` by default, `slow` under `-m slow` (the interpreters are slow, so
their budgets are small), `poisoned` with NaN in invisible positions and
`deterministic` twice. `unsupported(case)` is the skip reason the flags give,
and `test_attention_backends.py` checks that the implementation really
raises NotImplementedError there (so dispatch can fall back).

Every (backend, case) compiles one jitted function computing out, lse and
the vjp together, with positions and segment ids as arguments; it is cached
with its results, so the fully-masked, NaN and determinism tests reuse them.
The reference runs the same way and its results are shared by all backends.
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode
from tests.kernels.attention.attention_cases import CASE, Case, Inputs, make_inputs, poison

# The Pallas TPU interpreter under test: reads outside a buffer raise, fresh memory
# (scratch, block padding) is NaN, so reading what a kernel never wrote shows as NaN.
STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str  # test id
    implementation: str  # sf.flash_attention(implementation=...)
    default: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    poisoned: tuple[str, ...] = ()
    deterministic: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    supports_vjp: bool = True
    supports_segment_ids: bool = True
    supports_positions: bool = True
    requires: tuple[str, ...] = ()  # modules to importorskip
    marks: tuple = ()

    def supports_dtype(self, dtype: str) -> bool:
        return dtype in self.dtypes

    def supports_head_dim(self, head_dim: int, dtype: str) -> bool:
        return True

    def supports_block_sizes(self, block: tuple[int, int]) -> bool:
        return True

    def unsupported(self, case: Case) -> str | None:
        """Why this backend cannot run `case` (its capability flags), or None."""
        if not self.supports_dtype(case.dtype):
            return f"{self.name} does not support {case.dtype}"
        if not self.supports_head_dim(case.D, case.dtype):
            return f"{self.name} does not support head dim {case.D} in {case.dtype}"
        if case.block is not None and not self.supports_block_sizes(case.block):
            return f"{self.name} does not tile with blocks {case.block}"
        if case.segments and not self.supports_segment_ids:
            return f"{self.name} does not support segment ids"
        if case.shuffled and not self.supports_positions:
            return f"{self.name} does not support positions"
        return None

    def require(self):
        for module in self.requires:
            pytest.importorskip(module, reason=f"{self.name} needs {module}")

    def attend(self, q, k, v, **kwargs):
        """`(out, lse)` of this implementation; kwargs as `sf.flash_attention`."""
        return sf.flash_attention(
            q, k, v, return_lse=True, implementation=self.implementation, **kwargs
        )

    def calling(self):
        """The context every call of this backend (tracing and running) happens in."""
        return contextlib.nullcontext()


class Reference(Backend):
    """The oracle: `sf.attention_reference`."""


class Xla(Backend):
    """Blockwise flash attention in plain JAX: every dtype, head dim and block size."""


@dataclasses.dataclass(frozen=True)
class PallasTpu(Backend):
    """The Pallas TPU kernels in TPU interpret mode (STRICT) on CPU."""

    def supports_head_dim(self, head_dim, dtype):
        return head_dim == 64 or head_dim % 128 == 0

    def supports_block_sizes(self, block):
        return all(b % 128 == 0 for b in block)

    def calling(self):
        return interpret_mode(STRICT)


@dataclasses.dataclass(frozen=True)
class Triton(Backend):
    """The Triton kernels: jax-triton on an NVIDIA GPU, or the Triton interpreter on CPU.

    The interpreter runs the whole JAX wrapper of `triton_gpu.py` (block tables,
    custom_vjp, jit); only the launcher differs: each kernel runs in a worker
    process started with `TRITON_INTERPRET=1`, on torch CPU tensors.
    """

    interpreted: bool = False

    def supports_head_dim(self, head_dim, dtype):
        return head_dim <= 256 and (dtype != "float32" or head_dim <= 64)

    def supports_block_sizes(self, block):
        return all(b >= 16 and b & (b - 1) == 0 for b in block)

    def attend(self, q, k, v, **kwargs):
        if not self.interpreted:
            return super().attend(q, k, v, **kwargs)
        return _interpreted_triton(q, k, v, **kwargs)


def _interpreted_triton(q, k, v, *, block_sizes=None, **kwargs):
    """`sf.flash_attention(implementation="triton")` with the interpreter launcher."""
    from shardfuse.kernels.attention import base, triton_gpu

    options = dict(q_positions=None, kv_positions=None, q_segment_ids=None, kv_segment_ids=None)
    options.update(window=None, logit_softcap=None, scale=None, causal=False)
    options.update(kwargs)
    config = base.validate(q, k, v, block_sizes=block_sizes, **options)
    q_pos, kv_pos = base.default_positions(
        q.shape[1], k.shape[1], options["q_positions"], options["kv_positions"]
    )
    return triton_gpu.flash_attention(
        config,
        q,
        k,
        v,
        q_pos,
        kv_pos,
        options["q_segment_ids"],
        options["kv_segment_ids"],
        launcher=_interpret_launcher(),
    )


@functools.cache
def _interpret_launcher():
    from shardfuse.kernels.triton.launch import InterpretLauncher

    return InterpretLauncher()


REFERENCE = Reference("reference", "reference")

_XLA_DEFAULT = (
    "single_token",
    "causal_7",
    "causal_mqa_97x113",
    "every_mask_d20",
    "shuffled_causal_96",
    "masked_rows_40x24",
    "window_segments_48x80",
    "causal_segments_97x113",
    "f16_causal_65",
)
XLA = Xla(
    "xla",
    "xla",
    default=_XLA_DEFAULT,
    slow=tuple(name for name in CASE if name not in _XLA_DEFAULT),  # everything else
    poisoned=("masked_rows_40x24", "window_segments_48x80"),
    deterministic=("causal_segments_97x113",),
)

PALLAS_TPU = PallasTpu(
    "pallas_tpu",
    "pallas_tpu",
    dtypes=("float32", "bfloat16"),
    default=(
        "causal_mqa_97x257_d128",
        "dense_full_blocks_256",
        "bf16_causal_gqa_256",
    ),
    slow=(
        "bf16_causal_mqa_1024_d128",
        "single_query_127",
        "window_7x113_d64",
        "causal_mqa_127x257_d128",
        "window_softcap_mqa_384",
        "bf16_segments_softcap_257",
    ),
    poisoned=("segments_causal_200_d128", "causal_gqa_257x113_d64"),
    deterministic=("bf16_causal_gqa_256",),
    # Interpret mode can hang rather than fail (see `run`): cap each test.
    marks=(pytest.mark.timeout(300),),
)

TRITON_INTERPRET = Triton(
    "triton_interpret",
    "triton",
    interpreted=True,
    requires=("torch", "triton"),
    default=(
        "causal_gqa_37x45",
        "f16_segments_window_softcap_48",
        "shuffled_causal_mqa_40",
        "segments_default_tiles_24x40",
    ),
    slow=("bf16_causal_d128_130x257", "segments_softcap_window_200"),
    poisoned=("segments_default_tiles_24x40",),
    deterministic=("causal_gqa_37x45",),
)

TRITON_GPU = Triton(
    "triton_gpu",
    "triton",
    requires=("jax_triton",),
    default=tuple(CASE),  # every case its flags allow: a GPU is fast
    poisoned=("masked_rows_40x24", "window_segments_48x80", "segments_causal_200_d128"),
    deterministic=("bf16_causal_gqa_300",),
    marks=(pytest.mark.gpu,),
)


@dataclasses.dataclass(frozen=True)
class NativeCpu(Backend):
    """The C++ kernels (XLA FFI custom calls); skipped where the extension is not built."""

    def supports_head_dim(self, head_dim, dtype):
        return head_dim <= 512


_NATIVE_DEFAULT = (
    *_XLA_DEFAULT,
    "causal_gqa8_2_113x97",
    "d128_blocks_8x24",
    "segments_causal_200_d128",
    "window_softcap_gqa8_2_shuffled_256",
    "bf16_window_softcap_segments_gqa8_2",
    "bf16_causal_gqa_300",
)
NATIVE_CPU = NativeCpu(
    "native_cpu",
    "native_cpu",
    dtypes=("float32", "bfloat16"),
    requires=("shardfuse._native",),
    default=_NATIVE_DEFAULT,
    slow=tuple(name for name in CASE if name not in _NATIVE_DEFAULT),  # everything else
    poisoned=(
        "masked_rows_40x24",
        "window_segments_48x80",
        "segments_causal_200_d128",
        "bf16_window_softcap_segments_gqa8_2",
    ),
    deterministic=("causal_segments_97x113", "bf16_causal_gqa_300"),
)


@dataclasses.dataclass(frozen=True)
class MosaicGpu(Backend):
    """Pallas Mosaic GPU kernels: compiled on an sm_90+ GPU, or in Mosaic GPU interpret mode on
    CPU (`InterpretGPUParams`; jax >= 0.11, whose interpreter runs warp-specialized kernels)."""

    interpreted: bool = False

    def supports_head_dim(self, head_dim, dtype):
        return head_dim <= 256

    def supports_block_sizes(self, block):
        return block[0] == 64 and block[1] in (64, 128)

    def require(self):
        super().require()
        if self.interpreted:
            from shardfuse import _compat

            try:
                _compat.mosaic_gpu_interpret_params()
            except NotImplementedError as e:
                pytest.skip(str(e))

    def calling(self):
        if not self.interpreted:
            return contextlib.nullcontext()
        from shardfuse import _compat
        from shardfuse.kernels.attention import mosaic_gpu

        return mosaic_gpu.interpret_mode(_compat.mosaic_gpu_interpret_params())


MOSAIC_GPU_INTERPRET = MosaicGpu(
    "mosaic_gpu_interpret",
    "mosaic_gpu",
    interpreted=True,
    dtypes=("bfloat16", "float16"),
    default=(
        "f16_causal_65",
        "bf16_window_softcap_segments_gqa8_2",
        "bf16_shuffled_causal_gqa_130",
    ),
    slow=(
        "bf16_causal_d256",
        "bf16_causal_d128_130x257",
        "f16_window_softcap_segments_d128_100x200",
        "bf16_two_sided_window_d256_70x150",
        "bf16_kv_block_64_gqa_200",
        "bf16_segments_softcap_257",
    ),
    poisoned=("bf16_window_softcap_segments_gqa8_2",),
    deterministic=("f16_causal_65",),
    marks=(pytest.mark.timeout(600),),
)

MOSAIC_GPU = MosaicGpu(
    "mosaic_gpu",
    "mosaic_gpu",
    dtypes=("bfloat16", "float16"),
    default=tuple(CASE),  # every case its flags allow: a GPU is fast
    poisoned=(
        "bf16_window_softcap_segments_gqa8_2",
        "f16_window_softcap_segments_d128_100x200",
        "bf16_two_sided_window_d256_70x150",
    ),
    deterministic=("bf16_causal_gqa_300", "bf16_two_sided_window_d256_70x150"),
    marks=(pytest.mark.gpu,),
)

BACKENDS = (
    XLA, PALLAS_TPU, TRITON_INTERPRET, TRITON_GPU, NATIVE_CPU, MOSAIC_GPU_INTERPRET, MOSAIC_GPU
)  # fmt: skip

BY_NAME = {backend.name: backend for backend in (REFERENCE, *BACKENDS)}


@functools.cache
def _runner(backend_name: str, case_name: str):
    """Jitted `(q, k, v, d_out, d_lse, q_pos, kv_pos, q_seg, kv_seg) -> (out, lse, dq, dk, dv)`."""
    backend, case = BY_NAME[backend_name], CASE[case_name]
    extra = {} if case.block is None else {"block_sizes": sf.BlockSizes(*case.block)}

    @jax.jit
    def run(q, k, v, d_out, d_lse, q_pos, kv_pos, q_seg, kv_seg):
        def attend(q, k, v):
            return backend.attend(
                q,
                k,
                v,
                q_positions=q_pos,
                kv_positions=kv_pos,
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
                **case.options(),
                **extra,
            )

        (out, lse), vjp = jax.vjp(attend, q, k, v)
        # lse cotangents only where lse is finite, as a user's loss would be.
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
        return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))

    return run


def run(backend: Backend, case: Case, inputs: Inputs, dtype: str) -> tuple[np.ndarray, ...]:
    """`(out, lse, dq, dk, dv)` of `backend` on `inputs` with q, k, v cast to `dtype`."""
    q, k, v = (x.astype(dtype) for x in inputs[:3])
    with backend.calling():
        # Block: JAX's TPU interpreter runs JAX ops inside its host callbacks, which
        # deadlock against anything dispatched to the CPU device meanwhile.
        results = jax.block_until_ready(_runner(backend.name, case.name)(q, k, v, *inputs[3:]))
    return tuple(np.asarray(x) for x in results)


@functools.cache
def results(backend_name: str, case_name: str, variant: str = "clean"):
    """Cached `run` of a backend on a case's inputs: `variant` "clean" or "poisoned".

    For the reference, `variant` may end in "-float32": the reference on the
    inputs rounded to the case's dtype, then upcast (`ref32` of TESTING.md).
    """
    backend, case = BY_NAME[backend_name], CASE[case_name]
    inputs = make_inputs(case)
    if variant.startswith("poisoned"):
        inputs = poison(case, inputs)
    dtype = case.dtype
    if variant.endswith("-float32"):
        rounded = (x.astype(case.dtype).astype(jnp.float32) for x in inputs[:3])
        inputs, dtype = inputs._replace(**dict(zip("qkv", rounded, strict=True))), "float32"
    return run(backend, case, inputs, dtype)
