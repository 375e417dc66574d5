"""Generated differential test of `sf.ring_attention` against `sf.attention_reference`.

Hypothesis draws `RingConfig`s (strategies_attention.py): every strategy (ring,
all_gather, ulysses, ulysses_ring / USP, None = the cost rule) x every layout (zigzag,
contiguous, striped) x causal / window / segment ids / softcap x GQA x lengths the ring
does or does not divide (T != S too) x meshes (1-D rings of 1, 2, 4, 8; a ring with a data
or model axis beside it; USP on (2, 4), (4, 2), ... in either axis order) x Explicit / Auto
axes x eager / jax.jit x inputs sharded as users shard them, replicated, or plain x float32
/ bfloat16. Each configuration compares out, lse and the vjp of a random cotangent with
`sf.attention_reference` on the global arrays (itself checked against the independent
oracle), and asserts the documented output sharding. A configuration the API refuses must
raise the predicted ValueError / TypeError naming the argument.

The `@example`s first run the corners that once went wrong: USP (`strategy="ulysses_ring"`,
`sequence_axis=("ulysses", "ring")`) with the default zigzag layout and a causal mask on
(2, 4) and (4, 2) meshes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.differential import strategies_attention as sa
from tests.differential.budget import budget_params

pytestmark = pytest.mark.timeout(1800)

NAMES = ("out", "lse", "dq", "dk", "dv")


def _mask_options(config):
    return dict(causal=config.causal, window=config.window, logit_softcap=config.softcap,
                scale=config.scale)  # fmt: skip


@functools.cache
def _reference_program(config):
    """Jitted on the global arrays: `(ref32, oracle, ref_lp or None)`, each
    `(out, lse, dq, dk, dv)` (see test_attention_diff.py for the three)."""
    options = _mask_options(config)
    scale = config.scale if config.scale is not None else 1.0 / np.sqrt(config.D)

    def vjp_of(attend, q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        return (out, lse, *vjp((d_out.astype(out.dtype), sa.masked_cotangent(d_lse, lse))))

    @jax.jit
    def run(q, k, v, d_out, d_lse, q_seg, kv_seg):
        T, S = q.shape[1], k.shape[1]
        q_pos = jnp.arange(T, dtype=jnp.int32) + S - T
        kv_pos = jnp.arange(S, dtype=jnp.int32)

        def reference(q, k, v):
            return sf.attention_reference(
                q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, return_lse=True, **options
            )

        def oracle(q, k, v):
            return sa.oracle_attention(
                q, k, v, causal=config.causal, window=config.window, softcap=config.softcap,
                scale=scale, q_pos=q_pos, kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg,
            )  # fmt: skip

        q, k, v = (x.astype(config.dtype) for x in (q, k, v))
        q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
        ref32 = vjp_of(reference, q32, k32, v32, d_out, d_lse)
        independent = vjp_of(oracle, q32, k32, v32, d_out, d_lse)
        low = None if config.dtype == "float32" else vjp_of(reference, q, k, v, d_out, d_lse)
        return ref32, independent, low

    return run


def _reference_key(config):
    """What the reference program depends on (besides shapes): one compile per such key."""
    return sa.RingConfig(**{
        **config.__dict__, "strategy": "ring", "layout": "zigzag", "mesh_shape": (1,),
        "mesh_names": ("sequence",), "sequence_axis": "sequence", "data_axis": None,
        "model_axis": None, "explicit": True, "mode": "eager", "placement": "plain",
        "return_lse": True, "implementation": None, "seed": 0,
    })  # fmt: skip


def expected_specs(config):
    """The documented output shardings: out `P(data, seq, model)`, lse `P(data, model, seq)`;
    the sequence replicated when the ring does not divide T."""
    seq = config.seq_spec if config.T % config.seq_size == 0 else None
    return P(config.data_axis, seq, config.model_axis), P(config.data_axis, config.model_axis, seq)


def _place(config, mesh, x, spec):
    """x as a user hands it over: sharded over the mesh as `spec` says (where it divides),
    replicated on the mesh, or a plain array."""
    if x is None or config.placement == "plain":
        return x
    if config.placement == "replicated":
        return jax.device_put(x, NamedSharding(mesh, P()))
    parts = [e if x.shape[i] % config_size(config, e) == 0 else None for i, e in enumerate(spec)]
    return jax.device_put(x, NamedSharding(mesh, P(*parts)))


def config_size(config, entry):
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    return int(np.prod([config.size(a) for a in names]))


def _call(config, mesh, inputs):
    """(results, grads) of `sf.ring_attention` in the config's mode, placement and dtype."""
    q, k, v = sa.cast_inputs(config, inputs["q"], inputs["k"], inputs["v"])
    kwargs = dict(mesh=mesh, sequence_axis=config.sequence_axis, layout=config.layout,
                  strategy=config.strategy, data_axis=config.data_axis,
                  model_axis=config.model_axis, return_lse=config.return_lse,
                  implementation=config.implementation,
                  **sa.attention_kwargs(config, inputs))  # fmt: skip
    q_seg, kv_seg = inputs["q_seg"], inputs["kv_seg"]
    if config.bad == "one_sided_segments":
        q_seg, kv_seg = jnp.zeros((config.B, config.T), jnp.int32), None
    if config.bad is not None or config.refusal() is not None:
        return sf.ring_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs)
    kv_model = config.model_axis if config.K % config.size(config.model_axis) == 0 else None
    seq = config.seq_spec
    q = _place(config, mesh, q, P(config.data_axis, seq, config.model_axis))
    k, v = (_place(config, mesh, x, P(config.data_axis, seq, kv_model)) for x in (k, v))
    q_seg, kv_seg = (_place(config, mesh, None if x is None else jnp.asarray(x),
                            P(config.data_axis, seq)) for x in (q_seg, kv_seg))  # fmt: skip
    # Cotangents as a loss on the outputs gives them: sharded like out and lse (on an
    # Explicit mesh the vjp requires their types to match the outputs').
    d_out, d_lse = jnp.asarray(inputs["d_out"], config.dtype), jnp.asarray(inputs["d_lse"])
    if config.placement != "plain":
        out_spec, lse_spec = expected_specs(config)
        d_out = jax.device_put(d_out, NamedSharding(mesh, out_spec))
        d_lse = jax.device_put(d_lse, NamedSharding(mesh, lse_spec))

    def attend(q, k, v):
        return sf.ring_attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, **kwargs)

    def with_vjp(q, k, v, d_out, d_lse):
        result, vjp = jax.vjp(attend, q, k, v)
        if config.return_lse:
            out, lse = result
            cotangent = (d_out.astype(out.dtype), sa.masked_cotangent(d_lse, lse))
        else:
            cotangent = d_out.astype(result.dtype)
        return result, vjp(cotangent)

    if config.mode == "jit":
        with_vjp = jax.jit(with_vjp)
    return jax.block_until_ready(with_vjp(q, k, v, d_out, d_lse))


