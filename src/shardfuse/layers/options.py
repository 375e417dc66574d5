"""`LayerOptions`: the one options object of the parallel layers, and how keywords override it.

Every layer of `shardfuse.layers` takes `options: LayerOptions | None` and
hands it (possibly `.replace`d) to the layers it builds: a block passes its
options to its attention, MLP and norms, the MLP to its two linear layers.
Nothing is forwarded keyword by keyword.

A layer also takes each field of `LayerOptions` as a keyword, the drop-in
form a user of one layer expects
(`ColumnParallelLinear(16, 32, mesh=mesh, model_axis="tp", zero=3)`). A
keyword that is given overrides the matching field of `options`; one that is
not given leaves it alone (not given differs from None: `model_axis=None`
means "no tensor parallelism"). `resolve(options, **keywords)` is the rule,
`option_keywords` the decorator that applies it to a layer's `__init__`
(`shardfuse._keywords`, where every keyword-forwarding decorator lives).
Layer-specific arguments (sizes, `heads`, `gather_output`, `use_bias`,
initializers, `causal`, `window`, ...) are ordinary keywords.

Fields (defaults in parentheses); anything else raises a `ValueError` or
`TypeError` naming the field and what is valid:

- `mesh` (None): the `jax.sharding.Mesh`; a layer needs one, here or as `mesh=`.
- `model_axis` ("model"), `data_axis` ("data"), `sequence_axis` ("sequence"),
  `fsdp_axis` ("fsdp"), `expert_axis` ("expert"): mesh axis names or None, for
  tensor parallelism (heads, hidden units), the batch, context parallelism (ring
  attention), ZeRO (the batch is split over the fsdp axis too) and expert
  parallelism (`ParallelMoE`'s experts; every layer splits the batch over it too);
  no two may name the same axis.
- `zero` (0): the ZeRO stage, 0 to 3 (`shardfuse.layers.fsdp`).
- `reshard_after_forward` (True): ZeRO-3 drops gathered weights after use and
  gathers them again in the backward.
- `reduce_dtype` (float32): dtype of the ZeRO-3 gradient reduction; a floating
  dtype, or None: the compute dtype.
- `remat` ("none"): activation checkpointing of a block or of each layer of a
  `Stack`, a policy of `shardfuse.layers.remat` (`shardfuse.flops.REMAT_POLICIES`).
- `prefetch` (False): a `Stack` of ZeRO-3 blocks gathers layer l + 1's weights
  while layer l computes (`shardfuse.layers.prefetch`); other layers ignore it.
- `dtype` (None): compute dtype, floating, or None: the inputs' dtype.
- `param_dtype` (float32): storage dtype of the parameters, floating.
- `precision` (None): of the matmuls; None (HIGHEST for float32, DEFAULT for
  16-bit), a `jax.lax.Precision` or "default", "high", "highest".
- `sequence_parallel` (None): Megatron sequence parallelism, a bool, or None:
  each layer's default (False for the linear layers, the MLP and attention,
  drop-ins for `nnx.Linear`; True for a transformer block, whose activations
  stay sharded from block to block).
- `implementation` (None): the matmul and collective-matmul implementation, a
  name (`shardfuse.kernels.registry`), a sequence of names tried in order, or
  None (the best available).
- `attention_implementation` (None): the attention kernel's, likewise; None:
  the same as `implementation`.

The axis defaults are those of `shardfuse.axes`; a default axis name the
mesh lacks means "not sharded" there, while an explicitly chosen name must
be an axis of the mesh (checked when a layer is built on it).
"""

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from shardfuse import _keywords, axes
from shardfuse._keywords import UNSET
from shardfuse.flops import check_remat
from shardfuse.kernels import registry
from shardfuse.kernels.matmul import base as matmul_base
from shardfuse.layers import _sharding, fsdp

_AXIS_FIELDS = ("model_axis", "data_axis", "sequence_axis", "fsdp_axis", "expert_axis")


