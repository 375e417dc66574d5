"""Shared cases of the pallas_tpu attention tests: shapes, options, inputs, jitted runners.

Interpret mode compiles slowly (seconds per configuration), so each case is
one jitted function computing out, lse and the vjp together, cached per case
and implementation and reused by every test that needs it (reference
comparison, NaN poisoning, determinism).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

import shardfuse as sf
from shardfuse.kernels.pallas_interpret import interpret_mode

# What the tests run the kernels under: reads outside a buffer raise, fresh
# memory (scratch, padding of blocks) is NaN, so a kernel that reads what it
# never wrote shows up as NaN.
STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise", uninitialized_memory="nan")


@dataclasses.dataclass(frozen=True)
class Case:
    B: int
    T: int
    S: int
    H: int
    K: int
    D: int
    dtype: str = "float32"
    causal: bool = False
    window: tuple | None = None
    logit_softcap: float | None = None
    segments: bool = False  # packed; query segment 7 has no keys, key segment 9 no queries
    block_sizes: tuple | None = None  # (block_q, block_kv)
    shuffled_positions: bool = False  # non-monotone positions, as ring layouts give

    def kwargs(self):
        return dict(
            causal=self.causal,
            window=self.window,
            logit_softcap=self.logit_softcap,
            block_sizes=None if self.block_sizes is None else sf.BlockSizes(*self.block_sizes),
        )


CASES = {
    # odd lengths, T < S, MQA (4:1), three key blocks, padding in both
    "causal_odd_mqa": Case(1, 97, 257, 4, 1, 128, causal=True, block_sizes=(128, 128)),
    # T > S bottom-right aligned: the first T - S queries see no key; GQA 2:1, D = 64
    "causal_t_gt_s_gqa_d64": Case(1, 257, 113, 4, 2, 64, causal=True),
    # window + softcap, GQA 8:2, shuffled positions (every block partial)
    "window_softcap_gqa_shuffled": Case(
        1,
        256,
        256,
        8,
        2,
        128,
        window=(40, 8),
        logit_softcap=5.0,
        block_sizes=(128, 128),
        shuffled_positions=True,
    ),
    # packed sequences, causal, batch 2, a query segment without keys
    "segments_causal": Case(
        2, 200, 200, 2, 2, 128, causal=True, segments=True, block_sizes=(128, 128)
    ),
    # every block fully visible: the unmasked path
    "dense_full_blocks": Case(1, 256, 256, 2, 2, 128, block_sizes=(128, 128)),
    # bfloat16, causal (full, partial and skipped blocks), GQA 2:1
    "bf16_causal_gqa": Case(
        1, 256, 256, 4, 2, 128, "bfloat16", causal=True, block_sizes=(128, 128)
    ),
}

SLOW_CASES = {
    "bf16_causal_long_default_blocks": Case(1, 1024, 1024, 2, 1, 128, "bfloat16", causal=True),
    "single_query": Case(1, 1, 127, 2, 1, 128, causal=True),
    "seven_by_113_window": Case(1, 7, 113, 2, 2, 64, window=(16, 0)),
    "f32_default_blocks_127_257": Case(1, 127, 257, 2, 1, 128, causal=True),
    "window_skips_blocks": Case(
        1, 384, 384, 4, 1, 128, window=(40, 8), logit_softcap=5.0, block_sizes=(128, 128)
    ),
    "bf16_segments_softcap": Case(
        2, 257, 257, 2, 1, 128, "bfloat16", segments=True, logit_softcap=20.0
    ),
}


def segment_ids(case: Case):
    """int32 `[B, T]`, `[B, S]`: packed segments; query segment 7 and key segment 9 unmatched."""
    if not case.segments:
        return None, None
    q_seg = jnp.stack([jnp.arange(case.T) * (3 + b) // case.T for b in range(case.B)])
    kv_seg = jnp.stack([jnp.arange(case.S) * (3 + b) // case.S for b in range(case.B)])
    q_seg = q_seg.at[:, case.T // 2 : case.T // 2 + 9].set(7)  # rows that see nothing
    kv_seg = kv_seg.at[:, case.S // 4 : case.S // 4 + 5].set(9)  # keys no query sees
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def positions(case: Case):
    """int32 `[T]`, `[S]`: None (the default) or permutations, as a zigzag ring layout."""
    if not case.shuffled_positions:
        return None, None
    keys = jax.random.split(jax.random.key(11))
    q_pos = jax.random.permutation(keys[0], case.T) + max(case.S - case.T, 0)
    return q_pos.astype(jnp.int32), jax.random.permutation(keys[1], case.S).astype(jnp.int32)


def inputs(case: Case, seed: int = 0):
    """float32 q `[B, T, H, D]`, k, v `[B, S, K, D]`, cotangents d_out and d_lse."""
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (case.B, case.T, case.H, case.D), jnp.float32)
    k = jax.random.normal(keys[1], (case.B, case.S, case.K, case.D), jnp.float32)
    # |v| <= 1 keeps |out| <= 1, where bfloat16 rounding (2^-8 relative) stays below the
    # absolute cap of TESTING.md (1e-2); N(0, 1) values up to 4 round by up to 1.6e-2.
    v = jax.random.uniform(keys[2], (case.B, case.S, case.K, case.D), jnp.float32, -1.0, 1.0)
    d_out = jax.random.normal(keys[3], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[4], (case.B, case.H, case.T), jnp.float32)
    return q, k, v, d_out, d_lse


@functools.cache
def runner(name: str, implementation: str):
    """`(q, k, v, d_out, d_lse, q_seg, kv_seg) -> (out, lse, (dq, dk, dv))`, jitted."""
    case = {**CASES, **SLOW_CASES}[name]

    def run(q, k, v, d_out, d_lse, q_seg, kv_seg, q_pos, kv_pos):
        def attention(q, k, v):
            return sf.flash_attention(
                q,
                k,
                v,
                q_positions=q_pos,
                kv_positions=kv_pos,
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
                return_lse=True,
                implementation=implementation,
                **case.kwargs(),
            )

        (out, lse), vjp = jax.vjp(attention, q, k, v)
        return out, lse, vjp((d_out.astype(out.dtype), d_lse))

    jitted = jax.jit(run)

    def call(q, k, v, d_out, d_lse, q_seg, kv_seg):
        q_pos, kv_pos = positions(case)
        with interpret_mode(STRICT):
            # Block: JAX's TPU interpreter runs JAX ops inside its host callbacks, which
            # deadlock against anything dispatched to the CPU device meanwhile.
            return jax.block_until_ready(
                jitted(q, k, v, d_out, d_lse, q_seg, kv_seg, q_pos, kv_pos)
            )

    return call
