"""Shared setup of the collective matmul tests: meshes, operand layouts, the lax oracles.

Each case runs the op under test and its oracle (JAX's own collective next to
a HIGHEST-precision matmul) inside the same `jax.shard_map`, in one jitted
function that returns both outputs and both vjps, so a case compiles once.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf

HIGHEST = lax.Precision.HIGHEST


def ring_mesh(n: int, *, data: int = 1) -> Mesh:
    """A ("data", "model") mesh with the ring of size n on "model" (data=1: 1-D "model")."""
    devices = np.array(jax.devices()[: n * data])
    if data == 1:
        return Mesh(devices, ("model",))
    return Mesh(devices.reshape(data, n), ("data", "model"))


@dataclasses.dataclass(frozen=True)
class Case:
    """One op on one mesh: global operand shapes, their PartitionSpecs, the call and its oracle."""

    op: str  # "all_gather_matmul" | "matmul_reduce_scatter" | "matmul_all_reduce"
    n: int
    data: int = 1  # > 1: a 2-D mesh, x's batch sharded over "data", w replicated over it
    layout: str = "seq"  # "seq": x [B, T, C], row axis 1; "rows": x [T, C], row axis 0
    bidirectional: bool = False
    dtype: str = "float32"
    m: int = 3  # rows per device chunk
    c: int = 8  # contracted dim per device (matmul_reduce_scatter / all_reduce) or in all
    f: int = 8  # output columns per device (all_gather_matmul) or in all
    extra_rows: int = 0  # matmul_all_reduce only: rows not divisible by n (the psum fallback)

    def id(self) -> str:
        """A short test id: op, ring size, and what differs from the defaults."""
        short = {
            "all_gather_matmul": "ag",
            "matmul_reduce_scatter": "rs",
            "matmul_all_reduce": "ar",
        }
        parts = [short[self.op], f"n{self.n}"]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in ("op", "n") and value != field.default:
                parts.append(f"{field.name}={value}")
        return "-".join(parts)

    __str__ = id

    @property
    def mesh(self):
        return ring_mesh(self.n, data=self.data)

    def _batch(self):
        return "data" if self.data > 1 else None

    def specs(self):
        """(x spec, w spec, out spec)."""
        b = self._batch()
        if self.op == "all_gather_matmul":
            if self.layout == "seq":
                return P(b, "model"), P(None, "model"), P(b, None, "model")
            return P("model"), P(None, "model"), P(None, "model")
        x_spec = P(b, None, "model") if self.layout == "seq" else P(None, "model")
        if self.op == "matmul_reduce_scatter":
            out = P(b, "model") if self.layout == "seq" else P("model")
            return x_spec, P("model"), out
        return x_spec, P("model"), P(b) if self.layout == "seq" else P()

    def shapes(self):
        """Global (x, w) shapes: T = n * m rows; C and F as the op shards them."""
        n, rows = self.n, self.n * self.m + self.extra_rows
        lead = (2 * self.data, rows) if self.layout == "seq" else (rows,)
        if self.op == "all_gather_matmul":
            return (*lead, self.c), (self.c, n * self.f)
        return (*lead, n * self.c), (n * self.c, self.f)

    @property
    def row_axis(self):
        return 1 if self.layout == "seq" else 0

    def call(self, implementation, **kwargs):
        """The per-shard op under test."""
        fn = getattr(sf.collectives, self.op)
        options = dict(implementation=implementation, **kwargs)
        if self.op == "all_gather_matmul":
            options.update(gather_axis=self.row_axis, bidirectional=self.bidirectional)
        elif self.op == "matmul_reduce_scatter":
            options.update(scatter_axis=self.row_axis, bidirectional=self.bidirectional)
        return lambda x, w: fn(x, w, "model", **options)

    def oracle(self, x, w):
        """The same op with JAX's collective and a plain matmul in the inputs' precision."""
        precision = HIGHEST if x.dtype == jnp.float32 else None
        if self.op == "all_gather_matmul":
            gathered = lax.all_gather(x, "model", axis=self.row_axis, tiled=True)
            return jnp.matmul(gathered, w, precision=precision)
        product = jnp.matmul(x, w, precision=precision)
        if self.op == "matmul_reduce_scatter":
            return lax.psum_scatter(product, "model", scatter_dimension=self.row_axis, tiled=True)
        return lax.psum(product, "model")

    def inputs(self, seed=0):
        """x, w and an output cotangent, scaled so outputs and gradients are O(1)."""
        x_shape, w_shape = self.shapes()
        kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
        x = 0.5 * jax.random.normal(kx, x_shape, jnp.float32)
        w = jax.random.normal(kw, w_shape, jnp.float32) / np.sqrt(w_shape[0])
        rows = int(np.prod(x_shape[:-1]))
        out_shape = (*x_shape[:-1], w_shape[1])
        cotangent = jax.random.normal(kg, out_shape, jnp.float32) / np.sqrt(rows)
        dtype = jnp.dtype(self.dtype)
        return x.astype(dtype), w.astype(dtype), cotangent.astype(dtype)

    def placed(self, *arrays):
        """Arrays put on the mesh with their specs (shard_map does not reshard)."""
        x_spec, w_spec, out_spec = self.specs()
        specs = (x_spec, w_spec, out_spec)
        return [
            jax.device_put(a, NamedSharding(self.mesh, s))
            for a, s in zip(arrays, specs, strict=False)
        ]

    def sharded(self, per_shard):
        x_spec, w_spec, out_spec = self.specs()
        return jax.shard_map(
            per_shard, mesh=self.mesh, in_specs=(x_spec, w_spec), out_specs=out_spec
        )


def run_with_oracle(case: Case, implementation: str, **kwargs):
    """Returns (outputs, oracle outputs) as `(y, dx, dw)` each, from one jitted call."""
    x, w, cotangent = case.placed(*case.inputs())
    under_test = case.sharded(case.call(implementation, **kwargs))
    oracle = case.sharded(case.oracle)

    @jax.jit
    def both(x, w, cotangent):
        results = []
        for f in (under_test, oracle):
            y, vjp = jax.vjp(f, x, w)
            results.append((y, *vjp(cotangent)))
        return results

    return both(x, w, cotangent)


def upcast_oracle(case: Case):
    """The oracle on the inputs upcast to float32 (`ref32` of the low-precision rule)."""
    case32 = dataclasses.replace(case, dtype="float32")
    x, w, cotangent = case.placed(*(a.astype(jnp.float32) for a in case.inputs()))
    oracle = case32.sharded(case32.oracle)

    @jax.jit
    def run(x, w, cotangent):
        y, vjp = jax.vjp(oracle, x, w)
        return (y, *vjp(cotangent))

    return run(x, w, cotangent)