def _floating_dtype(value, field: str, *, optional: bool):
    if value is None and optional:
        return None
    try:
        dtype = None if value is None else jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        valid = "a floating dtype (float32, bfloat16, float16)" + (" or None" if optional else "")
        raise ValueError(f"{field}={value!r} must be {valid}")
    return dtype


def _implementation(value, field: str, ops: tuple[str, ...]):
    if value is None:
        return None
    names = sorted({name for op in ops for name in registry.get(op).names})
    given = (value,) if isinstance(value, str) else value
    try:
        given = tuple(given)
    except TypeError:
        given = None
    if not given or any(not isinstance(n, str) or n not in names for n in given):
        raise ValueError(
            f"{field}={value!r} must be None (the best available), one of {names}, or a "
            "sequence of them (tried in order)"
        )
    return value if isinstance(value, str) else given


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """The options every parallel layer shares: mesh axes, ZeRO, remat, dtypes, implementations.

    Frozen and hashable (a layer's compiled program is keyed by it). Build one
    for a whole model and pass it to every layer (`options=`); a layer's own
    keywords override single fields, and `.replace(**changes)` makes a
    modified copy, validated like the original. The module docstring of
    `shardfuse.layers.options` lists the fields, defaults and valid values.

    Raises:
      ValueError: a field outside its valid values (the message names the field
        and what is valid), or two axis fields naming the same mesh axis.
      TypeError: `mesh` that is not a mesh, or a non-bool flag.

    Example usage::

      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"))
      >>> options = sf.layers.LayerOptions(mesh=mesh, zero=3, dtype=jnp.bfloat16)
      >>> block = sf.layers.ParallelTransformerBlock(32, 4, 64, options=options, rngs=nnx.Rngs(0))
      >>> block.mlp.up.kernel[...].sharding.spec  # the block's children got the options
      P('fsdp', 'model')
      >>> up = sf.layers.ColumnParallelLinear(32, 64, options=options, zero=0, rngs=nnx.Rngs(0))
      >>> up.kernel[...].sharding.spec  # a keyword overrides one field
      P(None, 'model')
      >>> options.replace(zero=4)
      Traceback (most recent call last):
      ...
      ValueError: zero=4 must be one of (0, 1, 2, 3) (the ZeRO stage)
    """

    mesh: object = None
    model_axis: str | None = axes.MODEL
    data_axis: str | None = axes.DATA
    sequence_axis: str | None = axes.SEQUENCE
    fsdp_axis: str | None = axes.FSDP
    expert_axis: str | None = axes.EXPERT
    zero: int = 0
    reshard_after_forward: bool = True
    reduce_dtype: object = jnp.dtype(jnp.float32)
    remat: str = "none"
    prefetch: bool = False
    dtype: object = None
    param_dtype: object = jnp.dtype(jnp.float32)
    precision: lax.Precision | None = None
    sequence_parallel: bool | None = None
    implementation: str | tuple | None = None
    attention_implementation: str | tuple | None = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        if self.mesh is not None and not hasattr(self.mesh, "axis_names"):
            raise TypeError(
                f"mesh={self.mesh!r} must be a jax.sharding.Mesh (jax.make_mesh) or None"
            )
        named = {}
        for field in _AXIS_FIELDS:
            name = getattr(self, field)
            if name is not None and (not isinstance(name, str) or not name):
                raise ValueError(f"{field}={name!r} must be a mesh axis name (a str) or None")
            if name is not None and name in named:
                raise ValueError(
                    f"{named[name]}={name!r} and {field}={name!r} name the same mesh axis; "
                    "each axis may shard one dimension only"
                )
            named.setdefault(name, field)
        set_("zero", fsdp.check_zero(self.zero))
        for field in ("reshard_after_forward",):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"{field}={getattr(self, field)!r} must be True or False")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"prefetch={self.prefetch!r} must be True or False")
        if self.sequence_parallel is not None and not isinstance(self.sequence_parallel, bool):
            raise TypeError(
                f"sequence_parallel={self.sequence_parallel!r} must be True, False or None "
                "(the layer's default)"
            )
        set_("reduce_dtype", _floating_dtype(self.reduce_dtype, "reduce_dtype", optional=True))
        set_("dtype", _floating_dtype(self.dtype, "dtype", optional=True))
        set_("param_dtype", _floating_dtype(self.param_dtype, "param_dtype", optional=False))
        set_("remat", check_remat(self.remat))
        set_("precision", matmul_base.check_precision(self.precision))
        set_(
            "implementation",
            _implementation(
                self.implementation,
                "implementation",
                ("matmul", "all_gather_matmul", "matmul_reduce_scatter"),
            ),
        )
        set_(
            "attention_implementation",
            _implementation(
                self.attention_implementation,
                "attention_implementation",
                ("attention", "ring_attention"),
            ),
        )

    def replace(self, **changes) -> "LayerOptions":
        """A copy with `changes` applied, validated like a new `LayerOptions`.

        Raises:
          TypeError: a name that is not a field (the message lists the fields).
          ValueError: an invalid value (see the class).

        Example usage::

          >>> from shardfuse.layers import LayerOptions
          >>> LayerOptions(zero=3).replace(fsdp_axis="dp").fsdp_axis
          'dp'
        """
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(
                f"LayerOptions has no field {', '.join(unknown)}; its fields are {list(FIELDS)}"
            )
        return dataclasses.replace(self, **changes)

    def attention_kernel_implementation(self):
        """The attention kernel's: `attention_implementation`, else `implementation`."""
        if self.attention_implementation is not None:
            return self.attention_implementation
        return self.implementation

    def mesh_axes(self) -> dict:
        """The axis fields as the layers use them on `mesh`, checked.

        A default name the mesh lacks becomes None (not sharded there); an
        explicitly chosen name must be an axis of the mesh. The batch of every
        layer is split over `(data_axis, fsdp_axis, expert_axis)`, those not None.

        Returns:
          `{"model_axis", "data_axis", "sequence_axis", "fsdp_axis", "expert_axis"}` -> a
          name or None.

        Raises:
          TypeError: no mesh.
          ValueError: an explicit name that is not in the mesh.

        Example usage::

          >>> import jax
          >>> from shardfuse.layers import LayerOptions
          >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
          >>> LayerOptions(mesh=mesh).mesh_axes()  # doctest: +NORMALIZE_WHITESPACE
          {'model_axis': 'model', 'data_axis': 'data', 'sequence_axis': None, 'fsdp_axis': None,
           'expert_axis': None}
        """
        mesh = require_mesh(self, "LayerOptions.mesh_axes")
        model, data, sequence = _sharding.layer_axes(
            mesh, model_axis=self.model_axis, data_axis=self.data_axis,
            sequence_axis=self.sequence_axis,
        )  # fmt: skip
        fsdp_axis = self.zero_options().fsdp_axis
        expert = _sharding.optional_axis(mesh, self.expert_axis, "expert_axis", axes.EXPERT)
        return dict(model_axis=model, data_axis=data, sequence_axis=sequence, fsdp_axis=fsdp_axis,
                    expert_axis=expert)  # fmt: skip

    def zero_options(self) -> "fsdp.ZeroOptions":
        """The ZeRO settings on `mesh` (`fsdp.ZeroOptions`; its `param_axis`: the axis
        parameters are sharded over, the fsdp axis under zero=3 where the mesh has it).

        Example usage::

          >>> import jax
          >>> from shardfuse.layers import LayerOptions
          >>> mesh = jax.make_mesh((2, 4), ("fsdp", "model"))
          >>> LayerOptions(mesh=mesh, zero=3).zero_options().param_axis
          'fsdp'
        """
        return fsdp.zero_options(
            require_mesh(self, "LayerOptions.zero_options"),
            zero=self.zero,
            fsdp_axis=self.fsdp_axis,
            reshard_after_forward=self.reshard_after_forward,
            reduce_dtype=self.reduce_dtype,
        )


