"""Shared body of the ring attention tests: cases, meshes, and the check against the oracle.

`check_ring(case)` runs the global `sf.ring_attention` (forward, lse, and
gradients by `jax.vjp` with random cotangents for out and lse) and compares
it with `sf.attention_reference` on the same natural-order global arrays,
with the TESTING.md tolerances (float32: 1e-5 / 2e-5; bf16: the 2x / 3x rule).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import shardfuse as sf
from shardfuse.testing import assert_close, assert_close_low_precision
from tests.kernels.attention.common import segment_ids


@dataclasses.dataclass(frozen=True)
class RingCase:
    N: int = 4  # ring size
    layout: str = "zigzag"
    strategy: str = "ring"
    B: int = 1
    T: int = 32  # global lengths
    S: int = 32
    H: int = 4
    K: int = 2
    D: int = 16
    causal: bool = True
    window: tuple | None = None
    softcap: float | None = None
    segments: bool = False
    dtype: str = "float32"
    implementation: str | None = None
    mesh: str = "ring"  # "ring": 1-D over N devices; "3d": (data 2, sequence 2, model 2)

    @property
    def id(self):
        parts = [f"N{self.N}", self.layout, f"T{self.T}S{self.S}H{self.H}K{self.K}"]
        parts += ["causal"] * self.causal + [f"win{self.window}"] * bool(self.window)
        parts += [f"cap{self.softcap}"] * bool(self.softcap) + ["seg"] * self.segments
        parts += [self.dtype] * (self.dtype != "float32")
        parts += [self.strategy] * (self.strategy != "ring")
        parts += [str(self.implementation)] * bool(self.implementation)
        parts += [self.mesh] * (self.mesh != "ring")
        return "-".join(parts)


@functools.cache
def ring_mesh(n: int, axis: str = "sequence") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (axis,))


@functools.cache
def mesh_3d() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "sequence", "model"))


def make_inputs(case: RingCase, seed: int = 0):
    """`(q, k, v, kwargs, (d_out, d_lse))`, float32 global natural-order arrays."""
    keys = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(keys[0], (case.B, case.T, case.H, case.D), jnp.float32)
    k = jax.random.normal(keys[1], (case.B, case.S, case.K, case.D), jnp.float32)
    v = jax.random.normal(keys[2], (case.B, case.S, case.K, case.D), jnp.float32)
    kwargs = dict(causal=case.causal, window=case.window, logit_softcap=case.softcap)
    if case.segments:
        kwargs["q_segment_ids"] = segment_ids(keys[3], case.B, case.T)
        kwargs["kv_segment_ids"] = segment_ids(keys[4], case.B, case.S)
    d_out = jax.random.normal(keys[5], q.shape, jnp.float32)
    d_lse = jax.random.normal(keys[6], (case.B, case.H, case.T), jnp.float32)
    return q, k, v, kwargs, (d_out, d_lse)


def with_vjp(attend):
    """A jitted `(q, k, v, d_out, d_lse) -> (out, lse, dq, dk, dv)` around `attend(q, k, v)`."""

    @jax.jit
    def run(q, k, v, d_out, d_lse):
        (out, lse), vjp = jax.vjp(attend, q, k, v)
        d_lse = jnp.where(jnp.isfinite(lse), d_lse, 0.0)  # as a user's loss would
        return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))

    return run


def ring_fn(case: RingCase, kwargs):
    if case.mesh == "3d":
        mesh, extra = mesh_3d(), dict(data_axis="data", model_axis="model")
    else:
        mesh, extra = ring_mesh(case.N), {}
    return with_vjp(
        lambda q, k, v: sf.ring_attention(
            q,
            k,
            v,
            mesh=mesh,
            layout=case.layout,
            strategy=case.strategy,
            return_lse=True,
            implementation=case.implementation,
            **extra,
            **kwargs,
        )
    )


def oracle_fn(kwargs):
    return with_vjp(lambda q, k, v: sf.attention_reference(q, k, v, return_lse=True, **kwargs))


NAMES = ("out", "lse", "dq", "dk", "dv")
KINDS = ("output", "output", "grad", "grad", "grad")


def compare(case: RingCase, actual, q, k, v, kwargs, cotangents):
    """Asserts `actual = (out, lse, dq, dk, dv)` matches the oracle on the gathered sequence."""
    oracle = oracle_fn(kwargs)
    if case.dtype == "float32":
        expected = oracle(q, k, v, *cotangents)
        for name, kind, a, e in zip(NAMES, KINDS, actual, expected, strict=True):
            assert a.dtype == jnp.float32, (name, a.dtype)
            assert_close(a, e, kind=kind, name=f"{case.id} {name}")
        return
    low = [x.astype(case.dtype) for x in (q, k, v)]
    ref_lp = oracle(*low, *cotangents)
    ref32 = oracle(*(x.astype(jnp.float32) for x in low), *cotangents)
    for i, (name, kind) in enumerate(zip(NAMES, KINDS, strict=True)):
        assert actual[i].dtype == (jnp.float32 if name == "lse" else jnp.dtype(case.dtype))
        assert_close_low_precision(
            actual[i], ref32[i], ref_lp[i], kind=kind, name=f"{case.id} {name}"
        )


def check_ring(case: RingCase, seed: int = 0):
    """Ring attention vs the reference on the gathered sequence; returns the ring's results."""
    q, k, v, kwargs, cotangents = make_inputs(case, seed)
    inputs = (q, k, v) if case.dtype == "float32" else (x.astype(case.dtype) for x in (q, k, v))
    actual = ring_fn(case, kwargs)(*inputs, *cotangents)
    compare(case, actual, q, k, v, kwargs, cotangents)
    return actual
