"""The decode-attention case matrix every implementation is tested on.

A `Case` is one configuration: shapes (B T S H K D), dtype, per-row cache
lengths, window, softcap and the chunk size `block_kv`. The cases cover one
and several queries (T = 1, 2, 3, 4, 16), GQA 4:1 and 8:2, MHA and MQA, cache
lengths that are not chunk multiples, lengths 0, 1, below T (queries that see
nothing) and full, bfloat16 and float16. Each backend picks its budget by name
(decode_backends.py) and skips, by its capability flags, what it cannot run.

Inputs are deterministic per case: q, k ~ N(0, 1), v ~ U(-1, 1).
`poison` writes NaN where nothing may be read: every cache row at or beyond
the row's length (and before its window), and the queries that see no key.
"""

import dataclasses
import typing
import zlib

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple[int, ...]
    T: int = 1
    S: int = 64
    H: int = 4
    K: int = 2
    D: int = 128
    dtype: str = "float32"
    window: tuple | None = None
    softcap: float | None = None
    block_kv: int | None = None

    @property
    def B(self) -> int:
        return len(self.lengths)

    def options(self) -> dict:
        """Keyword arguments of `sf.decode_attention` (implementation apart)."""
        return dict(window=self.window, logit_softcap=self.softcap, block_kv=self.block_kv)


# fmt: off
CASES = (
    Case("gqa4_t1_d128", lengths=(300, 1, 77), T=1, S=300, H=8, K=2, block_kv=128),
    Case("mqa_t3_window_d128", lengths=(257, 2), T=3, S=257, H=4, K=1, window=(50, 0),
         block_kv=128),
    Case("lengths_0_1_full_softcap_d128", lengths=(0, 1, 130), T=2, S=130, softcap=5.0),
    Case("bf16_gqa4_t4_window_softcap_d128", lengths=(384, 200), T=4, S=384, H=8, K=2,
         dtype="bfloat16", window=(100, 0), softcap=30.0, block_kv=128),
    Case("mha_t16_d64", lengths=(200, 16), T=16, S=200, H=2, K=2, D=64, block_kv=64),
    Case("gqa4_t2_window_softcap_d64", lengths=(0, 50, 97), T=2, S=97, H=8, K=2, D=64,
         window=(20, 0), softcap=3.0, block_kv=32),
    Case("f16_mqa_t1_d32", lengths=(70, 33), T=1, S=70, H=4, K=1, D=32, dtype="float16",
         block_kv=16),
    Case("bf16_gqa2_t1_d64", lengths=(150, 3), T=1, S=150, H=4, K=2, D=64, dtype="bfloat16",
         block_kv=64),
    Case("single_key_d16", lengths=(1,), T=1, S=1, H=1, K=1, D=16),
    Case("bf16_gqa8_t8_long_d128", lengths=(2048, 999), T=8, S=2048, H=16, K=2,
         dtype="bfloat16"),
)
# fmt: on
CASE = {case.name: case for case in CASES}


class Inputs(typing.NamedTuple):
    q: jax.Array
    k: jax.Array
    v: jax.Array
    lengths: jax.Array


def make_inputs(case: Case) -> Inputs:
    """float32 inputs of `case` (cast to its dtype by the runner)."""
    kq, kk, kv = jax.random.split(jax.random.key(zlib.crc32(case.name.encode())), 3)
    q = jax.random.normal(kq, (case.B, case.T, case.H, case.D), jnp.float32)
    k = jax.random.normal(kk, (case.B, case.S, case.K, case.D), jnp.float32)
    v = jax.random.uniform(kv, (case.B, case.S, case.K, case.D), jnp.float32, -1.0, 1.0)
    return Inputs(q, k, v, jnp.asarray(case.lengths, jnp.int32))


def visibility(case: Case) -> np.ndarray:
    """bool `[B, T, S]` from the definition, in NumPy (independent of the library's masks)."""
    lengths = np.asarray(case.lengths)[:, None, None]
    q_pos = lengths - case.T + np.arange(case.T)[None, :, None]
    kv = np.arange(case.S)[None, None, :]
    mask = (kv < lengths) & (kv <= q_pos)
    if case.window is not None and case.window[0] is not None:
        mask &= q_pos - kv <= case.window[0]
    return mask


def blind_rows_and_unseen_keys(case: Case):
    """bool `[B, T]` queries that see no key, and `[B, S]` cache rows no query sees."""
    mask = visibility(case)
    return ~mask.any(axis=2), ~mask.any(axis=1)


def poison(case: Case, inputs: Inputs) -> Inputs:
    """NaN in every query that sees nothing and every cache row nobody sees (v also inf)."""
    blind, unseen = blind_rows_and_unseen_keys(case)
    q = jnp.where(blind[:, :, None, None], jnp.nan, inputs.q)
    k = jnp.where(unseen[:, :, None, None], jnp.nan, inputs.k)
    v = jnp.where(unseen[:, :, None, None], jnp.inf, inputs.v)
    return inputs._replace(q=q, k=k, v=v)
