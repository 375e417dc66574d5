"""The plan of `shardfuse.layers.prefetch`: which leaves of a Stack's blocks are gathered.

`make_plan` reads a `Stack`'s blocks once (outside any trace): per parameter
its stacked spec, the fsdp dimension it is gathered along and the dtype it
is gathered in (`LeafPlan`), and a copy of the block graph at ZeRO stage 0
that runs on gathered weights (`PrefetchPlan`). `check_keywords` validates the
keyword arrays the blocks take. The prefetching scan itself is
`shardfuse.layers.prefetch`.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardfuse.flops import check_remat
from shardfuse.layers import _sharding, fsdp


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one stacked parameter is gathered and reduced.

    Attributes:
      dim: dimension of the (unstacked) parameter sharded over fsdp; None
        when it is not (biases): passed as is, no gather.
      compute_dtype: dtype to gather in (None: the promoted dtype of the
        activations and the parameter, as the layers' `compute_dtype`).
      own_dtype: gather in the parameter's own dtype (norm scales).
      reduce_dtype: dtype of the gradient reduce-scatter (None: the gathered dtype).

    Example usage::

      >>> import jax.numpy as jnp
      >>> from shardfuse.layers.prefetch import LeafPlan
      >>> LeafPlan(0, compute_dtype=jnp.bfloat16).gather_dtype(jnp.float32, jnp.float32)
      dtype(bfloat16)
    """

    dim: int | None
    compute_dtype: object = None
    own_dtype: bool = False
    reduce_dtype: object = jnp.dtype(jnp.float32)

    def gather_dtype(self, x_dtype, param_dtype):
        """The dtype this parameter is gathered (and computed) in."""
        if self.own_dtype:
            return jnp.dtype(param_dtype)
        return _sharding.compute_dtype(self.compute_dtype, jnp.zeros((), x_dtype), param_dtype)


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    """Static description of a prefetching layer scan (hashable: a `custom_vjp` static argument).

    Attributes:
      graphdef: the block graph at ZeRO stage 0 (same fsdp axis), run on gathered weights.
      treedef: pytree structure of one layer's state.
      leaves: a `LeafPlan` per leaf of the state, in `treedef` order.
      specs: stacked PartitionSpec per leaf (`[L, ...]`, fsdp on the parameter's dimension).
      fsdp_axis: the mesh axis the weights are sharded over.
      io_spec: PartitionSpec of the `[B, T, F]` activations between blocks.
      keyword_specs: `(name, spec)` of each array keyword the blocks accept.
      remat: the Stack's policy, applied inside each recomputed layer.
      block_graphdef: the block graph as built (ZeRO-3), whose call checks the input.

    Example usage (see `make_plan`)::

      >>> import jax, shardfuse as sf
      >>> from flax import nnx
      >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
      >>> def block(rngs):
      ...     return sf.layers.ParallelTransformerBlock(32, 4, 64, mesh=mesh, zero=3, rngs=rngs)
      >>> blocks = sf.layers.Stack(block, 2, mesh=mesh, rngs=nnx.Rngs(0)).blocks
      >>> plan = sf.layers.prefetch.make_plan(blocks, mesh)
      >>> plan.io_spec, dict(plan.keyword_specs)["segment_ids"]
      (P(('data', 'fsdp'), None, None), P(('data', 'fsdp'), None))
    """

    graphdef: object
    treedef: object
    leaves: tuple
    specs: tuple
    fsdp_axis: str
    io_spec: P
    keyword_specs: tuple
    remat: str
    block_graphdef: object


def _stage0_copy(blocks):
    """The block graph with every ZeRO-3 layer at stage 0 (same fsdp axis); the fsdp axis."""
    copy = nnx.merge(*nnx.split(blocks))
    axes = set()
    for path, module in nnx.iter_modules(copy):
        zero = getattr(module, "zero", None)
        if isinstance(zero, fsdp.ZeroOptions) and zero.param_axis is not None:
            if not zero.reshard_after_forward:
                raise ValueError(
                    f"prefetch=True gathers every layer again in the backward, but "
                    f"{'.'.join(map(str, path)) or type(module).__name__} was built with "
                    "reshard_after_forward=False (keep the gathered weights); build the blocks "
                    "with reshard_after_forward=True or use prefetch=False"
                )
            axes.add(zero.param_axis)
            module.zero = dataclasses.replace(zero, stage=0)
            # `Norm` keeps its parameters' spec `P(param_axis)` as an attribute
            if getattr(module, "spec", None) == P(zero.param_axis):
                module.spec = P(None)
    return nnx.graphdef(copy), axes


def _owners(blocks):
    """`{module path: module}` of the modules with ZeRO options."""
    return {
        tuple(path): module
        for path, module in nnx.iter_modules(blocks)
        if isinstance(getattr(module, "zero", None), fsdp.ZeroOptions)
    }


def _leaf_plan(path, spec, owners, fsdp_axis) -> LeafPlan:
    names = tuple(getattr(k, "key", getattr(k, "name", k)) for k in path)
    owner = max(
        (p for p in owners if names[: len(p)] == p), key=len, default=None
    )  # innermost module holding the parameter
    entries = tuple(spec)[1:]
    if any(fsdp_axis in e for e in entries if isinstance(e, tuple)):
        raise NotImplementedError(
            f"parameter {'.'.join(map(str, names))} is sharded {spec}: fsdp inside a tuple "
            "entry; prefetch gathers parameters sharded over fsdp alone on one dimension"
        )
    dim = entries.index(fsdp_axis) if fsdp_axis in entries else None
    if owner is None:
        return LeafPlan(dim, own_dtype=True)
    module = owners[owner]
    zero = module.zero
    return LeafPlan(
        dim,
        compute_dtype=getattr(module, "dtype", None),
        own_dtype=not hasattr(module, "dtype"),
        reduce_dtype=zero.reduce_dtype,
    )


