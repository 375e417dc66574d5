"""Shared test body for every attention implementation.

A `Case` describes one configuration; `check_case(impl, case)` runs forward,
lse and gradients (jax.vjp with random cotangents for both outputs) of the
implementation and of the reference, and compares them with the TESTING.md
tolerances. Backend test modules parametrize over their own case lists and
call it, so every implementation passes the same matrix.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    T: int = 64
    S: int = 64
    H: int = 2
    K: int = 2
    D: int = 32
    causal: bool = False
    window: tuple | None = None
    softcap: float | None = None
    segments: bool = False
    positions: str | None = None  # None: default; "shuffled": a non-monotone layout
    block: tuple[int, int] | None = None
    dtype: str = "float32"

    @property
    def id(self):
        parts = [f"B{self.B}T{self.T}S{self.S}H{self.H}K{self.K}D{self.D}"]
        parts += ["causal"] * self.causal
        parts += [f"win{self.window}"] if self.window else []
        parts += [f"cap{self.softcap}"] if self.softcap else []
        parts += ["seg"] * self.segments
        parts += [f"pos-{self.positions}"] if self.positions else []
        parts += [f"blk{self.block}"] if self.block else []
        parts += [self.dtype] if self.dtype != "float32" else []
        return "-".join(parts)


def segment_ids(key, batch, length, num_segments=3):
    """Sorted (packed-sequence style) random segment ids, int32 `[batch, length]`."""
    ids = jax.random.randint(key, (batch, length), 0, num_segments)
    return jnp.sort(ids, axis=1).astype(jnp.int32)


def make_inputs(case: Case, seed: int = 0):
    """Returns `(q, k, v, kwargs, cotangents)` for a case (float32 arrays, cast later)."""
    keys = jax.random.split(jax.random.key(seed), 8)
    q = jax.random.normal(keys[0], (case.B, case.T, case.H, case.D), jnp.float32)
    k = jax.random.normal(keys[1], (case.B, case.S, case.K, case.D), jnp.float32)
    v = jax.random.normal(keys[2], (case.B, case.S, case.K, case.D), jnp.float32)
    kwargs = dict(causal=case.causal, window=case.window, logit_softcap=case.softcap)
    if case.segments:
        kwargs["q_segment_ids"] = segment_ids(keys[3], case.B, case.T)
        kwargs["kv_segment_ids"] = segment_ids(keys[4], case.B, case.S)
    if case.positions == "shuffled":
        # Zigzag-like: each half of the query positions comes from a different place.
        kwargs["q_positions"] = jax.random.permutation(keys[5], case.T).astype(jnp.int32) + max(
            case.S - case.T, 0
        )
        kwargs["kv_positions"] = jax.random.permutation(keys[6], case.S).astype(jnp.int32)
    d_out = jax.random.normal(keys[7], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[5], (case.B, case.H, case.T), jnp.float32)
    return q, k, v, kwargs, (d_out, d_lse)


def with_vjp(attend):
    """A jitted `(q, k, v, d_out, d_lse) -> (out, lse, dq, dk, dv)` around `attend(q, k, v)`."""

    @jax.jit
    def run(q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        # lse cotangents only where lse is finite, as a user's loss would be.
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)
        return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))

    return run


def attention_with_vjp(implementation, kwargs, block_sizes=None):
    """`with_vjp` of `sf.flash_attention(implementation=...)`, or of the oracle ("oracle")."""

    def attend(q, k, v):
        if implementation == "oracle":
            return sf.attention_reference(q, k, v, return_lse=True, **kwargs)
        extra = {} if block_sizes is None else {"block_sizes": block_sizes}
        return sf.flash_attention(
            q, k, v, return_lse=True, implementation=implementation, **kwargs, **extra
        )

    return with_vjp(attend)


def compare_to_reference(label: str, case: Case, got, inputs):
    """Runs `got` (a `with_vjp` runner) and the oracle on `inputs`; TESTING.md tolerances.

    float32 cases compare with atol = rtol = 1e-5 (2e-5 for gradients); 16-bit
    cases with the 2x / 3x rule against the oracle in float32 and in the low
    precision. Returns the outputs of `got`.
    """
    q, k, v, kwargs, (d_out, d_lse) = inputs
    oracle = attention_with_vjp("oracle", kwargs)
    names = ("out", "lse", "dq", "dk", "dv")
    kinds = ("output", "output", "grad", "grad", "grad")
    if case.dtype == "float32":
        actual = got(q, k, v, d_out, d_lse)
        expected = oracle(q, k, v, d_out, d_lse)
        for name, kind, a, e in zip(names, kinds, actual, expected, strict=True):
            assert a.dtype == jnp.float32, (name, a.dtype)
            assert_close(a, e, kind=kind, name=f"{label} {case.id} {name}")
        return actual
    dtype = jnp.dtype(case.dtype)
    low = [x.astype(dtype) for x in (q, k, v)]
    actual = got(*low, d_out, d_lse)
    ref_lp = oracle(*low, d_out, d_lse)
    ref32 = oracle(*(x.astype(jnp.float32) for x in low), d_out, d_lse)
    for i, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        expected_dtype = jnp.float32 if name == "lse" else dtype
        assert actual[i].dtype == expected_dtype, (name, actual[i].dtype)
        assert_close_low_precision(
            actual[i], ref32[i], ref_lp[i], kind=kind, name=f"{label} {case.id} {name}"
        )
    return actual


def check_case(implementation: str, case: Case, seed: int = 0):
    """Forward, lse and gradients of `implementation` against the reference."""
    inputs = make_inputs(case, seed)
    block_sizes = None if case.block is None else sf.BlockSizes(*case.block)
    got = attention_with_vjp(implementation, inputs[3], block_sizes)
    return compare_to_reference(implementation, case, got, inputs)


def naive_attention_numpy(q, k, v, mask, scale, softcap=None):
    """Per-(batch, head) loops in float64 NumPy: the oracle's own oracle.

    mask: bool `[B, T, S]`. Returns `(out [B, T, H, D], lse [B, H, T])`.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    K = k.shape[2]
    out = np.zeros((B, T, H, D))
    lse = np.full((B, H, T), -np.inf)
    for b in range(B):
        for h in range(H):
            kv_head = h // (H // K)
            for t in range(T):
                visible = np.flatnonzero(mask[b, t])
                if visible.size == 0:
                    continue
                logits = np.array([q[b, t, h] @ k[b, s, kv_head] * scale for s in visible])
                if softcap is not None:
                    logits = softcap * np.tanh(logits / softcap)
                top = logits.max()
                weights = np.exp(logits - top)
                lse[b, h, t] = top + np.log(weights.sum())
                out[b, t, h] = (weights / weights.sum()) @ v[b, visible, kv_head]
    return out, lse
