"""Hypothesis strategies, inputs and oracles of the attention and collective-matmul
differential tests (test_attention_diff.py, test_ring_diff.py, test_collective_matmul_diff.py).

One frozen config dataclass and one `st.composite` per entry point draw from the whole
option space of `sf.flash_attention`, `sf.ring_attention` and the collective matmuls.
Each config also says whether the API must refuse it (`refusal`: the exception type and a
text its message must contain, the argument's name) from a model of the valid space
written here, independently of the library's validation. Most draws are valid: a refused
draw costs no compile, but a generator that mostly draws refusals tests nothing, so every
test counts them (`Tally`) and bounds the fraction.

`oracle_attention` is an oracle independent of the library: explicit `[B, K, G, T, S]`
scores in float32 at HIGHEST precision and the visibility rule written out here, not
`kernels/attention/masks.py`, so that a mutation of the library's masks cannot hide in
both the tested path and `sf.attention_reference`. The tests compare every entry point
with `sf.attention_reference` and check `sf.attention_reference` against this oracle in
the same jitted call.

Axis glossary: B batch, T query length, S key length, H query heads, K kv heads,
G = H // K, D head dim; M/C/F the matmul's rows / contracted / output columns.
"""

import dataclasses
import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

from tests.differential.budget import SEED, seeded, settings

HIGHEST = lax.Precision.HIGHEST

# (H, K): MHA, 4:1, 8:2, MQA (two sizes), 2:1.
HEADS = ((2, 2), (4, 4), (4, 1), (8, 2), (8, 1), (4, 2))


@dataclasses.dataclass
class Tally:
    """Drawn and refused configurations of one test run (reported, and bounded)."""

    name: str
    drawn: int = 0
    refused: int = 0

    def count(self, refused: bool) -> None:
        self.drawn += 1
        self.refused += bool(refused)

    def report(self, max_fraction: float = 0.35) -> str:
        fraction = self.refused / max(self.drawn, 1)
        text = f"{self.name}: {self.drawn} configurations, {self.refused} refused ({fraction:.0%})"
        print(text)
        # The generator's design, checked on the fixed draws (another seed's few draws
        # stray above it by chance: 8 of 19 ring configurations refused with seed 37).
        if self.drawn >= 10 and SEED is None:
            assert fraction <= max_fraction, f"the generator mostly draws refusals: {text}"
        return text


def run_with_examples(body, strategy, max_examples: int, examples=(), *, shrink=True):
    """`budget.run` with explicit `@example`s (the known-dangerous corners) drawn first.

    shrink=False stops at the first failure without shrinking (mutation tests: each
    example compiles)."""
    base = settings(max_examples)
    if not shrink:
        base = hypothesis.settings(
            base,
            phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),
            report_multiple_bugs=False,
        )

    def drawn(config):
        body(config)

    test = hypothesis.given(strategy)(drawn)
    for example in reversed(examples):
        test = hypothesis.example(example)(test)
    seeded(base(test))()


def draw_missing(body, wanted, drawn, strategy_for, max_examples: int = 2):
    """Runs `body` on `max_examples` draws of `strategy_for(value)` for each value of
    `wanted` (in order) not in `drawn` by then: what another seed's draws missed, on its
    own (the fixed draws cover every value)."""
    for value in wanted:
        if value not in drawn:
            run_with_examples(body, strategy_for(value), max_examples)


# ---------------------------------------------------------------------------------------
# The independent attention oracle.