def check_ring(config: sa.RingConfig, tally: sa.Tally | None = None) -> None:
    """Runs one configuration and compares it (or checks its refusal)."""
    inputs = sa.attention_inputs(
        config.seed, config.B, config.T, config.S, config.H, config.K, config.D, config.segments
    )
    refusal = config.refusal()
    if tally is not None:
        tally.count(refusal is not None)
    mesh = sa.mesh(config.mesh_shape, config.mesh_names, config.explicit)
    if refusal is not None:
        with pytest.raises(refusal[0], match=refusal[1]):
            _call(config, mesh, inputs)
        return
    result, grads = _call(config, mesh, inputs)
    out, lse = result if config.return_lse else (result, None)
    out_spec, lse_spec = expected_specs(config)
    for name, x, spec in (("out", out, out_spec), ("lse", lse, lse_spec)):
        if x is not None:
            expected = NamedSharding(mesh, spec)
            assert x.sharding.is_equivalent_to(expected, x.ndim), (
                f"{name} sharding {x.sharding} != {expected}"
            )
    d_lse = inputs["d_lse"] if config.return_lse else np.zeros_like(inputs["d_lse"])
    segs = [None if inputs[n] is None else jnp.asarray(inputs[n]) for n in ("q_seg", "kv_seg")]
    reference, oracle, low = jax.tree.map(
        lambda x: np.asarray(x, np.float32),
        _reference_program(_reference_key(config))(
            inputs["q"], inputs["k"], inputs["v"], inputs["d_out"], d_lse, *segs
        ),
    )
    for name, ref, orc in zip(NAMES, reference, oracle, strict=True):
        kind = "output" if name in ("out", "lse") else "grad"
        assert_close(ref, orc, kind=kind, name=f"reference vs independent oracle: {name}")
    actual = [out, lse, *grads]
    for i, name in enumerate(NAMES):
        if actual[i] is None:
            continue
        got = np.asarray(actual[i], np.float32)
        kind = "output" if name in ("out", "lse") else "grad"
        what = f"ring_attention {name}"
        if low is None:
            assert_close(got, reference[i], kind=kind, name=what)
        else:
            assert_close_low_precision(
                got, reference[i], low[i], kind=kind, name=what, relative_cap=True
            )


