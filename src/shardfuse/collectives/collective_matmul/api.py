"""Public per-shard collective matmuls; their implementations are declared in the registry.

Each function validates its inputs and the surrounding mesh once, before
anything is traced, builds the static `RingPlan`, then calls the requested
implementation (`implementation=` a name, a sequence of names tried in order,
or None for the platform's preference: TPU pallas_tpu, else xla; see
`kernels/registry.py`): a backend that raises `NotImplementedError` hands
over to the next one. Call them inside `jax.shard_map`.
"""

import math

import jax
import jax.numpy as jnp

from shardfuse.collectives.collective_matmul import base
from shardfuse.kernels import registry
from shardfuse.kernels.matmul import base as matmul_base

_MODULE = "shardfuse.collectives.collective_matmul."


def _no_fused_kernel(platform: str) -> registry.Status:
    return False, "no fused kernel: raises NotImplementedError, so the xla ring runs"


_STATUS = {"pallas_tpu": registry.pallas_tpu_status}


def _register(function: str, description: str, backends: dict, preference, status=None) -> None:
    """Declares collective matmul `function`; `backends` maps name -> description, and each
    backend's function is `function` of module `<name>.py`."""
    status = {**_STATUS, **(status or {})}
    registry.register(
        function,
        description=description,
        backends=[
            registry.Backend(
                name, _MODULE + name, function, text, status.get(name, registry.runs_anywhere)
            )
            for name, text in backends.items()
        ],
        preference=preference,
    )


_register(
    "all_gather_matmul",
    "all_gather(x) @ w over a mesh axis, the transfers hidden behind the chunk matmuls",
    {
        "reference": "the oracle: lax.all_gather, then one matmul (no overlap)",
        "xla": "ppermute ring: each chunk's matmul overlaps the next chunk's transfer",
        "pallas_tpu": "fused Pallas TPU kernel: remote DMAs double-buffered under the matmuls",
    },
    {"tpu": ("pallas_tpu", "xla")},
)
_register(
    "matmul_reduce_scatter",
    "psum_scatter(x @ w) over a mesh axis, float32 partial sums travelling under the matmuls",
    {
        "reference": "the oracle: one matmul, then lax.psum_scatter in float32 (no overlap)",
        "xla": "ppermute ring: the partial sum travels while the next chunk multiplies",
        "pallas_tpu": "fused Pallas TPU kernel: remote DMAs double-buffered under the matmuls",
    },
    {"tpu": ("pallas_tpu", "xla")},
)
_register(
    "matmul_all_reduce",
    "psum(x @ w) over a mesh axis, the reduce-scatter half overlapped with the matmul",
    {
        "reference": "the oracle: one matmul, then lax.psum in float32 (no overlap)",
        "xla": "ring all-reduce: bidirectional matmul-reduce-scatter ring, then an all-gather",
        "pallas_tpu": "none yet: refuses every input",
    },
    {"tpu": ("xla",)},
    status={"pallas_tpu": _no_fused_kernel},
)


def _dispatch(function: str, implementation, x, w, *args):
    """Runs `function(x, w, *args)` by `implementation`; empty operands take the reference."""
    if math.prod(x.shape) == 0 or w.shape[1] == 0:
        implementation = "reference"  # nothing to overlap; the plain collectives handle empties
    op = registry.get(function)
    return op.run(implementation, lambda name: op.load(name)(x, w, *args))


def _ring_matmul(
    function, x, w, axis_name, *, axis_arg, axis, bidirectional, implementation, precision
):
    """Validation, `RingPlan` and dispatch of the two ring functions, in one order.

    `axis_arg` names the row axis argument ("gather_axis" or "scatter_axis"):
    a scatter also needs that axis of x divisible by the ring size N, and its
    ring chunks are `x.shape[axis] // N` rows, a gather's the whole shard.
    """
    base.check_operands(x, w, function=function)
    n = base.mesh_axis_size(axis_name, function=function)
    row_axis = base.normalize_axis(axis, x.ndim, name=axis_arg, function=function)
    bidirectional = base.check_flag(bidirectional, name="bidirectional", function=function)
    registry.candidates(function, implementation)  # an unknown name fails before tracing
    scatter = axis_arg == "scatter_axis"
    if scatter and x.shape[row_axis] % n:
        raise ValueError(
            f"{function}: x.shape[{axis}]={x.shape[row_axis]} (x shape {tuple(x.shape)}) "
            f"is not divisible by the size {n} of mesh axis {axis_name!r}"
        )
    x, w = _as_array(x), _as_array(w)
    precision = matmul_base.check_precision(precision)
    chunk = x.shape[row_axis] // n if scatter else x.shape[row_axis]
    plan = base.make_plan(axis_name, n, row_axis, chunk, bidirectional, precision)
    return _dispatch(function, implementation, x, w, plan)


