"""Public per-shard collective matmuls and the dispatch over implementations.

Each function validates its inputs and the surrounding mesh once, before
anything is traced, builds the static `RingPlan`, then calls the requested
implementation or, with `implementation=None`, the best for the platform
(TPU: pallas_tpu, else xla); a backend that raises `NotImplementedError`
hands over to the next one. Call them inside `jax.shard_map`.
"""

import importlib
import math

import jax
import jax.numpy as jnp

from shardfuse.collectives.collective_matmul import base
from shardfuse.kernels import dispatch
from shardfuse.kernels.matmul import base as matmul_base

_MODULES = {
    "reference": "shardfuse.collectives.collective_matmul.reference",
    "xla": "shardfuse.collectives.collective_matmul.xla",
    "pallas_tpu": "shardfuse.collectives.collective_matmul.pallas_tpu",
}
PREFERENCE = {"tpu": ("pallas_tpu", "xla")}


def _load(name: str, function: str):
    try:
        module = importlib.import_module(_MODULES[name])
    except ModuleNotFoundError as e:
        if e.name == _MODULES[name]:
            raise NotImplementedError(
                f"{function}: implementation {name!r} is not part of this version of shardfuse"
            ) from e
        raise NotImplementedError(f"{function}: implementation {name!r} needs {e.name!r}") from e
    return getattr(module, function)


def _dispatch(function: str, implementation, args):
    base.check_implementation(implementation, function=function)
    if implementation is None:
        names = PREFERENCE.get(jax.default_backend(), ("xla",))
    else:
        names = (implementation,)
    return dispatch.run(
        function, names, implementation is not None, lambda name: _load(name, function)(*args)
    )


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
      implementation: None (best for the platform), "reference" (lax.all_gather
        then one matmul), "xla" (ring) or "pallas_tpu" (fused kernel).
      precision: precision of every chunk matmul: None (HIGHEST for float32,
        DEFAULT for 16-bit), a `jax.lax.Precision` or its name (as `jnp.dot`).

    Returns:
      `[..., N*m, ..., F]` in x's dtype: the gathered rows, in device order, times w.

    Raises:
      ValueError: `axis_name` is not a (manual) axis of the surrounding mesh (the
        message lists the axes present), bad ranks/shapes or `gather_axis`.
      TypeError: non-array inputs, unsupported or mismatched dtypes, non-bool flags.
      NotImplementedError: the requested implementation cannot run this input here.

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
    function = "all_gather_matmul"
    base.check_operands(x, w, function=function)
    n = base.mesh_axis_size(axis_name, function=function)
    axis = base.normalize_axis(gather_axis, x.ndim, name="gather_axis", function=function)
    bidirectional = base.check_flag(bidirectional, name="bidirectional", function=function)
    base.check_implementation(implementation, function=function)
    x, w = _as_array(x), _as_array(w)
    precision = matmul_base.check_precision(precision)
    plan = base.make_plan(axis_name, n, axis, x.shape[axis], bidirectional, precision)
    if math.prod(x.shape) == 0 or w.shape[1] == 0:
        implementation = "reference"  # nothing to overlap; the plain collectives handle empties
    return _dispatch(function, implementation, (x, w, plan))


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
    `acc = sf.matmul(x_chunk, w, c=received, out_dtype=float32)`. The gradient
    is an all-gather-matmul (dx) plus a per-step dw accumulation.

    Args:
      x: `[..., M, ..., C]`, float32, bfloat16 or float16, with
        `M = x.shape[scatter_axis]` divisible by the ring size N.
      w: `[C, F]`, same dtype (typically this device's row shard).
      axis_name: the mesh axis to reduce over, manual in the surrounding shard_map.
      scatter_axis: the axis of x (and of the result) to scatter, any but the last.
      bidirectional: two half-chunk partial sums travel in opposite directions.
      implementation: None, "reference" (matmul then lax.psum_scatter), "xla"
        or "pallas_tpu".
      precision: precision of every chunk matmul: None (HIGHEST for float32,
        DEFAULT for 16-bit), a `jax.lax.Precision` or its name (as `jnp.dot`).

    Returns:
      `[..., M/N, ..., F]` in x's dtype: this device's chunk of the sum.

    Raises:
      ValueError: `axis_name` is not a (manual) mesh axis here (the message lists
        the axes present), M is not divisible by N, bad ranks/shapes/axis.
      TypeError: non-array inputs, unsupported or mismatched dtypes, non-bool flags.
      NotImplementedError: the requested implementation cannot run this input here.

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
      >>> x = jnp.ones((8, 16)); w = jnp.ones((16, 4))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x, w: sf.collectives.matmul_reduce_scatter(x, w, "model"),
      ...     mesh=mesh, in_specs=(P(None, "model"), P("model")), out_specs=P("model")))
      >>> f(x, w)[0]
      Array([16., 16., 16., 16.], dtype=float32)
    """
    function = "matmul_reduce_scatter"
    base.check_operands(x, w, function=function)
    n = base.mesh_axis_size(axis_name, function=function)
    axis = base.normalize_axis(scatter_axis, x.ndim, name="scatter_axis", function=function)
    bidirectional = base.check_flag(bidirectional, name="bidirectional", function=function)
    base.check_implementation(implementation, function=function)
    if x.shape[axis] % n:
        raise ValueError(
            f"{function}: x.shape[{scatter_axis}]={x.shape[axis]} (x shape {tuple(x.shape)}) "
            f"is not divisible by the size {n} of mesh axis {axis_name!r}"
        )
    x, w = _as_array(x), _as_array(w)
    precision = matmul_base.check_precision(precision)
    plan = base.make_plan(axis_name, n, axis, x.shape[axis] // n, bidirectional, precision)
    if math.prod(x.shape) == 0 or w.shape[1] == 0:
        implementation = "reference"
    return _dispatch(function, implementation, (x, w, plan))


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
      implementation: None, "reference" (matmul then lax.psum) or "xla".
      precision: precision of every chunk matmul: None (HIGHEST for float32,
        DEFAULT for 16-bit), a `jax.lax.Precision` or its name (as `jnp.dot`).

    Returns:
      `[..., M, F]` in x's dtype, the same on every device of the axis.

    Raises:
      ValueError: `axis_name` is not a (manual) mesh axis here (the message lists
        the axes present), bad ranks or shapes.
      TypeError: non-array inputs, unsupported or mismatched dtypes.
      NotImplementedError: the requested implementation cannot run this input here.

    Example:
      >>> import jax, jax.numpy as jnp, shardfuse as sf
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("model",))
      >>> x = jnp.ones((8, 16)); w = jnp.ones((16, 4))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x, w: sf.collectives.matmul_all_reduce(x, w, "model"),
      ...     mesh=mesh, in_specs=(P(None, "model"), P("model")), out_specs=P()))
      >>> f(x, w).shape
      (8, 4)
    """
    function = "matmul_all_reduce"
    base.check_operands(x, w, function=function)
    n = base.mesh_axis_size(axis_name, function=function)
    base.check_implementation(implementation, function=function)
    x, w = _as_array(x), _as_array(w)
    axis = next((a for a in range(x.ndim - 1) if x.shape[a] >= n and x.shape[a] % n == 0), None)
    precision = matmul_base.check_precision(precision)
    plan = None
    if axis is not None and n > 1:
        plan = base.make_plan(
            axis_name, n, axis, x.shape[axis] // n, bidirectional=True, precision=precision
        )
    if math.prod(x.shape) == 0 or w.shape[1] == 0:
        implementation = "reference"
    return _dispatch(function, implementation, (x, w, plan, axis_name, precision))
