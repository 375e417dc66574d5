"""The xla implementation: the decomposed rings of `ring.py` under `jax.custom_vjp`.

The backward passes are rings too, so they overlap like the forward:

- `y = all_gather(x) @ w`: `dx = psum_scatter(dy @ w^T)` is a matmul-reduce-scatter
  and `dw = sum_j x_j^T dy_j` accumulates per step while x travels the ring
  again (x is saved, not its gathered copy: residual memory stays O(m)).
- `y = psum_scatter(x @ w)`: `dx = all_gather(dy) @ w^T` is an all-gather-matmul,
  and `dw = sum_j x[chunk j]^T dy_j` accumulates per step of the same ring.
- `y = psum(x @ w)`: a matmul-reduce-scatter ring, then an all-gather of the
  (already reduced, F-column) result: the ring all-reduce, whose first half
  overlaps the matmul. Its backward needs no communication:
  `dx = dy @ w^T`, `dw = x^T dy`.

Under `jax.shard_map(check_vma=True)` x and w are first cast to one common
varying-axes type, whose transpose sums the cotangent of an operand that is
replicated over some axis (as autodiff of the unfused form does).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from shardfuse.collectives.collective_matmul import ring
from shardfuse.collectives.collective_matmul.base import RingPlan, common_varying, ring_vjp
from shardfuse.kernels.matmul import api as matmul_api

MATMUL = "xla"  # the sf.matmul implementation of every ring step


def _gather_forward(x, w, plan: RingPlan):
    return ring.gather_matmul(x, w, plan, implementation=MATMUL, out_dtype=x.dtype)


def _scatter_forward(x, w, plan: RingPlan):
    return ring.scatter_matmul(x, w, plan, implementation=MATMUL).astype(x.dtype)


_all_gather_matmul = ring_vjp(
    _gather_forward,
    functools.partial(ring.gather_matmul_bwd, implementation=MATMUL),
    name="all_gather_matmul",
)
_matmul_reduce_scatter = ring_vjp(
    _scatter_forward,
    functools.partial(ring.scatter_matmul_bwd, implementation=MATMUL),
    name="matmul_reduce_scatter",
)


def _all_gather_invariant(x, axis_name, axis):
    """`all_gather(tiled=True)` whose result is typed invariant over `axis_name`, as psum's is."""
    gather = getattr(lax, "all_gather_invariant", None)
    if gather is None:
        try:
            from jax._src.lax.parallel import all_gather_invariant as gather
        except ImportError:  # pragma: no cover - depends on the jax version
            gather = None
    if gather is not None:
        return gather(x, axis_name, axis=axis, tiled=True)
    # Fallback: every device writes its chunk into zeros and a psum adds them (exact).
    n = lax.axis_size(axis_name)
    shape = list(x.shape)
    shape[axis] *= n
    start = lax.axis_index(axis_name) * x.shape[axis]
    buf = lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, start, axis)
    return lax.psum(buf, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_all_reduce(x, w, plan: RingPlan):
    reduced = ring.scatter_matmul(x, w, plan, implementation=MATMUL).astype(x.dtype)
    with jax.named_scope("all_gather_result"):
        return _all_gather_invariant(reduced, plan.axis_name, plan.axis)


def _matmul_all_reduce_fwd(x, w, plan):
    return _matmul_all_reduce(x, w, plan), (x, w)


def _matmul_all_reduce_bwd(plan, residuals, dy):
    x, w = residuals
    dx = matmul_api.matmul(
        dy, w.T, out_dtype=x.dtype, implementation=MATMUL, precision=plan.precision
    )
    dw = matmul_api.matmul(
        x.reshape(-1, x.shape[-1]).T,
        dy.reshape(-1, dy.shape[-1]),
        implementation=MATMUL,
        precision=plan.precision,
    )
    return dx, dw.astype(w.dtype)


_matmul_all_reduce.defvjp(_matmul_all_reduce_fwd, _matmul_all_reduce_bwd)


def all_gather_matmul(x, w, plan: RingPlan):
    """`all_gather(x, plan.axis_name, axis=plan.axis, tiled=True) @ w` on validated inputs."""
    return _all_gather_matmul(x, w, plan)


def matmul_reduce_scatter(x, w, plan: RingPlan):
    """`psum_scatter(x @ w, plan.axis_name, scatter_dimension=plan.axis, tiled=True)`."""
    return _matmul_reduce_scatter(x, w, plan)


def matmul_all_reduce(x, w, plan: RingPlan | None, axis_name: str, precision=None):
    """`psum(x @ w, axis_name)`; `plan=None` (no axis of x divisible by N): matmul, then psum."""
    x, w = common_varying(x, w, axis_name)
    with jax.named_scope("matmul_all_reduce"):
        if plan is None:
            partial = matmul_api.matmul(
                x, w, out_dtype=jnp.float32, implementation=MATMUL, precision=precision
            )
            return lax.psum(partial, axis_name).astype(x.dtype)
        return _matmul_all_reduce(x, w, plan)