def _usp(mesh_shape, **overrides):
    base = dict(strategy="ulysses_ring", layout="zigzag", mesh_shape=mesh_shape,
                mesh_names=("ulysses", "ring"), sequence_axis=("ulysses", "ring"),
                data_axis=None, model_axis=None, explicit=True, mode="eager",
                placement="sharded", B=1, T=32, S=32, H=8, K=2, D=16, causal=True,
                window=None, softcap=None, segments=0, scale=None, return_lse=True,
                dtype="float32", implementation=None, seed=3)  # fmt: skip
    return sa.RingConfig(**{**base, **overrides})


# The corners a hand-picked matrix missed: USP, default zigzag layout, causal, 2-D meshes
# (in both axis orders); and the ring of 8 with a length it does not divide, a window,
# segment ids and MQA, on plain inputs under jit.
CORNERS = (
    _usp((2, 4)),
    _usp((4, 2), mesh_names=("ring", "ulysses"), mode="jit", explicit=False, T=29, S=29,
         K=1, segments=2),
    _usp((8,), strategy="ring", mesh_names=("sequence",), sequence_axis="sequence", T=45,
         S=45, K=1, window=(7, None), segments=2, mode="jit", placement="plain"),
)  # fmt: skip


@pytest.mark.parametrize("n", budget_params(2, 16))
def test_ring_attention_matches_reference(n):
    """Under `-m slow`, a strategy the budget did not draw is then drawn twice on its own
    (budgets of 16 and 40 drew no "all_gather"), and every strategy and layout is checked."""
    tally, drawn = sa.Tally("sf.ring_attention"), set()

    def check(c):
        drawn.add(("strategy", c.strategy))
        drawn.add(("layout", c.layout))
        check_ring(c, tally)

    sa.run_with_examples(check, sa.ring_configs(), n, CORNERS)
    if n >= 10:
        want = [("strategy", s) for s in RING_STRATEGIES] + [("layout", x) for x in sa.RING_LAYOUTS]
        sa.draw_missing(check, want, drawn, lambda w: sa.ring_configs().filter(
            lambda c: getattr(c, w[0]) == w[1]))  # fmt: skip
        assert set(want) <= drawn, set(want) - drawn
    tally.report()


RING_STRATEGIES = ("ring", "all_gather", "ulysses", "ulysses_ring", None)


