"""ZeRO-3 next-layer weight prefetch for a `Stack` of fsdp-sharded blocks.

A ZeRO-3 block (`zero=3`) all-gathers each kernel over the fsdp axis inside
its own per-shard function, right before the matmul that needs it: the
gather of layer `l + 1` cannot start before layer `l` is done. FSDP
(Zhao et al. 2023, "PyTorch FSDP", section 3.3.2 "forward/backward
prefetching") issues the next layer's all-gather while the current layer
computes. Here the whole layer scan is one `jax.custom_vjp`, run per shard
(one `jax.shard_map` over the mesh, or directly in a manual region):

- forward: a `lax.scan` whose carry is `(activations, layer l's gathered
  weights)`; the body issues layer `l + 1`'s all-gather, which does not
  depend on layer `l`'s compute, so XLA's async collectives overlap the two
  on GPU/TPU. Residuals: the stacked SHARDED weights and each layer's input
  activation (what remat "full" keeps); no gathered weight is saved.
- backward: a reverse scan whose carry is `(cotangent, layer l's gathered
  weights)`; the body issues layer `l - 1`'s gather, recomputes layer `l`
  from its saved input (`jax.vjp`) and reduce-scatters the weight cotangent
  (whole over fsdp on each device) to the fsdp shard in the layers'
  `reduce_dtype` (float32 by default), then sums it over the other
  data-parallel axes on the shard, as `fsdp.gather`'s transpose does.
- the blocks run a copy of the block graph whose layers are at ZeRO stage 0
  with the same fsdp axis (the batch still split over `(data, fsdp)`), fed
  the gathered weights. The gathered weights vary over the activations' mesh
  axes before the gather (as `fsdp.gather(..., like=x)` casts them), so the
  blocks add no all-reduce of a whole kernel.

Why not a plain carry: with the next layer's gathered weights in an ordinary
scan carry, autodiff saves the carry of every iteration, i.e. the whole
stack gathered, which defeats `reshard_after_forward`.

Each layer's forward runs twice (the forward, and its recomputation in the
backward), as under remat "full"; a Stack `remat` policy applies inside the
recomputed layer's own backward ("full" there would add a third forward, so
it is treated as "none": across layers the prefetch path already keeps only
the layer inputs).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from shardfuse.kernels.vma import to_varying, varying_axes
from shardfuse.layers import _sharding, fsdp
from shardfuse.layers import remat as remat_lib
from shardfuse.layers.prefetch_plan import (  # the plan half; re-exported
    LeafPlan,
    PrefetchPlan,
    check_keywords,
    make_plan,
)

__all__ = ["LeafPlan", "PrefetchPlan", "apply_layers", "check_keywords", "make_plan"]


def _gather_layer(plan: PrefetchPlan, shards, layer, x):
    """Layer `layer`'s weights, the fsdp-sharded ones all-gathered (in their compute dtype)."""
    weights = []
    for leaf, stacked in zip(plan.leaves, shards, strict=True):
        shard = lax.dynamic_index_in_dim(stacked, layer, 0, keepdims=False)
        if leaf.dim is not None:
            options = fsdp.ZeroOptions(3, plan.fsdp_axis, True, leaf.reduce_dtype)
            dtype = leaf.gather_dtype(x.dtype, shard.dtype)
            shard = fsdp.gather(options, shard, leaf.dim, dtype, like=x)
        weights.append(shard)
    return weights


def _reduce_layer(plan: PrefetchPlan, shards, grads):
    """Weight cotangents (whole over fsdp, per device) reduce-scattered to the shards.

    As `fsdp.gather`'s transpose: reduce-scatter over fsdp in `reduce_dtype`,
    cast to the parameter's dtype, then summed over the other axes the
    gathered weight was cast to vary over (data, ...) on the shard. Every
    cotangent is summed over the axes it varies over beyond its parameter's.
    """
    out = []
    for leaf, stacked, grad in zip(plan.leaves, shards, grads, strict=True):
        if leaf.dim is not None:
            reduce = grad.dtype if leaf.reduce_dtype is None else leaf.reduce_dtype
            with jax.named_scope("fsdp_reduce_scatter"):
                grad = lax.psum_scatter(
                    grad.astype(reduce), plan.fsdp_axis, scatter_dimension=leaf.dim, tiled=True
                )
            grad = grad.astype(stacked.dtype)
        extra = tuple(sorted(varying_axes(grad) - varying_axes(stacked)))
        if extra:
            grad = lax.psum(grad, extra)
        out.append(grad)
    return out


def _apply(plan: PrefetchPlan, weights, x, keywords):
    """One block (the stage-0 graph) on gathered `weights`."""
    state = jax.tree.unflatten(plan.treedef, weights)
    return nnx.merge(plan.graphdef, state)(x, **dict(keywords))


def _forward(plan: PrefetchPlan, shards, x, keywords):
    """All layers; returns the output and the inputs of layers 1..L-1 (`[L-1, ...]` or None)."""

    def body(carry, layer):
        x, weights = carry
        following = _gather_layer(plan, shards, layer + 1, x)  # issued before layer's compute
        y = _apply(plan, weights, x, keywords)
        return (y, following), y

    weights = _gather_layer(plan, shards, 0, x)
    inputs = None
    num_layers = shards[0].shape[0]
    if num_layers > 1:
        (x, weights), inputs = lax.scan(body, (x, weights), jnp.arange(num_layers - 1))
    return _apply(plan, weights, x, keywords), inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _layers(plan: PrefetchPlan, names: tuple, shards, x, values):
    return _forward(plan, shards, x, tuple(zip(names, values, strict=True)))[0]