def oracle_attention(
    q, k, v, *, causal, window, softcap, scale, q_pos, kv_pos, q_seg=None, kv_seg=None
):
    """`(out [B, T, H, D] in q's dtype, lse f32 [B, H, T])`, written from the definition."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    qf = q.astype(jnp.float32).reshape(B, T, K, G, D)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    s = jnp.einsum("BTKGD,BSKD->BKGTS", qf, kf, precision=HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    diff = q_pos[:, None].astype(jnp.int32) - kv_pos[None, :].astype(jnp.int32)  # [T, S]
    seen = jnp.ones((T, S), bool)
    if causal:
        seen = seen & (diff >= 0)
    if window is not None:
        left, right = window
        if left is not None:
            seen = seen & (diff <= left)
        if right is not None:
            seen = seen & (-diff <= right)
    seen = jnp.broadcast_to(seen, (B, T, S))
    if q_seg is not None:
        seen = seen & (q_seg[:, :, None] == kv_seg[:, None, :])
    seen = seen[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(seen, s, -jnp.inf)
    top = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(seen, jnp.exp(s - top), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    some = total > 0
    p = p / jnp.where(some, total, 1.0)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", p, vf, precision=HIGHEST).reshape(B, T, H, D)
    lse = jnp.where(some, jnp.log(jnp.where(some, total, 1.0)) + top, -jnp.inf)
    return out.astype(q.dtype), lse[..., 0].reshape(B, H, T)


def masked_cotangent(d_lse, lse):
    """lse cotangents only where lse is finite, as a user's loss would be."""
    return jnp.where(jnp.isfinite(lse), d_lse, 0.0)


def attention_inputs(seed, B, T, S, H, K, D, segments, *, positions="default"):
    """float32 q, k, v, cotangents d_out, d_lse, and int32 positions / segment ids (NumPy)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D), np.float32)
    k = rng.standard_normal((B, S, K, D), np.float32)
    v = rng.standard_normal((B, S, K, D), np.float32)
    d_out = rng.standard_normal((B, T, H, D), np.float32)
    d_lse = rng.standard_normal((B, H, T), np.float32)
    q_pos = (np.arange(T) + S - T).astype(np.int32)
    kv_pos = np.arange(S, dtype=np.int32)
    if positions == "permuted":
        q_pos, kv_pos = rng.permutation(q_pos), rng.permutation(kv_pos)
    q_seg = kv_seg = None
    if segments:
        q_seg = np.sort(rng.integers(0, segments, (B, T)), axis=1).astype(np.int32)
        kv_seg = np.sort(rng.integers(0, segments, (B, S)), axis=1).astype(np.int32)
    return dict(q=q, k=k, v=v, d_out=d_out, d_lse=d_lse, q_pos=q_pos, kv_pos=kv_pos,
                q_seg=q_seg, kv_seg=kv_seg)  # fmt: skip


# ---------------------------------------------------------------------------------------
# Shared mask draws and the invalid attention arguments.

# bad attention argument -> (exception, text the message must contain)
ATTENTION_REFUSALS = {
    "heads": (ValueError, "K="),  # H % K != 0
    "window": (ValueError, "window"),  # a negative side
    "softcap": (ValueError, "logit_softcap"),  # 0.0
    "dtype_mismatch": (TypeError, "dtype"),
    "one_sided_segments": (ValueError, "segment_ids"),
    "integer_q": (TypeError, "q has dtype"),
}


@st.composite
def masks(draw, T, S):
    """causal, window, softcap, number of segments (0: none): each alone and combined."""
    causal = draw(st.booleans())
    window = None
    if draw(st.integers(0, 2)) == 0:
        side = st.one_of(st.none(), st.integers(0, max(T, S) + 2))
        window = (draw(side), draw(side))
    softcap = draw(st.sampled_from([None, None, 2.0, 20.0]))
    segments = draw(st.sampled_from([0, 0, 1, 2, 4]))
    return causal, window, softcap, segments


def rarely(draw, percent):
    """True in about `percent` % of the draws (st.integers favours its bounds: not used)."""
    return draw(st.sampled_from([False] * (100 - percent) + [True] * percent))


def maybe_bad(draw, probability_percent=8):
    """One invalid attention argument, or None (most draws)."""
    if not rarely(draw, probability_percent):
        return None
    return draw(st.sampled_from(sorted(ATTENTION_REFUSALS)))


def attention_kwargs(config, inputs):
    """The mask keyword arguments of a config (flash or ring), with its bad argument."""
    kwargs = dict(causal=config.causal, window=config.window, logit_softcap=config.softcap,
                  scale=config.scale)  # fmt: skip
    if config.bad == "window":
        kwargs["window"] = (-1, config.window[1] if config.window else None)
    if config.bad == "softcap":
        kwargs["logit_softcap"] = 0.0
    return kwargs


def cast_inputs(config, q, k, v):
    """q, k, v in the config's dtype, with its bad dtype argument."""
    q, k, v = (jnp.asarray(x, config.dtype) for x in (q, k, v))
    if config.bad == "dtype_mismatch":
        k = k.astype(jnp.float32 if config.dtype != "float32" else jnp.bfloat16)
    if config.bad == "integer_q":
        q = q.astype(jnp.int32)
    return q, k, v


