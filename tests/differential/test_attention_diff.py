"""Generated differential test of `sf.flash_attention` against `sf.attention_reference`.

Hypothesis draws `FlashConfig`s (strategies_attention.py) over the whole option space:
every implementation that runs on CPU (reference, xla, pallas_tpu in TPU interpret mode;
triton in the Triton interpreter under -m slow) x causal / window / segment ids / softcap /
scale / permuted positions, alone and combined x GQA (MHA, 4:1, 8:2, MQA) x T != S and odd
lengths x head dims x block sizes x float32 / bfloat16 / float16. Each configuration runs
out, lse and the vjp of a random cotangent in one jitted call, and is compared with
`sf.attention_reference` (float32: 1e-5 / 2e-5; low precision: the flash-attention rule of
TESTING.md). In the same call `sf.attention_reference` itself is checked against the
independent oracle of strategies_attention.py. A configuration the API refuses must raise
the predicted exception naming the argument; nothing else may fail.
"""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.differential import strategies_attention as sa
from tests.differential.budget import budget_params

pytestmark = pytest.mark.timeout(1200)

# Reads outside a buffer raise; fresh memory is NaN, so reading what a kernel never wrote shows.
STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")

NAMES = ("out", "lse", "dq", "dk", "dv")


def _options(config):
    return dict(causal=config.causal, window=config.window, logit_softcap=config.softcap,
                scale=config.scale)  # fmt: skip