def _as_array(x):
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def all_gather_matmul(
    x,
    w,
    axis_name: str,
    *,
    gather_axis: int = 0,
    bidirectional: bool = False,
    implementation=None,
    precision=None,
):
    """All-gather x over a mesh axis and multiply by w, the transfers hidden behind the matmuls.

        y = lax.all_gather(x, axis_name, axis=gather_axis, tiled=True) @ w

    The column-parallel layer's input side (with sequence parallelism, x is
    sharded on the sequence axis and `gather_axis` is that axis). The xla
    implementation is a ring of N - 1 ppermutes: each step multiplies the chunk
    received in the previous step while forwarding it; `bidirectional=True`
    sends half of each chunk each way. The gradient is a matmul-reduce-scatter
    (dx) and a per-step accumulation (dw), overlapped the same way.

    Args:
      x: this device's shard `[..., m, ..., C]`, float32, bfloat16 or float16;
        any leading batch dims.
      w: `[C, F]`, same dtype (typically this device's column shard).
      axis_name: the mesh axis to gather over, manual in the surrounding shard_map.
      gather_axis: the axis of x to gather, any but the last (C). Default 0.
      bidirectional: split each chunk in halves that travel in opposite directions
        (needs m >= 2; otherwise one direction is used).
      implementation: None (the platform's preference: pallas_tpu on TPU, else
        xla), "reference" (lax.all_gather then one matmul), "xla" (ring),
        "pallas_tpu" (fused kernel), or a sequence of them tried in order.
      precision: precision of every chunk matmul: None (HIGHEST for float32,
        DEFAULT for 16-bit), a `jax.lax.Precision` or its name (as `jnp.dot`).

    Returns:
      `[..., N*m, ..., F]` in x's dtype: the gathered rows, in device order, times w.

    Raises:
      ValueError: `axis_name` is not a (manual) axis of the surrounding mesh (the
        message lists the axes present), bad ranks/shapes or `gather_axis`.
      TypeError: non-array inputs, unsupported or mismatched dtypes, non-bool flags.
      NotImplementedError: the named implementation cannot run this input here
        (with None or a sequence: none could, with each reason).

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
      >>> x = jnp.ones((4, 8, 16)); w = jnp.ones((16, 32))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x, w: sf.collectives.all_gather_matmul(x, w, "model", gather_axis=1),
      ...     mesh=mesh, in_specs=(P(None, "model"), P(None, "model")),
      ...     out_specs=P(None, None, "model")))
      >>> f(x, w).shape
      (4, 8, 32)
    """
    return _ring_matmul(
        "all_gather_matmul", x, w, axis_name, axis_arg="gather_axis", axis=gather_axis,
        bidirectional=bidirectional, implementation=implementation, precision=precision,
    )  # fmt: skip