def heads_for(draw, bad, ulysses=1, model=1):
    """(H, K): valid GQA for `ulysses` x `model` head splits, or H % K != 0 when bad."""
    if bad == "heads":
        return 6, 4
    fits = [(h, k) for h, k in HEADS if h % (ulysses * model) == 0 and (k % model == 0 or k == 1)]
    return draw(st.sampled_from(fits or list(HEADS)))


@functools.cache
def mesh(shape, names, explicit: bool):
    """A mesh of the first prod(shape) CPU devices (Explicit: jax.make_mesh's default)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=devices)


# ---------------------------------------------------------------------------------------
# sf.flash_attention


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    implementation: str  # "reference", "xla", "pallas_tpu", "triton" (the interpreter)
    B: int
    T: int
    S: int
    H: int
    K: int
    D: int
    causal: bool
    window: tuple | None
    softcap: float | None
    segments: int  # 0: no segment ids
    scale: float | None
    positions: str  # "default" (bottom-right) or "permuted"
    block: tuple | None  # (block_q, block_kv)
    dtype: str
    seed: int
    bad: str | None = None  # an invalid argument (ATTENTION_REFUSALS), or "block"

    def refusal(self):
        """`(exception, text)` the API must raise for this config, or None (it must run)."""
        if self.bad == "block":
            return ValueError, "block_q"
        if self.bad is not None:
            return ATTENTION_REFUSALS[self.bad]
        if self.implementation == "pallas_tpu":
            if self.dtype == "float16":
                return NotImplementedError, "float16"
            if self.D != 64 and self.D % 128:
                return NotImplementedError, "head dim"
            if self.block is not None and any(b % 128 for b in self.block):
                return NotImplementedError, "128"
        if self.implementation == "triton":
            if self.dtype == "float32" and self.D > 64:
                return NotImplementedError, "D"
            if self.block is not None and any(b < 16 or b & (b - 1) for b in self.block):
                return NotImplementedError, "block"
        return None


FLASH_IMPLEMENTATIONS = ("reference", "xla", "pallas_tpu")


@st.composite
def flash_configs(draw, implementations=FLASH_IMPLEMENTATIONS):
    """`FlashConfig`s over the option space of `sf.flash_attention`."""
    # xla and reference are cheap; the interpreters are drawn less often.
    weights = {"reference": 2, "xla": 4, "pallas_tpu": 1, "triton": 1}
    implementation = draw(st.sampled_from([i for i in implementations for _ in range(weights[i])]))
    bad = maybe_bad(draw)
    if bad is None and rarely(draw, 2):
        bad = "block"
    H, K = heads_for(draw, bad)
    interpreted = implementation in ("pallas_tpu", "triton")
    longest = 40 if interpreted else 64
    T, S = draw(st.integers(1, longest)), draw(st.integers(1, longest))
    if draw(st.booleans()):
        S = T
    if implementation == "pallas_tpu":
        D = draw(st.sampled_from([64, 64, 64, 16]))  # 16: refused (NotImplementedError)
        block = draw(st.sampled_from([None, None, (128, 128), (64, 128)]))
    elif implementation == "triton":
        D = draw(st.sampled_from([16, 32, 64]))
        block = draw(st.sampled_from([None, (16, 16), (32, 16), (16, 64)]))
    else:
        D = draw(st.sampled_from([8, 12, 16, 20, 32]))
        block = draw(st.sampled_from([None, (8, 8), (16, 32), (5, 7), (32, 8), (64, 64)]))
    causal, window, softcap, segments = draw(masks(T, S))
    dtypes = ["float32"] * 4 + ["bfloat16"] * 2 + ["float16"]
    return FlashConfig(
        implementation=implementation, B=draw(st.sampled_from([1, 2])), T=T, S=S, H=H, K=K,
        D=D, causal=causal, window=window, softcap=softcap, segments=segments,
        scale=draw(st.sampled_from([None, None, None, 0.3])),
        positions=draw(st.sampled_from(["default", "default", "permuted"])), block=block,
        dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)), bad=bad,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# sf.ring_attention

RING_LAYOUTS = ("zigzag", "contiguous", "striped")
USP_MESHES = ((2, 4), (4, 2), (2, 2), (1, 4), (4, 1), (2, 1), (8, 1), (1, 8))
RING_REFUSALS = {
    **ATTENTION_REFUSALS,
    "axis": (ValueError, "sequence_axis"),  # an axis the mesh lacks (the message lists its axes)
    "strategy_axes": (ValueError, "sequence_axis"),  # ring / all_gather / ulysses on two axes
}


@dataclasses.dataclass(frozen=True)
class RingConfig:
    strategy: str | None  # "ring", "all_gather", "ulysses", "ulysses_ring" or None (cost rule)
    layout: str
    mesh_shape: tuple  # sizes, in the mesh's axis order
    mesh_names: tuple  # e.g. ("sequence",), ("data", "sequence"), ("ulysses", "ring")
    sequence_axis: str | tuple  # "sequence" or ("ulysses", "ring")
    data_axis: str | None
    model_axis: str | None
    explicit: bool  # Explicit mesh axes (jax.make_mesh's default), else Auto
    mode: str  # "eager" or "jit"
    placement: str  # "sharded" (device_put as users shard), "replicated" or "plain"
    B: int
    T: int
    S: int
    H: int
    K: int
    D: int
    causal: bool
    window: tuple | None
    softcap: float | None
    segments: int
    scale: float | None
    return_lse: bool
    dtype: str
    implementation: str | None
    seed: int
    bad: str | None = None

    def size(self, name):
        return dict(zip(self.mesh_names, self.mesh_shape, strict=True)).get(name, 1)

    @property
    def ulysses_size(self):
        two = isinstance(self.sequence_axis, tuple)
        if two:
            return self.size(self.sequence_axis[0])
        return self.size(self.sequence_axis) if self.strategy == "ulysses" else 1

    @property
    def seq_size(self):
        axes = (
            self.sequence_axis if isinstance(self.sequence_axis, tuple) else (self.sequence_axis,)
        )
        return int(np.prod([self.size(a) for a in axes]))

    @property
    def seq_spec(self):
        """The sequence's PartitionSpec entry: the axis, or ring-major (ring, ulysses) for USP."""
        if isinstance(self.sequence_axis, tuple):
            return self.sequence_axis[::-1]
        return self.sequence_axis

    def refusal(self):
        """`(exception, text)` the API must raise for this config, or None (it must run)."""
        if self.bad is not None:
            return RING_REFUSALS[self.bad]
        model = self.size(self.model_axis)
        if self.strategy in ("ulysses", "ulysses_ring") or isinstance(self.sequence_axis, tuple):
            if (self.H // model) % self.ulysses_size:
                return ValueError, "H="
            if isinstance(self.sequence_axis, tuple) and self.layout == "striped":
                return ValueError, "layout='striped'"
        return None


@st.composite
def ring_configs(draw, implementations=(None, "xla", "reference")):
    """`RingConfig`s over the option space of `sf.ring_attention`."""
    bad = maybe_bad(draw, 8)
    if bad is None and rarely(draw, 4):
        bad = draw(st.sampled_from(["axis", "strategy_axes"]))
    strategy = draw(st.sampled_from(["ring", "ring", "all_gather", "ulysses", "ulysses_ring",
                                     "ulysses_ring", None]))  # fmt: skip
    data_axis = model_axis = None
    B = draw(st.sampled_from([1, 2]))
    if strategy == "ulysses_ring" or (strategy is None and draw(st.booleans())):
        # USP: the dangerous (2, 4) and (4, 2) meshes most often.
        shape = draw(st.sampled_from(USP_MESHES[:2] * 3 + USP_MESHES[2:]))
        names = ("ulysses", "ring")
        if draw(st.booleans()):  # the mesh's own axis order need not be (ulysses, ring)
            shape, names = shape[::-1], names[::-1]
        sequence_axis = ("ulysses", "ring")
        ulysses = dict(zip(names, shape, strict=True))["ulysses"]
    else:
        n = draw(st.sampled_from([1, 2, 4, 4, 8, 8]))
        shape, names, sequence_axis = (n,), ("sequence",), "sequence"
        extra = draw(st.sampled_from([None, None, "data", "model"])) if n <= 4 else None
        if extra == "data":
            shape, names, data_axis, B = (2, n), ("data", "sequence"), "data", 2
        elif extra == "model":
            shape, names, model_axis = (n, 2), ("sequence", "model"), "model"
        ulysses = n if strategy == "ulysses" else 1
    H, K = heads_for(draw, bad, ulysses=ulysses, model=2 if model_axis else 1)
    if bad == "strategy_axes" and isinstance(sequence_axis, tuple):
        strategy = draw(st.sampled_from(["ring", "all_gather", "ulysses"]))
    elif bad == "strategy_axes":
        bad = "axis"
    if bad == "axis":
        sequence_axis = "seq" if isinstance(sequence_axis, str) else ("ulysses", "rings")
    layout = draw(st.sampled_from(["zigzag", "zigzag", "contiguous", "striped"]))
    if isinstance(sequence_axis, tuple) and layout == "striped" and draw(st.integers(0, 3)):
        layout = "zigzag"  # mostly valid: striped is refused with two axes
    n = int(np.prod(shape)) // (2 if data_axis or model_axis else 1)
    multiple = n * (2 if layout == "zigzag" else 1)
    if draw(st.booleans()):  # divisible by the ring (2N for zigzag)
        T = multiple * draw(st.integers(1, max(1, 48 // multiple)))
    else:
        T = draw(st.integers(1, 48))
    S = T if draw(st.booleans()) else draw(st.integers(1, 48))
    causal, window, softcap, segments = draw(masks(T, S))
    if draw(st.integers(0, 2)) == 0:
        causal = True  # causal is where the layouts differ: draw it more often
    return RingConfig(
        strategy=strategy, layout=layout, mesh_shape=shape, mesh_names=names,
        sequence_axis=sequence_axis, data_axis=data_axis, model_axis=model_axis,
        explicit=draw(st.booleans()), mode=draw(st.sampled_from(["eager", "jit"])),
        placement=draw(st.sampled_from(["sharded", "sharded", "replicated", "plain"])), B=B,
        T=T, S=S, H=H, K=K, D=draw(st.sampled_from([8, 16])), causal=causal, window=window,
        softcap=softcap, segments=segments, scale=draw(st.sampled_from([None, None, 0.5])),
        return_lse=draw(st.sampled_from([True, True, False])),
        dtype=draw(st.sampled_from(["float32"] * 5 + ["bfloat16"])),
        implementation=draw(st.sampled_from(implementations)), seed=draw(st.integers(0, 2**16)),
        bad=bad,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# The collective matmuls (per shard, inside jax.shard_map)

MATMUL_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
MATMUL_REFUSALS = {
    "axis": (ValueError, "_axis="),  # the contracted (last) axis as gather / scatter axis
    "dtype_mismatch": (TypeError, "dtype"),
    "axis_name": (ValueError, "axis_name="),  # an axis the mesh lacks
}


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    op: str
    n: int  # ring size: mesh axis "model"
    data: int  # 2: a ("data", "model") mesh, x's batch axis split over "data"
    explicit: bool
    rank: int  # 2: x [M, C]; 3: x [A0, A1, C]
    axis: int  # the row axis (gathered / scattered; all-reduce: where M sits), may be negative
    bidirectional: bool
    dtype: str
    m: int  # rows per device chunk
    c: int  # contracted dim per device
    f: int  # output columns per device
    extra_rows: int  # rows beyond n * m (the scatter refuses them; the all-reduce takes them)
    precision: object  # None, "highest" or lax.Precision.HIGHEST
    implementation: str | None
    seed: int
    bad: str | None = None

    @property
    def row_axis(self):
        return self.axis % self.rank

    def refusal(self):
        if self.bad is not None:
            return MATMUL_REFUSALS[self.bad]
        if self.op == "matmul_reduce_scatter" and self.extra_rows:
            return ValueError, r"x.shape\["
        if self.implementation == "pallas_tpu":
            if self.op == "matmul_all_reduce":
                return NotImplementedError, "matmul_all_reduce"
            if self.dtype == "float16":
                return NotImplementedError, "float16"
            if self.dtype == "bfloat16" and self.precision in ("highest", HIGHEST):
                return NotImplementedError, "precision"
        return None


@st.composite
def matmul_configs(draw, implementations=(None, "reference", "xla")):
    """`MatmulConfig`s over the option space of the three collective matmuls."""
    implementation = draw(st.sampled_from(implementations))
    fused = implementation == "pallas_tpu"
    # The fused kernels refuse the all-reduce, float16 and bfloat16 at HIGHEST: drawn rarely
    # (precision None only: float32's HIGHEST is its default).
    op = draw(st.sampled_from(MATMUL_OPS[:2] * 4 + MATMUL_OPS[2:] if fused else MATMUL_OPS))
    n = draw(st.sampled_from([1, 2, 3, 4, 8]))  # 3: a ring no power of two
    data = draw(st.sampled_from([1, 1, 2])) if n <= 4 else 1
    rank = draw(st.sampled_from([2, 3]))
    axis = draw(st.sampled_from([0, -2] if rank == 2 else [0, 1, -2, -3]))
    bad = None
    if not fused and rarely(draw, 8):  # (the invalid arguments: drawn with the default list)
        bad = draw(st.sampled_from(["dtype_mismatch", "axis_name"] + (["axis"] if op !=
                                   "matmul_all_reduce" else [])))  # fmt: skip
    extra = 0
    if op != "all_gather_matmul" and n > 1 and rarely(draw, 10 if fused else 25):
        extra = draw(st.integers(1, n - 1))
    return MatmulConfig(
        op=op, n=n, data=data, explicit=draw(st.booleans()), rank=rank, axis=axis,
        bidirectional=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32"] * (8 if fused else 4) + ["bfloat16", "float16"])),
        m=draw(st.integers(1, 5)), c=draw(st.sampled_from([1, 3, 8, 16])),
        f=draw(st.sampled_from([1, 5, 8])), extra_rows=extra,
        precision=draw(st.sampled_from([None, None] + ([] if fused else ["highest", HIGHEST]))),
        implementation=implementation, seed=draw(st.integers(0, 2**16)),
        bad=bad,
    )  # fmt: skip