FIELDS = tuple(field.name for field in dataclasses.fields(LayerOptions))


def resolve(options: LayerOptions | None = None, **keywords) -> LayerOptions:
    """`options` (None: the defaults) with every keyword that was given overriding its field.

    The one rule by which a layer combines `options=` with its own option
    keywords: a keyword whose value is `UNSET` (not given) is ignored; any
    other value, None included, replaces the field of that name.

    Raises:
      TypeError: `options` is not a `LayerOptions`, or a keyword is not one of
        its fields.
      ValueError: an invalid value (see `LayerOptions`).

    Example usage::

      >>> from shardfuse.layers import options as options_lib
      >>> base = options_lib.LayerOptions(zero=3)
      >>> resolved = options_lib.resolve(base, zero=options_lib.UNSET, model_axis=None)
      >>> resolved.zero, resolved.model_axis
      (3, None)
    """
    if options is None:
        options = LayerOptions()
    elif not isinstance(options, LayerOptions):
        raise TypeError(f"options={options!r} must be a shardfuse.layers.LayerOptions or None")
    given = {name: value for name, value in keywords.items() if value is not UNSET}
    return options.replace(**given) if given else options


# Decorator of a layer's `__init__(self, ..., options, ...)`: every `LayerOptions` field is
# also a keyword, overriding that field of `options=` (`resolve`); the `__init__` receives
# the resolved options (`shardfuse._keywords.option_keywords`, the one mechanism).
option_keywords = _keywords.option_keywords(FIELDS, resolve)


