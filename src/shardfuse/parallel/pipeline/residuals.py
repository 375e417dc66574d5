"""A stage's VJP split into a forward that returns its residuals and a backward that takes them.

`Pipeline(residuals="stored")` keeps, per microbatch in flight, the residuals
of the stage's VJP (what `jax.vjp` saves for the backward: activations inside
the stage, nonlinearity outputs, ...) from its F tick to its B (and W) tick,
instead of recomputing the stage forward from the stage input.

`jax.vjp` returns its backward function as a pytree whose leaves are the
residuals (`jax.tree.flatten(vjp_fn)`); its tree structure holds the linear
backward program, traced once and free of tracers. `StageVJP` traces the
stage's VJP once, abstractly (`jax.eval_shape`), and keeps that structure.
Residual leaves that ARE primal inputs (the parameters, the stage input: JAX
passes them through by identity) are not stored: the backward takes them
from the parameters and the stage-input buffer, which hold them anyway. The
other leaves are what a pipeline stores per microbatch, in ring buffers of
the stage input's slots.
"""

import jax

RESIDUALS = ("recompute", "stored")


def check_residuals(residuals) -> str:
    """`residuals` if it is one of `RESIDUALS`, else a ValueError naming it.

    Example usage::

      >>> check_residuals("stored")
      'stored'
    """
    if not isinstance(residuals, str) or residuals not in RESIDUALS:
        raise ValueError(f"residuals={residuals!r} must be one of {RESIDUALS}")
    return residuals


class StageVJP:
    """`stage_fn`'s VJP at `(params, x)` as `forward` (-> output, stored leaves) and `backward`.

    Args:
      stage_fn: `stage_fn(params, x) -> y`.
      params, x: arrays or `jax.ShapeDtypeStruct`s (or tracers) of the
        operands; only their types are used (an abstract trace).
      has_aux: `stage_fn` returns `(y, aux)`, `aux` not differentiated (as
        `jax.vjp(has_aux=True)`): `forward` returns it third.

    Attributes:
      stored: `jax.ShapeDtypeStruct`s of the residual leaves to store per
        microbatch (the leaves that are not an input of the stage).
      output: the `jax.ShapeDtypeStruct` of `stage_fn(params, x)`.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> stage = lambda w, x: jnp.tanh(x @ w)
      >>> w, x = jnp.full((3, 3), 0.5), jnp.ones((2, 3))
      >>> plan = StageVJP(stage, w, x)
      >>> {leaf.shape for leaf in plan.stored}  # tanh residuals (how many: up to JAX), not w or x
      {(2, 3)}
      >>> y, stored = plan.forward(w, x)
      >>> d_w, d_x = plan.backward(w, x, stored, jnp.ones_like(y))
      >>> expected = jax.vjp(stage, w, x)[1](jnp.ones_like(y))
      >>> bool(jnp.allclose(d_w, expected[0]) and jnp.allclose(d_x, expected[1]))
      True
    """

    def __init__(self, stage_fn, params, x, *, has_aux=False):
        self.stage_fn, self.has_aux = stage_fn, has_aux
        found = {}

        def trace(params, x):
            y, vjp_fn, *_ = jax.vjp(stage_fn, params, x, has_aux=has_aux)
            leaves, found["treedef"] = jax.tree.flatten(vjp_fn)
            found["sources"] = _sources(leaves, (params, x))
            stored = [leaf for leaf, k in zip(leaves, found["sources"], strict=True) if k is None]
            return y, stored

        self.output, self.stored = jax.eval_shape(trace, params, x)
        self.treedef, self.sources = found["treedef"], found["sources"]

    def forward(self, params, x):
        """`(y, stored)`: the stage output and its residual leaves to keep (`(y, stored,
        aux)` with `has_aux`)."""
        y, vjp_fn, *aux = jax.vjp(self.stage_fn, params, x, has_aux=self.has_aux)
        leaves = jax.tree.leaves(vjp_fn)
        if len(leaves) != len(self.sources):
            raise RuntimeError("the stage's VJP changed structure between two traces")
        stored = [leaf for leaf, k in zip(leaves, self.sources, strict=True) if k is None]
        return (y, stored, *aux)

    def backward(self, params, x, stored, cotangent):
        """`(d_params, d_x)` from the stored leaves, without running the stage forward."""
        primals = jax.tree.leaves((params, x))
        stored = iter(stored)
        leaves = [next(stored) if k is None else primals[k] for k in self.sources]
        return jax.tree.unflatten(self.treedef, leaves)(cotangent)


def _sources(leaves, primals):
    """Per residual leaf: the index of the primal input leaf it is (by identity), else None."""
    index = {id(a): k for k, a in enumerate(jax.tree.leaves(primals))}
    return [index.get(id(leaf)) for leaf in leaves]