def test_ring_generator_covers_the_option_space():
    """400 draws (not run): the refused fraction stays small, and every strategy, layout,
    mesh kind, axis type, mode, placement and mask is drawn."""
    tally, seen = sa.Tally("sf.ring_attention draws"), set()

    def collect(c):
        tally.count(c.refusal() is not None)
        seen.update({("strategy", c.strategy), ("layout", c.layout), ("mesh", c.mesh_shape),
                     ("explicit", c.explicit), ("mode", c.mode), ("placement", c.placement),
                     ("causal", c.causal), ("window", c.window is not None),
                     ("segments", bool(c.segments)), ("softcap", c.softcap is not None),
                     ("divisible", c.T % (c.seq_size * 2) == 0), ("heads", (c.H, c.K)),
                     ("data", c.data_axis), ("model", c.model_axis),
                     ("dtype", c.dtype)})  # fmt: skip

    sa.run_with_examples(collect, sa.ring_configs(), 400)
    tally.report()
    wanted = {("strategy", s) for s in ("ring", "all_gather", "ulysses", "ulysses_ring", None)}
    wanted |= {("layout", x) for x in sa.RING_LAYOUTS}
    wanted |= {("mesh", m) for m in ((1,), (2,), (4,), (8,), (2, 4), (4, 2), (2, 2))}
    wanted |= {(k, v) for k in ("explicit", "causal", "window", "segments", "softcap",
                                "divisible") for v in (True, False)}  # fmt: skip
    wanted |= {("mode", "eager"), ("mode", "jit"), ("data", "data"), ("model", "model")}
    wanted |= {("placement", p) for p in ("sharded", "replicated", "plain")}
    wanted |= {("heads", hk) for hk in sa.HEADS} | {("dtype", "bfloat16")}
    assert wanted <= seen, wanted - seen


# ---------------------------------------------------------------------------------------
# Planted bugs: each mutation of the library must make the generated check fail.


def _mutate_usp_ppermute(monkeypatch):
    """Issue 24 again: the zigzag relayout's ppermute numbers devices in the given axis
    order instead of the mesh's (a mesh listed (ulysses, ring))."""
    from jax import lax

    from shardfuse.collectives.ring_attention import relayout

    monkeypatch.setattr(relayout, "_ppermute", lambda x, axes, perm: lax.ppermute(x, axes, perm))


def _mutate_zigzag_positions(monkeypatch):
    """The zigzag positions without the mirror: device r's late chunk is N + r, not 2N-1-r."""
    from shardfuse.collectives.ring_attention import layouts

    original = layouts.shard_positions

    def shard_positions(index, local_len, ring_size, layout):
        if layout != "zigzag":
            return original(index, local_len, ring_size, layout)
        index = jnp.asarray(index, jnp.int32)[..., None]
        slot = jnp.arange(local_len, dtype=jnp.int32)
        chunk = local_len // 2
        first = slot < chunk
        return jnp.where(first, index, ring_size + index) * chunk + jnp.where(
            first, slot, slot - chunk
        )

    monkeypatch.setattr(layouts, "shard_positions", shard_positions)


def _mutate_relayout_parity(monkeypatch):
    """The per-shard zigzag relayout with early and late chunks swapped on odd devices."""
    from shardfuse.collectives.ring_attention import relayout

    original = relayout.to_ring

    def to_ring(x, axis_name, n, layout, axis=1):
        y = original(x, axis_name, n, layout, axis)
        if layout != "zigzag" or n == 1:
            return y
        from jax import lax

        half = y.shape[axis] // 2
        early, late = (lax.slice_in_dim(y, 0, half, axis=axis),
                       lax.slice_in_dim(y, half, None, axis=axis))  # fmt: skip
        odd = lax.axis_index(axis_name) % 2 == 1
        return jnp.where(odd, jnp.concatenate([late, early], axis=axis), y)

    monkeypatch.setattr(relayout, "to_ring", to_ring)