def require_mesh(options: LayerOptions, layer: str):
    """`options.mesh`; TypeError naming `layer` when there is none."""
    if options.mesh is None:
        raise TypeError(f"{layer}() needs a mesh: pass mesh=... or options=LayerOptions(mesh=...)")
    return options.mesh


def configure(layer, options: LayerOptions, *, sequence_parallel: bool = False) -> LayerOptions:
    """Sets on `layer` what every parallel layer reads from its options; returns the options.

    `layer.options` (with `sequence_parallel` decided: the layer's default
    `sequence_parallel` where the options leave it None), `mesh`, the checked
    axes `model_axis`, `data_axis`, `sequence_axis`, `expert_axis` (None where
    the mesh lacks a default axis), `zero` (the `fsdp.ZeroOptions` on this mesh),
    `batch_axes` (data, fsdp and expert), `sequence_parallel`, `dtype`, `param_dtype`,
    `implementation` and `precision`.

    Raises:
      TypeError: no mesh.
      ValueError: an axis that is not in the mesh, or two options naming one axis.
    """
    mesh = require_mesh(options, type(layer).__name__)
    options = with_default_sequence_parallel(options, sequence_parallel)
    layer.options = options
    layer.mesh = mesh
    axes = options.mesh_axes()
    layer.model_axis, layer.data_axis = axes["model_axis"], axes["data_axis"]
    layer.sequence_axis, layer.expert_axis = axes["sequence_axis"], axes["expert_axis"]
    layer.zero = options.zero_options()
    layer.batch_axes = fsdp.check_batch_axes(mesh, layer, layer.zero, layer.expert_axis)
    layer.sequence_parallel = options.sequence_parallel
    layer.dtype, layer.param_dtype = options.dtype, options.param_dtype
    layer.implementation, layer.precision = options.implementation, options.precision
    return options


def with_default_sequence_parallel(options: LayerOptions, default: bool) -> LayerOptions:
    """`options` with `sequence_parallel` set to a layer's `default` where it is None."""
    if options.sequence_parallel is None:
        return options.replace(sequence_parallel=default)
    return options


__all__ = [
    "FIELDS",
    "UNSET",
    "LayerOptions",
    "configure",
    "option_keywords",
    "require_mesh",
    "resolve",
    "with_default_sequence_parallel",
]
