"""`Stack`: N identical NNX blocks, parameters stacked on a leading layer axis.

Each parameter of the block, of shape `S` and sharding `P(*spec)`, becomes
one array `[L, *S]` sharded `P(layer_axis, *spec)`: `layer_axis` None (every
device holds every layer) or the pipeline mesh axis (layer `l` on pipeline
stage `l // (L / p)`, what `sf.parallel.pipeline.Pipeline` runs). The
parameters are created already sharded: one jitted, vmapped initializer with
`out_shardings`, the vmapped axis split over `layer_axis` (`spmd_axis_name`),
so each stage creates only its own layers' shards and no device holds a full
copy first. Layer `l` is initialized from key `l` of
`jax.random.split(rngs.params(), L)`: the same values on every mesh.

Applied plainly, the stack is one `lax.scan` over the layer axis (the scan
body traced once, compile time flat in L), each layer wrapped in the named
activation-checkpointing policy of `shardfuse.layers.remat`. A scan's carry
keeps its type, so the input enters it as a block returns it: in the block's
output dtype (bfloat16 blocks given float32 activations return bfloat16) and,
on Explicit mesh axes, on the block's output sharding (the batch split over
the data axes), read from the abstract output of one layer (`jax.eval_shape`).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.collectives.sharding import branches_may_hold_collectives, explicit_axes
from shardfuse.kernels.vma import to_varying, varying_axes
from shardfuse.layers import _sharding
from shardfuse.layers import fsdp as fsdp_lib
from shardfuse.layers import options as options_lib
from shardfuse.layers import prefetch as prefetch_lib
from shardfuse.layers import remat as remat_lib
from shardfuse.layers.moe import MoEStats, ParallelMoE

# Variable metadata of a stacked parameter (dimension 0 is the layer axis): ZeRO shards
# its gradient and optimizer state on a later dimension (`shardfuse.parallel.zero`).
STACKED = "stacked_layers"


def _typed_zeros(struct):
    """Zeros of `struct`'s shape and dtype, varying over the manual axes it varies over."""
    manual = getattr(struct, "manual_axis_type", None)
    vma = getattr(struct, "vma", None) or getattr(manual, "varying", None)
    return to_varying(jnp.zeros(struct.shape, struct.dtype), frozenset(vma or ()))


def check_stage_layers(stage_layers, num_layers: int, num_stages: int | None = None) -> tuple:
    """`stage_layers` as a tuple of ints >= 1 summing to `num_layers` (over `num_stages`).

    Raises:
      ValueError: a count < 1 or not an int, a sum other than `num_layers`, or
        (given `num_stages`) a length other than it.

    Example:
      >>> from shardfuse.layers.stack import check_stage_layers
      >>> check_stage_layers([3, 3, 2, 2], 10, 4)
      (3, 3, 2, 2)
    """
    try:
        counts = tuple(stage_layers)
    except TypeError:
        raise ValueError(f"stage_layers={stage_layers!r} must be a sequence of ints") from None
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"stage_layers={counts} must be positive ints (the layers per stage)")
    if sum(counts) != num_layers:
        raise ValueError(
            f"stage_layers={counts} sums to {sum(counts)}; it must sum to num_layers={num_layers}"
        )
    if num_stages is not None and len(counts) != num_stages:
        raise ValueError(
            f"stage_layers={counts} has {len(counts)} stages; the layer axis has {num_stages}"
        )
    return counts


def _layer_rows(num_layers: int, stage_layers) -> list:
    """The layer held in each stacked row (-1: padding): stage s in rows [s R, (s+1) R)."""
    if stage_layers is None:
        return list(range(num_layers))
    most, rows, layer = max(stage_layers), [], 0
    for count in stage_layers:
        rows += list(range(layer, layer + count)) + [-1] * (most - count)
        layer += count
    return rows


def features_of(module) -> int | None:
    """The activation width F that `module` takes: its `in_features` or `features` (else None).

    `nnx.Linear` and the linear layers declare `in_features`; `Norm`, `ParallelMLP`,
    `ParallelSelfAttention`, `ParallelTransformerBlock` and `Stack` declare `features`.
    None for a module that declares neither (its width is then not checked).
    """
    for name in ("in_features", "features"):
        width = getattr(module, name, None)
        if isinstance(width, int) and not isinstance(width, bool):
            return width
    return None