def _layers_fwd(plan, names, shards, x, values):
    y, inputs = _forward(plan, shards, x, tuple(zip(names, values, strict=True)))
    return y, (shards, x, values, inputs)


def _layers_bwd(plan, names, residuals, cotangent):
    shards, x, values, inputs = residuals
    keywords = tuple(zip(names, values, strict=True))
    # The backward's gathers must not be merged with the forward's (XLA's CSE would keep the
    # gathered weights from the forward to the backward: a 2-layer stack's one-trip loops are
    # inlined, and XLA:CPU drops optimization barriers before CSE). Their layer index is
    # offset by a zero XLA cannot fold: the bit count (at most 32) of one cotangent value,
    # shifted right by 6.
    bits = lax.bitcast_convert_type(cotangent.ravel()[:1].astype(jnp.float32).sum(), jnp.uint32)
    offset = lax.shift_right_logical(lax.population_count(bits), jnp.uint32(6)).astype(jnp.int32)
    policy = "none" if plan.remat == "full" else plan.remat
    layer_fn = remat_lib.checkpoint(
        lambda weights, x: _apply(plan, weights, x, keywords), policy, prevent_cse=False
    )

    def layer_vjp(weights, x_in, cotangent):
        _, vjp = jax.vjp(layer_fn, weights, x_in)
        grad_weights, grad_x = vjp(cotangent)
        return grad_x, _reduce_layer(plan, shards, grad_weights)

    def store(buffers, grads, layer):  # in place: the buffers become the gradient outputs
        return [
            lax.dynamic_update_index_in_dim(b, g, layer, 0)
            for b, g in zip(buffers, grads, strict=True)
        ]

    def body(carry, layer_and_input):
        cotangent, weights, buffers = carry
        layer, x_in = layer_and_input
        previous = _gather_layer(plan, shards, layer - 1 + offset, x_in)  # before the recompute
        grad_x, grads = layer_vjp(weights, x_in, cotangent)
        return (grad_x, previous, store(buffers, grads, layer)), None

    L = shards[0].shape[0]
    weights = _gather_layer(plan, shards, L - 1 + offset, x)
    buffers = [to_varying(jnp.zeros(s.shape, s.dtype), varying_axes(s)) for s in shards]
    if L > 1:
        (cotangent, weights, buffers), _ = lax.scan(
            body, (cotangent, weights, buffers), (jnp.arange(1, L), inputs), reverse=True
        )
    grad_x, first = layer_vjp(weights, x, cotangent)
    grads = store(buffers, first, 0)
    # the keywords are integer (positions, segment ids): no gradient
    zeros = tuple(None if v is None else np.zeros(v.shape, jax.dtypes.float0) for v in values)
    return grads, grad_x, zeros


_layers.defvjp(_layers_fwd, _layers_bwd)


def _check_block(plan: PrefetchPlan, values, x, keywords):
    """One block as built (global view) on layer 0: raises what its call raises for bad input."""
    first = jax.tree.unflatten(plan.treedef, [v[0] for v in values])
    return nnx.merge(plan.block_graphdef, first)(x, **keywords)


def apply_layers(plan: PrefetchPlan, mesh, state, x, keywords: dict):
    """The L layers of `state` (stacked, fsdp-sharded) applied to `x`, next layer prefetched.

    Global view: one `jax.shard_map` over `mesh` (inputs placed on their
    specs); in a manual region (every mesh axis manual) it runs on the local
    shards directly. Same values and gradients as the plain layer scan.

    Args:
      plan: from `make_plan`.
      mesh: the parameters' mesh.
      state: the stacked state (`nnx.state(stack.blocks)`, Variables or arrays).
      x: `[B, T, F]` activations.
      keywords: the blocks' array keywords (`positions`, `segment_ids`) or None values.

    Returns:
      `[B, T, F]`, sharded `plan.io_spec`.

    Example usage::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from flax import nnx
      >>> from shardfuse.layers import prefetch
      >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
      >>> blocks = sf.layers.Stack(
      ...     lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=mesh, zero=3, rngs=rngs),
      ...     2, mesh=mesh, rngs=nnx.Rngs(0)).blocks
      >>> plan = prefetch.make_plan(blocks, mesh)
      >>> y = prefetch.apply_layers(plan, mesh, nnx.state(blocks), jnp.ones((8, 4, 16)), {})
      >>> y.shape, y.sharding.spec
      ((8, 4, 16), P(('data', 'fsdp'), None, None))
    """
    check_keywords(plan, keywords)
    values = [
        v[...] if _sharding.is_variable(v) else v
        for v in jax.tree.leaves(state, is_leaf=_sharding.is_variable)
    ]
    if not _sharding.in_manual_region(mesh):  # the blocks' own input checks, before tracing
        jax.eval_shape(functools.partial(_check_block, plan), values, x, keywords)
    known = dict(plan.keyword_specs)
    names = tuple(sorted(keywords))

    def local(shards, x, keyword_values):
        return _layers(plan, names, shards, x, tuple(keyword_values))

    return _sharding.shard_map_call(
        local,
        mesh,
        [values, x, [keywords[n] for n in names]],
        [list(plan.specs), plan.io_spec, [known[n] for n in names]],
        plan.io_spec,
    )