def _keyword_specs(blocks) -> tuple:
    """Specs of the array keywords of a block (`positions`, `segment_ids` of its attention)."""
    owner = blocks if hasattr(blocks, "token_specs") else getattr(blocks, "attention", None)
    if owner is None or not hasattr(owner, "token_specs"):
        return ()
    _, positions, segment_ids = owner.token_specs()
    return (("positions", positions), ("segment_ids", segment_ids))


def make_plan(blocks, mesh, *, layer_axis=None, remat: str = "none"):
    """Checks that `blocks` (a `Stack`'s stacked blocks) can prefetch; returns their plan.

    Args:
      blocks: `Stack.blocks`: the block graph holding `[L, ...]` parameters.
      mesh: the mesh of the parameters.
      layer_axis: the Stack's layer axis (must be None: not pipelined).
      remat: the Stack's remat policy.

    Returns:
      A `PrefetchPlan`.

    Raises:
      ValueError: the stack is sharded over a layer (pipeline) axis, the
        blocks are not ZeRO-3 over one fsdp axis of size > 1 (or were built
        with `reshard_after_forward=False`), or the block has no `io_spec()`.

    Example usage::

      >>> import jax, shardfuse as sf
      >>> from flax import nnx
      >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
      >>> mlp = lambda rngs: sf.layers.ParallelMLP(16, 32, mesh=mesh, zero=3, rngs=rngs)
      >>> stack = sf.layers.Stack(mlp, 2, mesh=mesh, rngs=nnx.Rngs(0))
      >>> plan = sf.layers.prefetch.make_plan(stack.blocks, mesh)
      >>> plan.fsdp_axis, [leaf.dim for leaf in plan.leaves]  # down: bias, kernel; up: bias, kernel
      ('fsdp', [None, 1, None, 0])
    """
    if layer_axis is not None:
        raise ValueError(
            f"prefetch=True runs the layers in one scan on every device; layer_axis="
            f"{layer_axis!r} shards them over a pipeline axis (use prefetch=False there)"
        )
    graphdef, axes = _stage0_copy(blocks)
    if len(axes) != 1:
        raise ValueError(
            "prefetch=True needs blocks built with zero=3 over one fsdp axis (their weights "
            f"sharded over it); these blocks shard weights over {sorted(axes) or 'no axis'}"
        )
    (fsdp_axis,) = axes
    if mesh.shape[fsdp_axis] < 2:
        raise ValueError(
            f"prefetch=True needs an fsdp axis of size > 1; {fsdp_axis!r} has size "
            f"{mesh.shape[fsdp_axis]} (nothing to gather: use prefetch=False)"
        )
    if not hasattr(blocks, "io_spec"):
        raise ValueError(
            f"prefetch=True needs a block with io_spec() (its activations' PartitionSpec); "
            f"{type(blocks).__name__} has none"
        )
    state = nnx.state(blocks)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_sharding.is_variable)
    owners = _owners(blocks)
    specs = tuple(v.get_metadata()["out_sharding"] for _, v in flat)
    leaves = tuple(
        _leaf_plan(path, spec, owners, fsdp_axis)
        for (path, _), spec in zip(flat, specs, strict=True)
    )
    return PrefetchPlan(
        graphdef,
        treedef,
        leaves,
        specs,
        fsdp_axis,
        blocks.io_spec(),
        _keyword_specs(blocks),
        check_remat(remat),
        nnx.graphdef(blocks),
    )


def check_keywords(plan: PrefetchPlan, keywords: dict):
    """ValueError/TypeError unless every keyword is an integer array the blocks take (or None).

    Example usage::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from flax import nnx
      >>> fsdp = jax.make_mesh((4,), ("fsdp",))  # ZeRO-3 alone
      >>> layers = sf.layers.Stack(
      ...     lambda rngs: sf.layers.ParallelMLP(8, 16, mesh=fsdp, zero=3, rngs=rngs),
      ...     3, mesh=fsdp, rngs=nnx.Rngs(1))
      >>> plan = sf.layers.prefetch.make_plan(layers.blocks, fsdp)
      >>> sf.layers.prefetch.check_keywords(plan, {"mask": jnp.ones(4)})
      Traceback (most recent call last):
      ValueError: mask=ArrayImpl: with prefetch=True the blocks take only the array keywords [] ...
    """
    known = dict(plan.keyword_specs)
    for name, value in keywords.items():
        if name not in known:
            raise ValueError(
                f"{name}={type(value).__name__}: with prefetch=True the blocks take only the "
                f"array keywords {sorted(known)} (each sharded as the block documents)"
            )
        dtype = getattr(value, "dtype", None)
        if value is not None and (dtype is None or not jnp.issubdtype(dtype, jnp.integer)):
            raise TypeError(
                f"{name} has dtype {dtype}; with prefetch=True keyword arrays must be integer "
                "(positions, segment ids: they get no gradient)"
            )