def check_head(head, features: int | None, *, source: str = "the stack"):
    """ValueError unless `head` takes the width `features` that `source` gives it.

    Checked before any tracing, so that a head built for another width fails here,
    naming both widths, not deep inside a traced matmul. Nothing to check when
    either width is unknown (None).
    """
    width = features_of(head)
    if width is None or features is None or width == features:
        return
    raise ValueError(
        f"the head {type(head).__name__} takes {width} features, but the width of {source} "
        f"is {features}; build the head for {features} features (or {source} for {width})"
    )


def _first_layer(graphdef, values, x, kwargs):
    """Layer 0 of the stacked `values` (pure arrays) applied to `x`."""
    layer = jax.tree.map(lambda a: a[0], values)
    return nnx.merge(graphdef, layer)(x, **kwargs)


# One trace per block configuration and input type (graphdef static: jit's cache key).
_layer_output_type = jax.jit(_first_layer, static_argnums=0).eval_shape


def stacked_spec(spec, layer_axis) -> P:
    """`P(layer_axis, *spec)`: the sharding of a block parameter stacked on the layer axis.

    In canonical form (`_sharding.canonical_spec`: no trailing Nones).
    """
    return _sharding.canonical_spec(P(layer_axis, *(spec or ())))


class Stack(nnx.Module):
    """`num_layers` copies of `make_block(rngs)` applied in order, parameters stacked.

    `stack(x, **kwargs)` equals `for block in blocks: x = block(x, **kwargs)`
    with `blocks[l]` holding slice `l` of every stacked parameter. Blocks holding a
    `ParallelMoE` (`ParallelTransformerBlock(moe=...)`): the scan returns each layer's
    `MoEStats`, written to the stacked variables (`[L]`, `[L, E]`), so that
    `sf.layers.moe_stats(stack)` sums the aux losses over the L layers, as over the
    looped blocks (and differentiably, under every remat policy). In a
    `sf.parallel.Pipeline` each stage returns them per microbatch
    (`apply_stage_layers_with_stats`) and the pipelined loss adds the aux losses.

    Args:
      make_block: `make_block(rngs) -> nnx.Module`, a block whose call maps
        activations to activations of the same shape (e.g. a
        `ParallelTransformerBlock`). Its parameters' `out_sharding` metadata
        (what `nnx.get_partition_spec` reads) gives their sharding.
      num_layers: L >= 1.
      options: a `LayerOptions`: the stack reads its `mesh` (that of the blocks'
        parameters), `remat` and `prefetch`; option keywords override them (`mesh=`,
        `remat=`, `prefetch=`). The blocks are `make_block`'s: to give them the same
        options, build them with `options.replace(remat="none")` (the stack
        applies the policy per layer; a block's own `remat` would apply it a
        second time, inside).
      mesh: the mesh of the blocks' parameters.
      layer_axis: mesh axis of the stacked layer dimension: None (replicated)
        or the pipeline axis ("pipeline"), whose size must divide L.
      remat: activation checkpointing of each layer: "none", "full",
        "selective", "dots" or "offload" (`shardfuse.layers.remat`).
      prefetch: (an option) ZeRO-3 blocks only: gather layer l+1's weights while layer l
        computes (forward) and layer l-1's while layer l's backward runs,
        one `jax.custom_vjp` over the layer scan that keeps only the sharded
        weights and each layer's input for the backward
        (`shardfuse.layers.prefetch`). Needs blocks built with `zero=3` over
        an fsdp axis of size > 1, `layer_axis=None` and a block with
        `io_spec()`, and no `ParallelMoE` in the blocks (its aux-loss statistics
        cannot leave that custom_vjp: ValueError). Same values and gradients as False.
      stage_layers: uneven pipeline stages: the layers of each `layer_axis`
        rank, in order (e.g. `(3, 3, 2, 2)`: 10 layers over 4 stages; from
        `sf.parallel.balance_stages`). The stacked parameters then hold
        `p x max(stage_layers)` rows, stage s's layers first in its rows and
        zero padding after them (`apply_stage_layers` skips it; the plain
        call runs the L real layers). Default None: L / p layers each.
      rngs: `nnx.Rngs`; its `params` stream seeds the L layers.

    Raises:
      ValueError: num_layers < 1, an unknown remat policy, a layer_axis
        that is not a mesh axis, or L not divisible by its size (without
        stage_layers); stage_layers without layer_axis, of another length
        than its size or not summing to L; prefetch=True where it does not
        apply (see `prefetch`; blocks holding a `ParallelMoE` among them).

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> from shardfuse.layers.stack import Stack
      >>> mesh = jax.make_mesh((2, 2), ("pipeline", "model"))
      >>> stack = Stack(lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 32, mesh=mesh,
      ...               rngs=rngs), 4, mesh=mesh, layer_axis="pipeline", rngs=nnx.Rngs(0))
      >>> stack.blocks.mlp.up.kernel.shape, stack.blocks.mlp.up.kernel[...].sharding.spec
      ((4, 16, 64), P('pipeline', None, 'model'))
      >>> stack(jnp.ones((2, 8, 16))).shape
      (2, 8, 16)

    Uneven stages: 10 layers over 4 pipeline stages, 3 rows each (the last of the two
    lighter stages' rows are padding)::

      >>> stack = Stack(lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 32, mesh=mesh,
      ...               rngs=rngs), 10, mesh=mesh, layer_axis="pipeline",
      ...               stage_layers=(3, 3, 2, 2), rngs=nnx.Rngs(0))
      Traceback (most recent call last):
      ...
      ValueError: stage_layers=(3, 3, 2, 2) has 4 stages; the layer axis has 2
      >>> stack = Stack(lambda rngs: sf.layers.ParallelTransformerBlock(16, 2, 32, mesh=mesh,
      ...               rngs=rngs), 5, mesh=mesh, layer_axis="pipeline",
      ...               stage_layers=(3, 2), rngs=nnx.Rngs(0))
      >>> stack.blocks.mlp.up.kernel.shape, stack(jnp.ones((2, 8, 16))).shape
      ((6, 16, 64), (2, 8, 16))

    ZeRO-3 blocks with the next layer's weights prefetched::

      >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
      >>> stack = Stack(lambda rngs: sf.layers.ParallelTransformerBlock(32, 4, 64, mesh=mesh,
      ...               zero=3, rngs=rngs), 3, mesh=mesh, prefetch=True, rngs=nnx.Rngs(0))
      >>> tuple(stack.blocks.mlp.up.kernel[...].sharding.spec)[:2]  # [layers, in, out]
      (None, 'fsdp')
      >>> y = stack(jnp.ones((8, 16, 32)))
      >>> y.shape, y.sharding.spec
      ((8, 16, 32), P(('data', 'fsdp'), None, None))
    """

    @options_lib.option_keywords
    def __init__(
        self,
        make_block,
        num_layers: int,
        *,
        options: options_lib.LayerOptions | None = None,
        layer_axis: str | None = None,
        stage_layers=None,
        rngs: nnx.Rngs,
    ):
        mesh = options_lib.require_mesh(options, "Stack")
        remat, prefetch = options.remat, options.prefetch
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers={num_layers!r} must be a positive integer")
        if layer_axis is not None:
            if layer_axis not in mesh.axis_names:
                raise ValueError(
                    f"layer_axis={layer_axis!r} is not an axis of the mesh; its axes are "
                    f"{tuple(mesh.axis_names)} (or pass None: layers replicated)"
                )
            size = mesh.shape[layer_axis]
            if stage_layers is not None:
                stage_layers = check_stage_layers(stage_layers, num_layers, size)
            elif num_layers % size:
                raise ValueError(
                    f"num_layers={num_layers} must be divisible by the size {size} of "
                    f"layer_axis={layer_axis!r} (or give the layers per stage: stage_layers, "
                    "e.g. from sf.parallel.balance_stages)"
                )
        elif stage_layers is not None:
            raise ValueError(
                f"stage_layers={stage_layers!r} needs a layer_axis (the pipeline axis the "
                "stages are on)"
            )
        if stage_layers is not None and prefetch:
            raise ValueError("prefetch=True needs stage_layers=None (the layers of one device)")
        # Stage s's layers sit in rows [s R, s R + stage_layers[s]) of the stacked
        # parameters, R the most layers of a stage; the rows after them are zero padding.
        self.stage_layers = stage_layers
        rows = _layer_rows(num_layers, stage_layers)
        self.options = options
        self.num_layers, self.layer_axis, self.remat, self.mesh = (
            num_layers,
            layer_axis,
            remat,
            mesh,
        )
        abstract = nnx.eval_shape(lambda: make_block(nnx.Rngs(0)))
        # Blocks holding a ParallelMoE write their `MoEStats` on every call: the layer
        # scan returns each layer's as a scan output, written to the stacked variables.
        self.has_moe = any(isinstance(node, ParallelMoE) for _, node in nnx.iter_graph(abstract))
        if self.has_moe and prefetch:
            # The prefetching scan is one custom_vjp over the L layers whose only output is
            # the activations: the experts' statistics (the aux losses, differentiated)
            # cannot leave it. The MoE layer gathers its own ZeRO-3 weights per layer.
            raise ValueError(
                "prefetch=True with blocks holding a ParallelMoE: the prefetching layer scan "
                "(shardfuse.layers.prefetch) carries only the activations, not the experts' "
                "aux-loss statistics; use prefetch=False (ZeRO-3 still gathers each layer's "
                "weights, without the overlap)"
            )
        graphdef, abstract_state = nnx.split(abstract)
        specs = jax.tree.map(
            lambda v: stacked_spec(v.get_metadata().get("out_sharding"), layer_axis),
            abstract_state,
            is_leaf=_sharding.is_variable,
        )
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)

        def make_one(key):
            # Under the vmap the block's parameters are already on their (batched) shardings:
            # an eager reshard to the unbatched spec would gather the layer axis.
            with nnx.use_eager_sharding(False):
                return nnx.state(make_block(nnx.Rngs(key)))

        # spmd_axis_name: each layer_axis rank creates only its own layers (their shards)
        keys = jax.random.split(rngs.params(), num_layers)
        make_all = jax.vmap(make_one, spmd_axis_name=layer_axis)
        if stage_layers is None:
            values = jax.jit(make_all, out_shardings=shardings)(keys)
        else:  # layer l from key l wherever its row is; padding rows zero
            real = np.asarray(rows) >= 0

            def make_rows(keys):
                made = make_all(keys[np.maximum(np.asarray(rows), 0)])
                keep = lambda a: jnp.where(real.reshape(-1, *(1,) * (a.ndim - 1)), a, 0)  # noqa: E731
                return jax.tree.map(keep, made)

            values = jax.jit(make_rows, out_shardings=shardings)(keys)

        def restack(variable, value, spec):
            metadata = {
                "mesh": mesh,
                **variable.get_metadata(),
                "out_sharding": spec,
                STACKED: True,
            }
            return type(variable)(value[...] if _sharding.is_variable(value) else value, **metadata)

        state = jax.tree.map(restack, abstract_state, values, specs, is_leaf=_sharding.is_variable)
        # The block's structure holding stacked values: `blocks.<path>` is the [L, ...] parameter.
        self.blocks = nnx.merge(graphdef, state)
        self.features = features_of(self.blocks)  # the blocks' width (None: not declared)
        self.prefetch = prefetch
        if prefetch:  # checks before any tracing
            self._prefetch_plan()

    def _prefetch_plan(self):
        return prefetch_lib.make_plan(
            self.blocks, self.mesh, layer_axis=self.layer_axis, remat=self.remat
        )

    def layer_specs(self):
        """PartitionSpecs of the stacked state (`nnx.get_partition_spec` of `blocks`)."""
        return nnx.get_partition_spec(nnx.state(self.blocks))

    def apply_layers(self, state, x, **kwargs):
        """Applies the layers whose stacked (pure) `state` is given, in order, by `lax.scan`.

        `state` is `nnx.split(self.blocks)[1]` or any slice of it along the
        layer axis (a pipeline stage's local layers). With `prefetch=True`
        (all L layers), the prefetching scan of `shardfuse.layers.prefetch`.
        """
        return self.apply_layers_with_stats(state, x, **kwargs)[0]

    def apply_layers_with_stats(self, state, x, **kwargs):
        """`(y, stats)`: `apply_layers` and the layers' `MoEStats`, stacked `[layers, ...]`.

        `stats` is the pure `nnx.State` of the blocks' `MoEStats` variables, one row per
        layer applied (None when the blocks hold no `ParallelMoE`): what each layer's
        experts wrote in the scan, carried out of it as a scan output (a value the
        loss may differentiate: the aux losses' gradients flow back through the scan).
        """
        x = self._as_carry(state, x, kwargs)
        if self.prefetch and x.size:  # (an empty batch: the plain scan, nothing to gather)
            y = prefetch_lib.apply_layers(self._prefetch_plan(), self.mesh, state, x, kwargs)
            return y, None
        graphdef = nnx.graphdef(self.blocks)
        # ZeRO-2 (`fsdp.scatter_gradient`): each layer's weight gradient reduce-scattered
        # in the scan's backward, as soon as it is produced.
        scatters = fsdp_lib.layer_scatters(state)
        if scatters is not None:
            return self._apply_scattering(graphdef, state, x, kwargs, scatters)

        def body(x, layer_state):
            return self._layer(graphdef, layer_state, x, kwargs)

        body = remat_lib.checkpoint(body, self.remat, prevent_cse=False)
        return jax.lax.scan(body, x, state)

    def _layer(self, graphdef, layer_state, x, kwargs):
        """One layer: `(y, its MoEStats state or None)`."""
        block = nnx.merge(graphdef, layer_state)
        y = block(x, **kwargs)
        return y, (nnx.state(block, MoEStats) if self.has_moe else None)

    def _apply_scattering(self, graphdef, state, x, kwargs, scatters):
        """The layer scan over `(replicated value, sink)` pairs: a layer slice of each leaf
        with a `GradientScatter` is tied to its sink's slice inside the body."""
        leaves, treedef = jax.tree.flatten(state)
        fulls = [v if s is None else s.full for v, s in zip(leaves, scatters, strict=True)]
        sinks = [None if s is None else s.sink for s in scatters]

        def body(x, layer):
            values, layer_sinks = layer
            tied = [
                v if s is None else fsdp_lib.scatter_gradient(v, sink, s.axis, s.dim - 1)
                for v, sink, s in zip(values, layer_sinks, scatters, strict=True)
            ]
            return self._layer(graphdef, jax.tree.unflatten(treedef, tied), x, kwargs)

        body = remat_lib.checkpoint(body, self.remat, prevent_cse=False)
        return jax.lax.scan(body, x, (fulls, sinks))

    def _as_carry(self, state, x, kwargs):
        """`x` with the type a layer's output has, which the layer scan's carry must keep.

        Cast to the blocks' output dtype (a block with `dtype=bfloat16` given
        float32 input returns bfloat16: the stack then equals its blocks applied
        in sequence), and on Explicit axes placed on the output's sharding (a
        replicated input would otherwise enter the carry unsharded and leave the
        block split over the data axes). The block's own input checks run here,
        before the scan.
        """
        values = jax.tree.map(
            lambda v: v[...] if _sharding.is_variable(v) else v,
            state,
            is_leaf=_sharding.is_variable,
        )
        out = _layer_output_type(nnx.graphdef(self.blocks), values, x, kwargs)
        if out.shape != x.shape:  # (a block must map activations to the same shape)
            return x  # the scan names both types
        if out.dtype != x.dtype:
            x = x.astype(out.dtype)
        spec = getattr(out.sharding, "spec", None)
        if (
            spec is not None
            and explicit_axes(self.mesh)
            and not _sharding.in_manual_region(self.mesh)
        ):
            have = getattr(jax.typeof(x).sharding, "spec", None)
            if have is None or _sharding.canonical_spec(have) != _sharding.canonical_spec(spec):
                x = _sharding.place(x, self.mesh, spec)
        return x

    def __call__(self, x, **kwargs):
        """`x` -> the L blocks applied in order (keywords passed to every block).

        A stack sharded over `layer_axis` is gathered onto every device first
        (the plain path; `sf.parallel.pipeline.Pipeline` runs it sharded). `x`
        is first cast to the dtype a block returns (float32 activations into
        `dtype=bfloat16` blocks: a bfloat16 result, as from the blocks in
        sequence) and, on Explicit axes, placed on the sharding it returns.
        """
        state = nnx.state(self.blocks)
        if self.layer_axis is not None and not _sharding.in_manual_region(self.mesh):
            specs = self.layer_specs()
            state = jax.tree.map(
                lambda v, spec: _sharding.place(v[...], self.mesh, P(None, *spec[1:])),
                state,
                specs,
                is_leaf=_sharding.is_variable,
            )
        real = None
        if self.stage_layers is not None:  # the real layers' rows, in order
            real = np.flatnonzero(np.asarray(self.layer_rows()) >= 0)
            state = jax.tree.map(
                lambda v: (v[...] if _sharding.is_variable(v) else v)[real],
                state,
                is_leaf=_sharding.is_variable,
            )
        y, stats = self.apply_layers_with_stats(state, x, **kwargs)
        if stats is not None:
            self._write_stats(stats, real)
        return y

    def _write_stats(self, stats, real=None):
        """Writes the layers' `MoEStats` rows (`stats`, `[layers, ...]`) to the stacked
        variables (`real` not None: the L real layers' rows of uneven stages, each row
        gathered from its layer's, padding rows zero, on the stored sharding)."""
        self.write_stats(nnx.to_pure_dict(stats), real)

    def write_stats(self, values, real=None):
        """Writes `MoEStats` values (a pure dict or `nnx.State` of the blocks' statistics,
        rows as the stacked variables', e.g. `Pipeline.loss(return_stats=True)`'s); with
        `real`, `_write_stats`' rows of the real layers."""
        if isinstance(values, nnx.State):
            values = nnx.to_pure_dict(values)
        if real is not None:
            rows = np.asarray(self.layer_rows())
            stored = nnx.to_pure_dict(nnx.state(self.blocks, MoEStats))

            def to_rows(old, new):
                full = new[np.maximum(rows, 0)]
                mask = (rows >= 0).reshape(-1, *(1,) * (full.ndim - 1))
                full = jnp.where(mask, full, jnp.zeros_like(full))
                spec = getattr(jax.typeof(old).sharding, "spec", None)
                return full if spec is None else _sharding.place(full, self.mesh, spec)

            values = jax.tree.map(to_rows, stored, values)
        variables = nnx.state(self.blocks, MoEStats)
        nnx.replace_by_pure_dict(variables, values)
        nnx.update(self.blocks, variables)

    def layer_rows(self) -> list:
        """The layer each row of the stacked parameters holds, -1 for a padding row.

        Rows are layers in order unless `stage_layers` pads the lighter stages
        (`sf.parallel.Checkpointer` saves the layers in order through this, so a
        checkpoint restores onto any stage layout).

        Example:
          >>> import jax
          >>> from flax import nnx
          >>> from shardfuse.layers import Stack
          >>> mesh = jax.make_mesh((2,), ("pipeline",))
          >>> stack = Stack(lambda rngs: nnx.Linear(4, 4, rngs=rngs), 3, mesh=mesh,
          ...               layer_axis="pipeline", stage_layers=(2, 1), rngs=nnx.Rngs(0))
          >>> stack.layer_rows()
          [0, 1, 2, -1]
        """
        return _layer_rows(self.num_layers, self.stage_layers)

    def apply_stage_layers(self, state, x, **kwargs):
        """Per shard, in a pipeline stage: its rows of the stacked `state` applied in order.

        With `stage_layers`, this device's stage `s` (its index along
        `layer_axis`) runs its `stage_layers[s]` layers and skips its padding
        rows (a `lax.cond` per row; every device of a stage takes the same
        branch). Where a branch may not hold collectives
        (`branches_may_hold_collectives`: XLA:CPU with other mesh axes), the
        padding rows are computed and discarded instead. Without, `apply_layers`.
        """
        return self.apply_stage_layers_with_stats(state, x, **kwargs)[0]

    def apply_stage_layers_with_stats(self, state, x, **kwargs):
        """`(y, stats)`: `apply_stage_layers` and its layers' `MoEStats` rows (as
        `apply_layers_with_stats`; a skipped padding row's are zero), None without MoE."""
        if self.stage_layers is None:
            return self.apply_layers_with_stats(state, x, **kwargs)
        x = self._as_carry(state, x, kwargs)
        graphdef = nnx.graphdef(self.blocks)
        counts = jnp.asarray(self.stage_layers, jnp.int32)
        count = counts[jax.lax.axis_index(self.layer_axis)]
        rows = jax.tree.leaves(state)[0].shape[0]
        branch = branches_may_hold_collectives(self.layer_axis)

        def body(x, layer):
            index, layer_state = layer

            def run(x):
                y, stats = self._layer(graphdef, layer_state, x, kwargs)
                return to_varying(y, varying_axes(x)), stats

            def skip(x):  # a padding row: the input, and zero statistics
                stats = jax.eval_shape(run, x)[1]
                return x, jax.tree.map(_typed_zeros, stats)

            if branch:
                return jax.lax.cond(index < count, run, skip, x)
            y, stats = run(x)
            keep = index < count
            return jnp.where(keep, y, x), jax.tree.map(
                lambda s: jnp.where(keep, s, jnp.zeros_like(s)), stats
            )

        body = remat_lib.checkpoint(body, self.remat, prevent_cse=False)
        return jax.lax.scan(body, x, (jnp.arange(rows), state))