def _attend(config, implementation):
    """`(q, k, v, positions, segments) -> (out, lse)` of one implementation."""
    options = _options(config)
    block = None if config.block is None else sf.BlockSizes(*config.block)

    def attend(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        kwargs = dict(q_positions=q_pos, kv_positions=kv_pos, q_segment_ids=q_seg,
                      kv_segment_ids=kv_seg, **options)  # fmt: skip
        if implementation == "triton":  # the Triton interpreter's launcher on CPU
            from tests.kernels.attention.attention_backends import _interpreted_triton

            return _interpreted_triton(q, k, v, block_sizes=block, **kwargs)
        return sf.flash_attention(
            q, k, v, return_lse=True, implementation=implementation, block_sizes=block, **kwargs
        )

    return attend


def _vjp(attend, q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(attend, q, k, v)
    return (out, lse, *vjp((d_out.astype(out.dtype), sa.masked_cotangent(d_lse, lse))))


@functools.cache
def _program(config):
    """One jitted call: `(actual, ref32, oracle, ref_lp or None)`, each `(out, lse, dq, dk, dv)`.

    actual: the implementation on q, k, v in the config's dtype; ref32 and oracle:
    `sf.attention_reference` and the independent oracle on those inputs upcast to
    float32; ref_lp: the reference in the low precision (for bfloat16 / float16).
    Cached on the static part of the config (one compile per shape and options)."""
    attend, reference = _attend(config, config.implementation), _attend(config, "reference")
    scale = config.scale if config.scale is not None else 1.0 / np.sqrt(config.D)

    @jax.jit
    def run(q, k, v, d_out, d_lse, q_pos, kv_pos, q_seg, kv_seg):
        q, k, v = (x.astype(config.dtype) for x in (q, k, v))
        q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
        masks = (q_pos, kv_pos, q_seg, kv_seg)
        oracle = functools.partial(
            sa.oracle_attention, causal=config.causal, window=config.window,
            softcap=config.softcap, scale=scale, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg,
            kv_seg=kv_seg,
        )  # fmt: skip
        actual = _vjp(lambda *x: attend(*x, *masks), q, k, v, d_out, d_lse)
        ref32 = _vjp(lambda *x: reference(*x, *masks), q32, k32, v32, d_out, d_lse)
        independent = _vjp(oracle, q32, k32, v32, d_out, d_lse)
        low = None
        if config.dtype != "float32":
            low = _vjp(lambda *x: reference(*x, *masks), q, k, v, d_out, d_lse)
        return actual, ref32, independent, low

    return run


def _static(config):
    """The config without its seed: the compile cache key."""
    return config.__class__(**{**config.__dict__, "seed": 0})


def _results(config, inputs):
    args = [inputs[n] for n in ("q", "k", "v", "d_out", "d_lse", "q_pos", "kv_pos")]
    args += [inputs["q_seg"], inputs["kv_seg"]]
    context = interpret_mode(STRICT) if config.implementation == "pallas_tpu" else _null()
    with context:
        # Block inside the context: the TPU interpreter's callbacks run JAX ops on CPU.
        results = jax.block_until_ready(_program(_static(config))(*args))
    return jax.tree.map(lambda x: np.asarray(x, np.float32), results)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def check_flash(config: sa.FlashConfig, tally: sa.Tally | None = None) -> None:
    """Runs one configuration and compares it (or checks its refusal)."""
    inputs = sa.attention_inputs(
        config.seed, config.B, config.T, config.S, config.H, config.K, config.D,
        config.segments, positions=config.positions,
    )  # fmt: skip
    refusal = config.refusal()
    if tally is not None:
        tally.count(refusal is not None)
    if config.bad is not None:
        _check_refused(config, inputs, refusal)
        return
    if refusal is not None:  # a backend's NotImplementedError (dispatch falls back on it)
        with pytest.raises(refusal[0], match=refusal[1]):
            _results(config, inputs)
        return
    actual, reference, oracle, low = _results(config, inputs)
    for name, ref, orc in zip(NAMES, reference, oracle, strict=True):
        kind = "output" if name in ("out", "lse") else "grad"
        assert_close(ref, orc, kind=kind, name=f"reference vs independent oracle: {name}")
    for i, name in enumerate(NAMES):
        kind = "output" if name in ("out", "lse") else "grad"
        what = f"{config.implementation} {name}"
        if low is None:
            assert_close(actual[i], reference[i], kind=kind, name=what)
        else:
            assert_close_low_precision(
                actual[i], reference[i], low[i], kind=kind, name=what, relative_cap=True
            )


def _check_refused(config, inputs, refusal):
    exception, text = refusal
    with pytest.raises(exception, match=text):
        q, k, v = sa.cast_inputs(config, inputs["q"], inputs["k"], inputs["v"])
        kwargs = sa.attention_kwargs(config, inputs)
        if config.bad == "one_sided_segments":
            kwargs["q_segment_ids"] = jnp.zeros((config.B, config.T), jnp.int32)
        block = (0, 8) if config.bad == "block" else config.block
        sf.flash_attention(
            q, k, v, implementation=config.implementation,
            block_sizes=None if block is None else sf.BlockSizes(*block), **kwargs,
        )  # fmt: skip


def _corner(**overrides):
    base = dict(implementation="xla", B=1, T=37, S=53, H=8, K=2, D=12, causal=True,
                window=(5, 2), softcap=20.0, segments=2, scale=None, positions="default",
                block=(16, 32), dtype="float32", seed=1)  # fmt: skip
    return sa.FlashConfig(**{**base, **overrides})


# Known-dangerous corners, always run first: every mask at once with T < S and with T > S,
# MQA, permuted positions, odd tiles; bf16 with fully masked rows (a window of 0 across
# segment boundaries).
CORNERS = (
    _corner(),
    _corner(T=53, S=37, H=4, K=1, positions="permuted", block=(5, 7)),
    _corner(dtype="bfloat16", H=4, K=4, T=20, S=20, window=(0, 0), segments=4, block=None),
)


@pytest.mark.parametrize("n", budget_params(3, 24))
def test_flash_attention_matches_reference(n):
    # The default budget draws the cheap implementations; -m slow adds pallas_tpu (TPU
    # interpret mode, about 25 s a configuration on a loaded 2-core machine).
    implementations = ("reference", "xla") if n < 10 else sa.FLASH_IMPLEMENTATIONS
    tally, drawn = sa.Tally("sf.flash_attention"), set()

    def check(c):
        drawn.add(c.implementation)
        check_flash(c, tally)

    strategy = sa.flash_configs(implementations=implementations)
    sa.run_with_examples(check, strategy, n, CORNERS)
    sa.draw_missing(check, implementations, drawn, lambda i: sa.flash_configs(implementations=(i,)))
    tally.report()
    assert drawn == set(implementations), f"drew {drawn}, not every one of {implementations}"


@pytest.mark.slow
@pytest.mark.parametrize("n", [pytest.param(12, id="slow")])
def test_flash_attention_triton_interpreter(n):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    tally = sa.Tally("sf.flash_attention triton (interpreter)")
    sa.run_with_examples(
        lambda c: check_flash(c, tally), sa.flash_configs(implementations=("triton",)), n
    )
    tally.report()


def test_flash_generator_covers_the_option_space():
    """The drawn configurations reach every implementation, mask, GQA ratio and dtype."""
    seen = set()

    @sa.settings(400)
    @hypothesis.given(sa.flash_configs())
    def collect(config):
        seen.update({("impl", config.implementation), ("dtype", config.dtype),
                     ("heads", (config.H, config.K)), ("causal", config.causal),
                     ("window", config.window is not None), ("softcap", config.softcap is not None),
                     ("segments", bool(config.segments)), ("T!=S", config.T != config.S),
                     ("odd", config.T % 2 == 1), ("bad", config.bad)})  # fmt: skip

    collect()
    wanted = {("impl", i) for i in sa.FLASH_IMPLEMENTATIONS}
    wanted |= {("dtype", d) for d in ("float32", "bfloat16", "float16")}
    wanted |= {("heads", hk) for hk in sa.HEADS}
    wanted |= {(m, True) for m in ("causal", "window", "softcap", "segments", "T!=S", "odd")}
    assert wanted <= seen, wanted - seen
    refusals = {value for key, value in seen if key == "bad" and value is not None}
    assert ("bad", None) in seen and len(refusals) >= 3, refusals