def _xla_masks(monkeypatch, visibility_mask):
    """The xla kernel's `masks` module with `visibility_mask` replaced (the reference keeps
    the real one)."""
    import types

    from shardfuse.kernels.attention import masks, xla

    patched = types.SimpleNamespace(**{k: getattr(masks, k) for k in dir(masks)
                                       if not k.startswith("__")})  # fmt: skip
    patched.visibility_mask = visibility_mask
    monkeypatch.setattr(xla, "masks", patched)


def _mutate_xla_drop_causal(monkeypatch):
    """The xla kernel's element mask without the causal term (block skipping keeps it)."""
    import dataclasses

    from shardfuse.kernels.attention import masks

    def visibility_mask(config, *args):
        return masks.visibility_mask(dataclasses.replace(config, causal=False), *args)

    _xla_masks(monkeypatch, visibility_mask)


def _mutate_xla_window_off_by_one(monkeypatch):
    """The xla kernel's element mask with the left window one key too wide."""
    import dataclasses

    from shardfuse.kernels.attention import masks

    def visibility_mask(config, *args):
        if config.window is not None and config.window[0] is not None:
            config = dataclasses.replace(config, window=(config.window[0] + 1, config.window[1]))
        return masks.visibility_mask(config, *args)

    _xla_masks(monkeypatch, visibility_mask)


def _mutate_matmul_chunk_offset(monkeypatch):
    """The collective matmul ring reads chunk i + 1 where it means chunk i."""
    from shardfuse.collectives.collective_matmul import ring as matmul_ring

    def start(plan, chunk, lane):
        return (chunk + 1) % plan.size * plan.chunk + lane.lo

    monkeypatch.setattr(matmul_ring, "_start", start)


def _ring_check():
    return check_ring, sa.ring_configs(), CORNERS


def _flash_check():
    from tests.differential import test_attention_diff as flash

    return flash.check_flash, sa.flash_configs(implementations=("reference", "xla")), flash.CORNERS


def _matmul_check():
    from tests.differential import test_collective_matmul_diff as matmul

    return matmul.check_matmul, sa.matmul_configs(), ()


MUTATIONS = {
    "usp_ppermute_mesh_order": (_mutate_usp_ppermute, _ring_check),
    "zigzag_positions": (_mutate_zigzag_positions, _ring_check),
    "relayout_zigzag_parity": (_mutate_relayout_parity, _ring_check),
    "xla_drop_causal": (_mutate_xla_drop_causal, _flash_check),
    "xla_window_off_by_one": (_mutate_xla_window_off_by_one, _flash_check),
    "matmul_chunk_offset": (_mutate_matmul_chunk_offset, _matmul_check),
}


def first_failure(check, strategy, examples, max_examples):
    """The first configuration's failure (no shrinking), or None if every one passes."""
    jax.clear_caches()
    _reference_program.cache_clear()
    try:
        sa.run_with_examples(check, strategy, max_examples, examples, shrink=False)
    except Exception as e:  # noqa: BLE001 - any failure of the check counts
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        jax.clear_caches()
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_generator_catches_planted_bugs(mutation, monkeypatch):
    """Each planted mutation makes the generated differential check fail within 12 random
    draws (measured: 4 to 8 draws for the attention mutations, 1 for the matmul one)."""
    from tests.differential import test_attention_diff as flash
    from tests.differential import test_collective_matmul_diff as matmul

    mutate, check_of = MUTATIONS[mutation]
    check, strategy, examples = check_of()
    with monkeypatch.context() as patch:
        mutate(patch)
        flash._program.cache_clear()
        matmul._program.cache_clear()
        # Random draws only (the @example corners left out): the generator itself must find it.
        failure = first_failure(check, strategy, (), 12)
    flash._program.cache_clear()
    matmul._program.cache_clear()
    print(f"{mutation}: {failure}")
    assert failure is not None, f"the generator did not catch the planted bug {mutation!r}"
