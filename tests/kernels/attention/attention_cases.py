"""The one attention case matrix every implementation is tested on.

A `Case` is one configuration: shapes (B T S H K D), dtype, masks (causal,
window, softcap, segment ids, shuffled positions) and optional block sizes.
`CASES` is the union of every backend's cases; each backend in
`attention_backends.py` picks its budget from it by name (the interpreters
are slow) and skips, by its capability flags, what it cannot run.

Inputs are deterministic per case and seed: q, k ~ N(0, 1); v ~ U(-1, 1),
which keeps |out| <= 1 where the bfloat16 absolute caps of TESTING.md bound
real errors, not rounding of large values; cotangents ~ N(0, 1). Segment
ids are packed (sorted) with two holes: a run of queries in segment 7,
which no key has (rows that see nothing), and the last keys in segment 9,
which no query has (keys nobody sees).
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np

from tests.kernels.attention.common import segment_ids

UNSEEN_QUERY_SEGMENT = 7
UNSEEN_KEY_SEGMENT = 9


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    B: int = 1
    T: int = 64
    S: int = 64
    H: int = 2
    K: int = 2
    D: int = 32
    dtype: str = "float32"
    causal: bool = False
    window: tuple | None = None
    softcap: float | None = None
    segments: bool = False
    shuffled: bool = False  # non-monotone positions, as ring layouts give
    block: tuple[int, int] | None = None  # (block_q, block_kv); None: the backend's default

    def options(self) -> dict:
        """The static keyword arguments of `sf.flash_attention` (block sizes apart)."""
        return dict(causal=self.causal, window=self.window, logit_softcap=self.softcap)


CASES = (
    # -- odd lengths, T != S both ways, GQA 4:1 / 8:2 / MQA, every mask; float32 --------------
    Case("single_token", T=1, S=1),
    Case("causal_7", T=7, S=7, causal=True),
    Case("causal_mqa_97x113", T=97, S=113, H=4, K=1, causal=True, block=(32, 32)),
    Case("causal_gqa8_2_113x97", T=113, S=97, H=8, K=2, causal=True, block=(16, 64)),
    Case("window_127x257", T=127, S=257, window=(32, 8), block=(64, 32)),
    Case("segments_softcap_257x127", B=2, T=257, S=127, segments=True, softcap=3.0,
         block=(128, 16)),
    Case("causal_mqa_d64", T=64, S=64, H=4, K=1, D=64, causal=True),
    Case("d128_blocks_8x24", T=33, S=65, D=128, block=(8, 24)),
    Case("d64_33x65", T=33, S=65, D=64, block=(16, 32)),
    Case("every_mask_d20", B=2, T=50, S=70, H=4, K=2, D=20, causal=True, window=(20, 5),
         softcap=2.0, segments=True),
    Case("shuffled_causal_96", T=96, S=96, H=4, K=2, causal=True, shuffled=True, block=(16, 16)),
    Case("masked_rows_40x24", B=2, T=40, S=24, H=4, K=2, causal=True, segments=True,
         block=(16, 16)),
    Case("window_segments_48x80", B=2, T=48, S=80, H=4, K=2, causal=True, window=(24, 0),
         segments=True, block=(16, 16)),
    Case("causal_segments_97x113", B=2, T=97, S=113, H=4, K=2, causal=True, segments=True,
         block=(32, 32)),
    # -- bfloat16 / float16 ----------------------------------------------------------------
    Case("bf16_causal_mqa_97x113", T=97, S=113, H=4, K=1, causal=True, block=(32, 32),
         dtype="bfloat16"),
    Case("bf16_window_softcap_segments_gqa8_2", B=2, T=64, S=80, H=8, K=2, D=64,
         window=(16, 16), softcap=5.0, segments=True, dtype="bfloat16"),
    Case("f16_causal_65", T=65, S=65, causal=True, dtype="float16"),
    Case("bf16_causal_gqa_1024_d128", B=2, T=1024, S=1024, H=8, K=2, D=128, causal=True,
         dtype="bfloat16"),
    Case("f16_257x1000", T=257, S=1000, H=4, K=4, D=64, dtype="float16"),
    Case("bf16_causal_d256", T=40, S=72, D=256, causal=True, dtype="bfloat16"),
    Case("f16_d96", T=33, S=65, D=96, block=(16, 32), dtype="float16"),
    Case("bf16_causal_gqa_300", B=2, T=300, S=300, H=8, K=2, D=64, causal=True, dtype="bfloat16"),
    # -- small head dims and 16-row tiles (sized for the Triton interpreter) -----------------
    Case("causal_gqa_37x45", T=37, S=45, H=4, K=2, D=32, causal=True, block=(16, 16)),
    Case("bf16_mqa_d24_45x23", T=45, S=23, H=4, K=1, D=24, block=(16, 16), dtype="bfloat16"),
    Case("f16_segments_window_softcap_48", T=48, S=48, D=16, segments=True, window=(9, 0),
         softcap=5.0, block=(16, 16), dtype="float16"),
    Case("shuffled_causal_mqa_40", T=40, S=40, K=1, D=16, causal=True, shuffled=True,
         block=(16, 32)),
    Case("two_sided_window_mqa_33x50", B=2, T=33, S=50, H=4, K=1, D=16, window=(10, 7),
         block=(16, 16)),
    Case("segments_default_tiles_24x40", B=2, T=24, S=40, K=1, D=16, segments=True),
    Case("bf16_causal_d128_130x257", T=130, S=257, H=4, K=2, D=128, causal=True,
         dtype="bfloat16"),
    Case("segments_softcap_window_200", B=2, T=200, S=200, H=8, K=2, D=64, segments=True,
         softcap=20.0, window=(64, 0)),
    # -- head dims 64 and 128, 128-row tiles (sized for the Pallas TPU interpreter) ----------
    Case("causal_mqa_97x257_d128", T=97, S=257, H=4, K=1, D=128, causal=True, block=(128, 128)),
    Case("causal_gqa_257x113_d64", T=257, S=113, H=4, K=2, D=64, causal=True),
    Case("window_softcap_gqa8_2_shuffled_256", T=256, S=256, H=8, K=2, D=128, window=(40, 8),
         softcap=5.0, shuffled=True, block=(128, 128)),
    Case("segments_causal_200_d128", B=2, T=200, S=200, D=128, causal=True, segments=True,
         block=(128, 128)),
    Case("dense_full_blocks_256", T=256, S=256, D=128, block=(128, 128)),
    Case("bf16_causal_gqa_256", T=256, S=256, H=4, K=2, D=128, causal=True, block=(128, 128),
         dtype="bfloat16"),
    Case("bf16_causal_mqa_1024_d128", T=1024, S=1024, K=1, D=128, causal=True,
         dtype="bfloat16"),
    Case("single_query_127", T=1, S=127, K=1, D=128, causal=True),
    Case("window_7x113_d64", T=7, S=113, D=64, window=(16, 0)),
    Case("causal_mqa_127x257_d128", T=127, S=257, K=1, D=128, causal=True),
    Case("window_softcap_mqa_384", T=384, S=384, H=4, K=1, D=128, window=(40, 8), softcap=5.0,
         block=(128, 128)),
    Case("bf16_segments_softcap_257", B=2, T=257, S=257, K=1, D=128, segments=True,
         softcap=20.0, dtype="bfloat16"),
    # -- 64-row warpgroup tiles (sized for the Mosaic GPU interpreter) -----------------------
    Case("bf16_shuffled_causal_gqa_130", T=130, S=130, H=4, K=2, D=64, causal=True,
         shuffled=True, dtype="bfloat16"),
    Case("f16_window_softcap_segments_d128_100x200", B=2, T=100, S=200, H=2, K=1, D=128,
         window=(32, 8), softcap=10.0, segments=True, dtype="float16"),
    Case("bf16_two_sided_window_d256_70x150", T=70, S=150, H=2, K=1, D=256, window=(20, 30),
         dtype="bfloat16"),
    Case("bf16_kv_block_64_gqa_200", T=200, S=200, H=4, K=1, D=128, causal=True, block=(64, 64),
         dtype="bfloat16"),
)  # fmt: skip

CASE = {case.name: case for case in CASES}
assert len(CASE) == len(CASES), "case names must be unique"


class Inputs(typing.NamedTuple):
    """float32 q `[B, T, H, D]`, k, v `[B, S, K, D]`, cotangents, positions, segment ids."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    d_out: jax.Array  # [B, T, H, D]
    d_lse: jax.Array  # [B, H, T]
    q_pos: jax.Array | None  # [T]; None: the default (bottom-right aligned)
    kv_pos: jax.Array | None  # [S]
    q_seg: jax.Array | None  # [B, T]
    kv_seg: jax.Array | None  # [B, S]


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    """The case's float32 inputs (cast to `case.dtype` by the runner)."""
    keys = jax.random.split(jax.random.key(seed), 9)
    q = jax.random.normal(keys[0], (case.B, case.T, case.H, case.D), jnp.float32)
    k = jax.random.normal(keys[1], (case.B, case.S, case.K, case.D), jnp.float32)
    v = jax.random.uniform(keys[2], (case.B, case.S, case.K, case.D), jnp.float32, -1.0, 1.0)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[4], (case.B, case.H, case.T), jnp.float32)
    q_pos = kv_pos = q_seg = kv_seg = None
    if case.shuffled:  # each query and key position once, in a zigzag-like order
        q_pos = jax.random.permutation(keys[5], case.T) + max(case.S - case.T, 0)
        q_pos = q_pos.astype(jnp.int32)
        kv_pos = jax.random.permutation(keys[6], case.S).astype(jnp.int32)
    if case.segments:
        q_seg = segment_ids(keys[7], case.B, case.T)
        kv_seg = segment_ids(keys[8], case.B, case.S)
        rows = max(1, min(9, case.T // 4))
        q_seg = q_seg.at[:, case.T // 2 : case.T // 2 + rows].set(UNSEEN_QUERY_SEGMENT)
        kv_seg = kv_seg.at[:, case.S - max(1, min(6, case.S // 8)) :].set(UNSEEN_KEY_SEGMENT)
    return Inputs(q, k, v, d_out, d_lse, q_pos, kv_pos, q_seg, kv_seg)


def visibility(case: Case, inputs: Inputs) -> np.ndarray:
    """bool `[B, T, S]`: which key each query sees, from the documented mask rules (NumPy)."""
    T, S = case.T, case.S
    q_pos = np.arange(T) + S - T if inputs.q_pos is None else np.asarray(inputs.q_pos)
    kv_pos = np.arange(S) if inputs.kv_pos is None else np.asarray(inputs.kv_pos)
    diff = q_pos[:, None].astype(np.int64) - kv_pos[None, :]
    visible = np.ones((case.B, T, S), bool)
    if case.causal:
        visible &= diff >= 0
    if case.window is not None:
        left, right = case.window
        visible &= (diff <= left) if left is not None else True
        visible &= (-diff <= right) if right is not None else True
    if case.segments:
        visible &= np.asarray(inputs.q_seg)[:, :, None] == np.asarray(inputs.kv_seg)[:, None, :]
    return visible


def blind_rows_and_unseen_keys(case: Case, inputs: Inputs):
    """bool `[B, T]` (queries that see no key) and `[B, S]` (keys no query sees)."""
    visible = visibility(case, inputs)
    return ~visible.any(axis=2), ~visible.any(axis=1)


def poison(case: Case, inputs: Inputs) -> Inputs:
    """NaN in queries that see nothing and in keys nobody sees; NaN and inf in their values."""
    blind, unseen = blind_rows_and_unseen_keys(case, inputs)
    blind, unseen = blind[:, :, None, None], unseen[:, :, None, None]
    bad_value = jnp.where(jnp.arange(case.S)[None, :, None, None] % 2 == 0, jnp.nan, jnp.inf)
    return inputs._replace(
        q=jnp.where(blind, jnp.nan, inputs.q),
        k=jnp.where(unseen, jnp.nan, inputs.k),
        v=jnp.where(unseen, bad_value, inputs.v),
    )
