"""The cudnn backend: what it refuses (on any host) and, on a GPU, values and gradients.

cuDNN returns no float32 lse, so the shared body (which checks lse) does not
run it: here `out` and the gradients are checked against the reference with
TESTING.md's low-precision rule, on every case its rules accept.
"""

import jax
import jax.numpy as jnp
import pytest

import shardfuse as sf
from shardfuse.kernels.attention import base, cudnn
from shardfuse.testing import assert_close_low_precision

Q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)


def _config(**options):
    options = dict(dict(causal=False, window=None, logit_softcap=None, scale=0.125), **options)
    return base.AttentionConfig(**options)


@pytest.mark.parametrize(
    "options, kwargs, reason",
    [
        (dict(), dict(need_lse=True), "no float32 lse"),
        (dict(default_positions=True), dict(q=jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.float32)),
         "bfloat16 and float16"),
        (dict(default_positions=True), dict(q_seg=jnp.zeros((1, 256))), "no segment ids"),
        (dict(logit_softcap=30.0), {}, "no logit softcap"),
        (dict(window=(16, 16)), {}, "left window under causal"),
        (dict(causal=True, window=(None, 4)), {}, "left window under causal"),
        (dict(causal=True), {}, "top-left"),  # explicit positions
        (dict(causal=True, default_positions=True), dict(k=jax.ShapeDtypeStruct((1, 300, 4, 64),
         jnp.bfloat16)), "T == S"),
        (dict(), dict(q=jax.ShapeDtypeStruct((1, 256, 4, 20), jnp.bfloat16)), "multiples of 8"),
        (dict(), dict(q=jax.ShapeDtypeStruct((1, 256, 4, 256), jnp.bfloat16), capability=80),
         "up to 128"),
    ],
)  # fmt: skip
def test_refuses_what_cudnn_does_not_run(options, kwargs, reason):
    call = dict(q=Q, k=Q, q_seg=None, need_lse=False, capability=90) | kwargs
    reason_given = cudnn.refusal(
        _config(**options), call["q"], call["k"], call["q_seg"], need_lse=call["need_lse"],
        capability=call["capability"],
    )  # fmt: skip
    assert reason_given is not None and reason in reason_given


@pytest.mark.parametrize(
    "options", [dict(), dict(causal=True, default_positions=True),
                dict(causal=True, window=(64, None), default_positions=True)],
)  # fmt: skip
def test_runs_what_cudnn_runs(options):
    assert cudnn.refusal(_config(**options), Q, Q, None, need_lse=False, capability=90) is None


def test_on_cpu_it_is_not_available_and_dispatch_passes_over_it():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU cudnn runs")
    usable, why = sf.kernels.registry.get("attention").status()["cudnn"]
    assert not usable and "NVIDIA" in why
    q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="NVIDIA GPU"):
        sf.flash_attention(q, q, q, implementation="cudnn")
    out = sf.flash_attention(q, q, q, implementation=("cudnn", "xla"))
    assert out.shape == q.shape


GPU_CASES = [
    # (B, T, S, H, K, D, dtype, options)
    (2, 512, 512, 8, 2, 64, "bfloat16", dict(causal=True)),
    (1, 1024, 1024, 4, 4, 128, "float16", dict()),
    (2, 384, 640, 4, 1, 128, "bfloat16", dict()),
    (1, 1024, 1024, 4, 2, 128, "bfloat16", dict(causal=True, window=(100, 0))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, S, H, K, D, dtype, options", GPU_CASES, ids=str)
def test_matches_reference_on_a_gpu(B, T, S, H, K, D, dtype, options):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, H, D))
    k = jax.random.normal(keys[1], (B, S, K, D))
    v = jax.random.uniform(keys[2], (B, S, K, D), minval=-1.0, maxval=1.0)
    d_out = jax.random.normal(keys[3], q.shape)

    def run(implementation, q, k, v):
        def attend(q, k, v):
            return sf.flash_attention(q, k, v, implementation=implementation, **options)

        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(d_out.astype(out.dtype)))

    low = [x.astype(dtype) for x in (q, k, v)]
    got = jax.jit(lambda *a: run("cudnn", *a))(*low)
    ref_lp = jax.jit(lambda *a: run("reference", *a))(*low)
    ref32 = jax.jit(lambda *a: run("reference", *a))(*(x.astype(jnp.float32) for x in low))
    for name, kind, a, r32, rlp in zip(
        ("out", "dq", "dk", "dv"),
        ("output", "grad", "grad", "grad"),
        got,
        ref32,
        ref_lp,
        strict=True,
    ):
        assert_close_low_precision(a, r32, rlp, kind=kind, name=f"cudnn {name}")