def matmul_reduce_scatter(
    x,
    w,
    axis_name: str,
    *,
    scatter_axis: int = 0,
    bidirectional: bool = False,
    implementation=None,
    precision=None,
):
    """Multiply x by w and reduce-scatter the sum over a mesh axis, overlapped.

        y = lax.psum_scatter(x @ w, axis_name, scatter_dimension=scatter_axis, tiled=True)

    The row-parallel layer's output side (x and w sharded on C; with sequence
    parallelism the result is scattered over the sequence axis). The xla
    implementation is a ring: each step multiplies this device's contribution
    to the next chunk while the float32 partial sum of the previous step
    travels, and adds it in the matmul epilogue,
    `acc = sf.matmul(x_chunk, w, addend=received, out_dtype=float32)`. The gradient
    is an all-gather-matmul (dx) plus a per-step dw accumulation.

    Args:
      x: `[..., M, ..., C]`, float32, bfloat16 or float16, with
        `M = x.shape[scatter_axis]` divisible by the ring size N.
      w: `[C, F]`, same dtype (typically this device's row shard).
      axis_name: the mesh axis to reduce over, manual in the surrounding shard_map.
      scatter_axis: the axis of x (and of the result) to scatter, any but the last.
      bidirectional: two half-chunk partial sums travel in opposite directions.
      implementation: None (the platform's preference: pallas_tpu on TPU, else
        xla), "reference" (matmul then lax.psum_scatter), "xla", "pallas_tpu",
        or a sequence of them tried in order.
      precision: precision of every chunk matmul: None (HIGHEST for float32,
        DEFAULT for 16-bit), a `jax.lax.Precision` or its name (as `jnp.dot`).

    Returns:
      `[..., M/N, ..., F]` in x's dtype: this device's chunk of the sum.

    Raises:
      ValueError: `axis_name` is not a (manual) mesh axis here (the message lists
        the axes present), M is not divisible by N, bad ranks/shapes/axis.
      TypeError: non-array inputs, unsupported or mismatched dtypes, non-bool flags.
      NotImplementedError: the named implementation cannot run this input here
        (with None or a sequence: none could, with each reason).

    Example (4 devices; each holds a C/4 slice of x and w, and ends with 2 of
    the 8 rows of the summed product)::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:4], ("model",))
      >>> x, w = jnp.arange(128.0).reshape(8, 16), jnp.ones((16, 4))
      >>> row_parallel = jax.jit(jax.shard_map(
      ...     lambda x, w: sf.collectives.matmul_reduce_scatter(x, w, "model"),
      ...     mesh=mesh, in_specs=(P(None, "model"), P("model")), out_specs=P("model")))
      >>> bool(jnp.array_equal(row_parallel(x, w), x @ w))
      True
    """
    return _ring_matmul(
        "matmul_reduce_scatter", x, w, axis_name, axis_arg="scatter_axis", axis=scatter_axis,
        bidirectional=bidirectional, implementation=implementation, precision=precision,
    )  # fmt: skip


def matmul_all_reduce(x, w, axis_name: str, *, implementation=None, precision=None):
    """Multiply x by w and sum the result over a mesh axis, the reduce-scatter half overlapped.

        y = lax.psum(x @ w, axis_name)

    The xla implementation is the ring all-reduce: a bidirectional
    matmul-reduce-scatter ring over the first axis of x divisible by N
    (overlapped with the matmul), then an all-gather of the reduced F-column
    result. Without such an axis it is one matmul and a psum. The backward
    needs no communication (`dx = dy @ w^T`, `dw = x^T dy`).

    Args:
      x: `[..., M, C]`, float32, bfloat16 or float16 (C typically sharded).
      w: `[C, F]`, same dtype.
      axis_name: the mesh axis to sum over, manual in the surrounding shard_map.
      implementation: None (xla), "reference" (matmul then lax.psum), "xla",
        "pallas_tpu" (no fused kernel yet: NotImplementedError), or a sequence
        of them tried in order.
      precision: precision of every chunk matmul: None (HIGHEST for float32,
        DEFAULT for 16-bit), a `jax.lax.Precision` or its name (as `jnp.dot`).

    Returns:
      `[..., M, F]` in x's dtype, the same on every device of the axis.

    Raises:
      ValueError: `axis_name` is not a (manual) mesh axis here (the message lists
        the axes present), bad ranks or shapes.
      TypeError: non-array inputs, unsupported or mismatched dtypes.
      NotImplementedError: the named implementation cannot run this input here
        (with None or a sequence: none could, with each reason).

    Example (2 devices; both end with the whole sum)::

      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> pair = jax.sharding.Mesh(jax.devices()[:2], ("tp",))
      >>> a, b = jnp.arange(24.0).reshape(6, 4), jnp.full((4, 3), 2.0)
      >>> summed = jax.jit(jax.shard_map(lambda a, b: sf.collectives.matmul_all_reduce(a, b, "tp"),
      ...     mesh=pair, in_specs=(P(None, "tp"), P("tp")), out_specs=P()))(a, b)
      >>> summed.shape, bool(jnp.array_equal(summed, a @ b))
      ((6, 3), True)
    """
    function = "matmul_all_reduce"
    base.check_operands(x, w, function=function)
    n = base.mesh_axis_size(axis_name, function=function)
    registry.candidates(function, implementation)  # an unknown name fails before tracing
    x, w = _as_array(x), _as_array(w)
    axis = next((a for a in range(x.ndim - 1) if x.shape[a] >= n and x.shape[a] % n == 0), None)
    precision = matmul_base.check_precision(precision)
    plan = None
    if axis is not None and n > 1:
        plan = base.make_plan(
            axis_name, n, axis, x.shape[axis] // n, bidirectional=True, precision=precision
        )
    return _dispatch(function, implementation, x, w, plan, axis_name, precision)
