"""ZeRO stages in the layers: fsdp-sharded parameters gathered just in time (ZeRO-3 / FSDP).

ZeRO (Rajbhandari et al. 2020) removes the data-parallel redundancy of the
training state over an `fsdp` mesh axis: stage 1 shards the optimizer state,
stage 2 the gradients too, stage 3 (FSDP, Zhao et al. 2023) the parameters
too. Stages 1 and 2 do not change a layer (the optimizer and the gradient
function of `shardfuse.parallel` shard their state); stage 3 does:

- each kernel is created sharded over `fsdp` on the dimension the model axis
  leaves whole (column kernel `[in, out]`: `P(fsdp, model)`; row kernel:
  `P(model, fsdp)`); biases and norm scales, small, stay replicated;
- the per-shard function all-gathers the kernel over `fsdp` in the compute
  `dtype` right before its matmul (`gather`); the transpose of that gather
  is a reduce-scatter, so gradients come out sharded like the parameters,
  reduced in `reduce_dtype` (float32 by default);
- `reshard_after_forward=True` (default) tags the gathered copy
  `FSDP_GATHER`, a name no checkpoint policy saves: the backward gathers it
  again instead of keeping it (memory of one layer's weights, not all).

Stage 2's gradients (`shardfuse.parallel.accumulate(zero=2)`) are
reduce-scattered inside the backward pass, as soon as each is produced:
`scatter_gradient(full, sink, axis, dim)` is the identity on a replicated
parameter whose transpose reduce-scatters the cotangent over fsdp into the
gradient of `sink`, an array of the shard's shape (the differentiated
variable). `Stack` ties each layer's slice inside its layer scan
(`layer_scatters`), so the largest gradient alive is one layer's plus the
sharded buffer; the parameters stay replicated for the forward.

Whatever the stage, the fsdp axis is a data-parallel axis for activations:
the batch is split over `(data, fsdp)` (`batch_axes`), and over the expert axis too
where the mesh has one.

This module is ZeRO's home on the model's side of the optimizer boundary:
the stages (`ZERO_STAGES`, `check_zero`), a stage and its axis resolved on a
mesh (`zero_options`, `ZeroOptions`), and what happens to parameters and
gradients inside the forward and backward passes. The other side, the
shardings of the optimizer state and of the accumulated gradients and the
optimizer itself, is `shardfuse.parallel.zero`, which takes a `ZeroOptions`.
"""

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from shardfuse import axes
from shardfuse.collectives.sharding import check_mesh_axes
from shardfuse.kernels.vma import to_varying, varying_axes

ZERO_STAGES = (0, 1, 2, 3)
DEFAULT_FSDP_AXIS = axes.FSDP
FSDP_GATHER = "fsdp_gather"  # checkpoint name of a gathered ZeRO-3 weight
_GATHER_SCOPE = "fsdp_all_gather"  # named scope of the gather (how remat policies spot it)


def check_zero(zero) -> int:
    """`zero` as an int; ValueError unless it is one of 0, 1, 2, 3."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero={zero!r} must be one of {ZERO_STAGES} (the ZeRO stage)")
    return int(zero)


@dataclasses.dataclass(frozen=True)
class ZeroOptions:
    """A layer's ZeRO settings (hashable: part of the layer's compiled-program key).

    Attributes:
      stage: the ZeRO stage, 0 to 3.
      fsdp_axis: the mesh axis (None: the mesh has none; then every stage is stage 0 here).
      reshard_after_forward: ZeRO-3: drop gathered weights after use, gather again
        in the backward.
      reduce_dtype: dtype of the gradient reduce-scatter (None: the compute dtype).
    """

    stage: int = 0
    fsdp_axis: str | None = None
    reshard_after_forward: bool = True
    reduce_dtype: object = jnp.dtype(jnp.float32)

    @property
    def param_axis(self) -> str | None:
        """The axis parameters are sharded over: `fsdp_axis` under stage 3, else None."""
        return self.fsdp_axis if self.stage == 3 else None


def fsdp_axis_on(mesh, fsdp_axis) -> str | None:
    """`fsdp_axis` as it shards on `mesh`: None for None, and for the default "fsdp" on a
    mesh that lacks it (an absent axis has size 1).

    Raises:
      ValueError: an explicitly chosen name that is not an axis of the mesh.
    """
    if fsdp_axis is None or fsdp_axis in mesh.axis_names:
        return fsdp_axis
    if fsdp_axis == DEFAULT_FSDP_AXIS:
        return None
    raise ValueError(
        f"fsdp_axis={fsdp_axis!r} is not an axis of the mesh; its axes are {tuple(mesh.axis_names)}"
    )


def zero_options(mesh, *, zero, fsdp_axis=DEFAULT_FSDP_AXIS, reshard_after_forward=True,
                 reduce_dtype=jnp.float32) -> ZeroOptions:  # fmt: skip
    """Checked `ZeroOptions` on `mesh`: of a layer, of the optimizer state, of the gradients.

    The one place a ZeRO stage and its axis are checked and resolved; every
    entry point that takes `zero=` calls it (`LayerOptions.zero_options`,
    `sf.parallel.ZeroOptimizer`, `sf.parallel.accumulate`). A `zero` that is a
    `ZeroOptions` already (a run's, resolved once by `parallelize`) is returned
    as it is. `fsdp_axis`: `fsdp_axis_on`.

    Raises:
      ValueError: `zero` not in 0..3, or `fsdp_axis` not an axis of the mesh.

    Example usage::

      >>> import jax
      >>> from shardfuse.layers import fsdp
      >>> mesh = jax.make_mesh((4, 2), ("fsdp", "model"))
      >>> options = fsdp.zero_options(mesh, zero=3, fsdp_axis="fsdp",
      ...                             reshard_after_forward=True, reduce_dtype="float32")
      >>> options.param_axis, fsdp.kernel_spec(jax.P(None, "model"), options, 0)
      ('fsdp', P('fsdp', 'model'))
    """
    if isinstance(zero, ZeroOptions):
        return zero
    stage = check_zero(zero)
    reduce = None if reduce_dtype is None else jnp.dtype(reduce_dtype)
    return ZeroOptions(stage, fsdp_axis_on(mesh, fsdp_axis), bool(reshard_after_forward), reduce)


def batch_axes(data_axis, fsdp_axis, expert_axis=None):
    """PartitionSpec entry of the batch dimension: `data_axis`, `fsdp_axis` and `expert_axis`
    (outside the experts of a `ParallelMoE`, a data axis), those not None."""
    axes = tuple(a for a in (data_axis, fsdp_axis, expert_axis) if a)
    return None if not axes else axes[0] if len(axes) == 1 else axes


def kernel_spec(spec: P, options: ZeroOptions, dim: int) -> P:
    """`spec` of a 2-D kernel with the ZeRO-3 axis on dimension `dim` (unchanged below stage 3)."""
    axis = options.param_axis
    if axis is None:
        return spec
    entries = list(spec) + [None] * (2 - len(spec))
    entries[dim] = axis
    return P(*entries)


def check_kernel(argument: str, size: int, mesh, options: ZeroOptions):
    """ValueError unless a kernel dimension of `size` divides evenly over the ZeRO-3 axis."""
    axis = options.param_axis
    if axis is not None and size % mesh.shape[axis]:
        raise ValueError(
            f"{argument}={size} must be divisible by the size {mesh.shape[axis]} of fsdp_axis "
            f"{axis!r} (zero=3 shards every kernel over it); pick a mesh whose fsdp size "
            "divides it, or zero < 3"
        )


def gather(options: ZeroOptions, shard, dim: int, dtype, like=None):
    """This device's kernel in `dtype`: under ZeRO-3 the fsdp shards all-gathered along `dim`.

    Per-shard (inside `jax.shard_map` or a manual region). The gradient of
    the gathered kernel is reduce-scattered back to the shard in
    `options.reduce_dtype` and returned in the shard's dtype. The gathered
    value carries the checkpoint name `FSDP_GATHER`.

    `like`: the activations the kernel multiplies. The shard is cast to vary
    over their mesh axes (data, ...) BEFORE the gather, so that the gradient's
    sum over those axes (the transpose of that cast) runs on the
    reduce-scattered shard, not on the whole kernel: one reduce-scatter over
    fsdp, then an all-reduce of `1/fsdp` of the bytes over data.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.layers import fsdp
      >>> mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> options = fsdp.ZeroOptions(3, "fsdp")
      >>> whole = jax.shard_map(lambda w: fsdp.gather(options, w, 0, jnp.float32), mesh=mesh,
      ...                       in_specs=jax.P("fsdp"), out_specs=jax.P("fsdp"))
      >>> whole(jnp.arange(8.0)).shape  # each of the 4 devices holds all 8 rows
      (32,)
    """
    dtype = jnp.dtype(dtype)
    if options.param_axis is None:
        return shard.astype(dtype)
    if like is not None:
        shard = to_varying(shard, varying_axes(shard) | varying_axes(like))
    reduce = dtype if options.reduce_dtype is None else options.reduce_dtype
    full = _fsdp_gather(shard, options.param_axis, dim, dtype, reduce, jnp.dtype(shard.dtype))
    return checkpoint_name(full, FSDP_GATHER)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _fsdp_gather(shard, axis, dim, dtype, reduce_dtype, param_dtype):
    with jax.named_scope(_GATHER_SCOPE):
        return lax.all_gather(shard.astype(dtype), axis, axis=dim, tiled=True)


def _gather_fwd(shard, axis, dim, dtype, reduce_dtype, param_dtype):
    return _fsdp_gather(shard, axis, dim, dtype, reduce_dtype, param_dtype), None


def _gather_bwd(axis, dim, dtype, reduce_dtype, param_dtype, _, cotangent):
    with jax.named_scope("fsdp_reduce_scatter"):
        grad = lax.psum_scatter(
            cotangent.astype(reduce_dtype), axis, scatter_dimension=dim, tiled=True
        )
    return (grad.astype(param_dtype),)


_fsdp_gather.defvjp(_gather_fwd, _gather_bwd)


def check_batch_axes(mesh, layer, options: ZeroOptions, expert_axis=None):
    """The batch entry `(data, fsdp, expert)` of `layer`'s activation specs, the axes checked
    distinct (`expert_axis`: the expert-parallel axis, a data axis outside the experts).

    `layer` has `model_axis`, `data_axis` and `sequence_axis` (checked already).

    Raises:
      ValueError: the fsdp axis is also the layer's model, data or sequence axis.
    """
    check_mesh_axes(
        mesh,
        model_axis=layer.model_axis,
        data_axis=layer.data_axis,
        sequence_axis=layer.sequence_axis,
        fsdp_axis=options.fsdp_axis,
    )
    if expert_axis is not None and expert_axis in (
        layer.model_axis,
        layer.data_axis,
        layer.sequence_axis,
        options.fsdp_axis,
    ):
        raise ValueError(
            f"expert_axis={expert_axis!r} is also the layer's model, data, sequence or fsdp axis; "
            "each axis may shard one dimension only"
        )
    return batch_axes(layer.data_axis, options.fsdp_axis, expert_axis)


def reshard_after_forward(fn, options: ZeroOptions):
    """`fn` (a per-shard function) saving no gathered ZeRO-3 weight for the backward.

    Under zero=3 with `reshard_after_forward`, `fn` runs under `jax.checkpoint`
    with a policy that saves every residual except the values named
    `FSDP_GATHER`, which the backward gathers again. Otherwise `fn` itself.
    """
    if options.param_axis is None or not options.reshard_after_forward:
        return fn
    return jax.checkpoint(fn, policy=save_anything_but_gathered)


def is_gathered(primitive, **params) -> bool:
    """True for the equations that make a gathered ZeRO-3 weight (the gather and its name)."""
    if primitive.name == "name":
        return params.get("name") == FSDP_GATHER
    if primitive.name != "custom_vjp_call":
        return False
    jaxpr = getattr(params.get("call_jaxpr"), "jaxpr", None)
    return any(
        _GATHER_SCOPE in str(eqn.source_info.name_stack) for eqn in getattr(jaxpr, "eqns", ())
    )


def save_anything_but_gathered(primitive, *_, **params) -> bool:
    """`jax.checkpoint` policy: save every value except gathered ZeRO-3 weights.

    (`save_anything_except_these_names(FSDP_GATHER)` is not enough: it would
    save the gather's own output, the value the name is put on.) Nor the
    output of a `pvary`, the type cast JAX puts between a gathered weight and
    activations that vary over more axes: saving it would keep the whole
    weight after all (its input is saved or recomputed instead: same bytes
    for activations, a gather again for weights).
    """
    return primitive.name != "pvary" and not is_gathered(primitive, **params)


# ZeRO-2: gradients reduce-scattered in the backward pass, where the parameters are used.


def scatter_gradient(full, sink, axis: str, dim: int):
    """`full` (a replicated parameter), whose gradient is reduce-scattered into `sink`'s.

    Per-shard (inside `jax.shard_map`). The forward returns `full` and reads
    nothing of `sink`; the backward reduce-scatters the cotangent over mesh
    axis `axis` along dimension `dim` (`lax.psum_scatter(..., tiled=True)`)
    in `sink`'s dtype and returns it as `sink`'s gradient (`full`'s is zero).
    Differentiate with respect to `sink` (an array of the shard's shape, e.g.
    zeros): the gradient is then this device's reduced shard, produced where
    `full` is used, not after the whole backward pass.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from shardfuse.layers import fsdp
      >>> mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> def grad(w, sink):  # d/dsink of sum(w * w): 2 w summed over the 4 devices, scattered
      ...     return jax.grad(lambda s: jnp.sum(fsdp.scatter_gradient(w, s, "fsdp", 0) ** 2))(sink)
      >>> f = jax.shard_map(grad, mesh=mesh, in_specs=(jax.P(), jax.P("fsdp")),
      ...                   out_specs=jax.P("fsdp"))
      >>> f(jnp.arange(8.0), jnp.zeros(8)).tolist()
      [0.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0]
    """
    return _scatter_gradient(full, sink, axis, dim, jnp.dtype(sink.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _scatter_gradient(full, sink, axis, dim, sink_dtype):
    del sink, axis, dim, sink_dtype
    return full


def _scatter_fwd(full, sink, axis, dim, sink_dtype):
    del sink, axis, dim, sink_dtype
    return full, None


def _scatter_bwd(axis, dim, sink_dtype, _, cotangent):
    with jax.named_scope("zero2_reduce_scatter"):
        grad = lax.psum_scatter(
            cotangent.astype(sink_dtype), axis, scatter_dimension=dim, tiled=True
        )
    return None, to_varying(grad, varying_axes(cotangent))


_scatter_gradient.defvjp(_scatter_fwd, _scatter_bwd)


@dataclasses.dataclass(frozen=True)
class GradientScatter:
    """A parameter whose gradient `scatter_gradient` reduce-scatters: its replicated value
    `full`, the differentiated `sink` (the shard's shape), the mesh `axis` and dimension `dim`."""

    full: object
    sink: object
    axis: str
    dim: int


_SCATTERS = contextvars.ContextVar("shardfuse_zero2_scatters", default=None)


@contextlib.contextmanager
def scattering_gradients(scatters: dict):
    """Within: `layer_scatters` finds the `GradientScatter`s of `scatters` (keyed by the
    id of the array the model holds), so that a `Stack` ties them per layer."""
    token = _SCATTERS.set(scatters)
    try:
        yield
    finally:
        _SCATTERS.reset(token)


def layer_scatters(stacked_values) -> list | None:
    """Per leaf of a `Stack`'s stacked values: its `GradientScatter` if a layer slice can be
    reduce-scattered on its own (scatter dimension not the layer axis 0), else None; None
    when no leaf has one (outside `scattering_gradients`)."""
    scatters = _SCATTERS.get()
    if not scatters:
        return None
    found = [scatters.get(id(v)) for v in jax.tree.leaves(stacked_values)]
    found = [s if s is not None and s.dim >= 1 else None for s in found]
    return found if any(s is not None for s in found) else None
