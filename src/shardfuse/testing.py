"""Tolerance helpers shared by shardfuse's tests and usable by its users' tests.

The rules (see TESTING.md of the project):

- float32: atol = rtol = 1e-5 for outputs and lse, 2e-5 for gradients, against
  a reference computed at `Precision.HIGHEST`.
- bfloat16 / float16 (the flash-attention rule): with `ref32` the reference on
  inputs upcast to float32 and `ref_lp` the reference run in the low precision,
  `max|actual - ref32| <= factor * max|ref_lp - ref32| + floor` (factor 2 for
  outputs, 3 for gradients, floor = a few ulps at the output's magnitude) and
  `max|actual - ref32| <= cap` (bf16: 1e-2 outputs, 5e-2 gradients).
- Both sides are checked for finiteness first; `-inf` entries (lse of rows
  without a visible key) must match exactly.

Example:
  >>> import jax.numpy as jnp
  >>> from shardfuse.testing import assert_close
  >>> assert_close(jnp.ones(3), jnp.ones(3) + 1e-7, name="out")
"""

import numpy as np

F32_TOLERANCE = {"output": 1e-5, "grad": 2e-5}
LOW_PRECISION_FACTOR = {"output": 2.0, "grad": 3.0}
ABSOLUTE_CAP = {
    "bfloat16": {"output": 1e-2, "grad": 5e-2},
    "float16": {"output": 2e-3, "grad": 1e-2},
}
_EPS = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}


def _as_f32(x):
    return np.asarray(np.asarray(x, dtype=np.float32), dtype=np.float64)


def _split_infinite(actual, expected, name):
    """Checks finiteness and -inf agreement; returns the mask of finite expected entries."""
    if np.isnan(expected).any():
        raise AssertionError(
            f"{name}: the reference itself has NaN at "
            f"{np.argwhere(np.isnan(expected))[:5].tolist()}"
        )
    if np.isnan(actual).any():
        raise AssertionError(f"{name}: NaN at {np.argwhere(np.isnan(actual))[:5].tolist()}")
    if np.isposinf(expected).any() or np.isposinf(actual).any():
        raise AssertionError(
            f"{name}: +inf in {'reference' if np.isposinf(expected).any() else 'result'}"
        )
    exp_neg, act_neg = np.isneginf(expected), np.isneginf(actual)
    if not np.array_equal(exp_neg, act_neg):
        where = np.argwhere(exp_neg != act_neg)[:5].tolist()
        raise AssertionError(f"{name}: -inf entries differ from the reference, e.g. at {where}")
    return ~exp_neg


def max_abs_error(actual, expected) -> float:
    """max |actual - expected| over entries where the reference is finite (0 if none)."""
    actual, expected = _as_f32(actual), _as_f32(expected)
    finite = np.isfinite(expected) & np.isfinite(actual)
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(actual[finite] - expected[finite])))


def assert_close(actual, expected, *, kind: str = "output", atol=None, rtol=None, name="value"):
    """float32 comparison: `|actual - expected| <= atol + rtol * |expected|` everywhere.

    Args:
      actual, expected: arrays of one shape; `expected` from the reference.
      kind: "output" (1e-5) or "grad" (2e-5) picks the default atol = rtol.
      atol, rtol: override the defaults.
      name: what is compared, for the message.
    """
    if np.shape(actual) != np.shape(expected):
        raise AssertionError(f"{name}: shape {np.shape(actual)} != reference {np.shape(expected)}")
    tol = F32_TOLERANCE[kind]
    atol = tol if atol is None else atol
    rtol = tol if rtol is None else rtol
    actual, expected = _as_f32(actual), _as_f32(expected)
    finite = _split_infinite(actual, expected, name)
    err = np.abs(np.where(finite, actual, 0.0) - np.where(finite, expected, 0.0))
    bound = atol + rtol * np.abs(expected)
    bad = finite & (err > bound)
    if bad.any():
        # The entry furthest beyond its bound (not the largest error, which may be within it).
        worst = np.unravel_index(np.argmax(np.where(finite, err / bound, -1)), err.shape)
        atol_text = f"{atol}" if np.ndim(atol) == 0 else "per entry"
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.size} entries beyond atol={atol_text}, rtol={rtol}; "
            f"furthest beyond: error {err[worst]:.3g} (bound {bound[worst]:.3g}) at "
            f"{tuple(int(i) for i in worst)} (got {actual[worst]:.6g}, expected "
            f"{expected[worst]:.6g})"
        )


def assert_close_low_precision(
    actual,
    ref32,
    ref_lp,
    *,
    kind: str = "output",
    name="value",
    relative_cap: bool = False,
    depth: int = 1,
):
    """The flash-attention rule for bfloat16 / float16 results.

    Args:
      actual: the result under test (low-precision inputs), any float dtype.
      ref32: the reference on the inputs upcast to float32.
      ref_lp: the reference run on the low-precision inputs.
      kind: "output" (factor 2) or "grad" (factor 3).
      name: what is compared, for the message.
      relative_cap: scale the absolute cap by `max(1, max|ref32|)`, for values
        that are not O(1) like attention outputs (layer outputs, gradients of
        parameters).
      depth: the low-precision layers composed (a stack of blocks): each rounds
        its output, so the cap is `depth` times one layer's. The bfloat16
        reference of two stacked SwiGLU MLPs is 1.06% of max|ref32| off (the cap
        of one layer: 1%), of four 1.54%.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} must be a positive integer")
    dtype = np.dtype(getattr(ref_lp, "dtype", np.float32)).name
    if dtype not in ABSOLUTE_CAP:
        dtype = np.dtype(getattr(actual, "dtype", np.float32)).name
    if dtype not in ABSOLUTE_CAP:  # float32 statistics (lse) of a low-precision run
        dtype = "bfloat16"
    actual, ref32, ref_lp = _as_f32(actual), _as_f32(ref32), _as_f32(ref_lp)
    finite = _split_infinite(actual, ref32, name)
    _split_infinite(ref_lp, ref32, f"{name} (low-precision reference)")
    if not finite.any():
        return
    err = float(np.max(np.abs(actual[finite] - ref32[finite])))
    ref_err = float(np.max(np.abs(ref_lp[finite] - ref32[finite])))
    scale = float(np.max(np.abs(ref32[finite])))
    floor = _EPS[dtype] * max(scale, 1e-3)  # about two ulps at the largest magnitude
    bound = LOW_PRECISION_FACTOR[kind] * ref_err + floor
    cap = ABSOLUTE_CAP[dtype][kind] * (max(1.0, scale) if relative_cap else 1.0) * depth
    if err > bound or err > cap:
        raise AssertionError(
            f"{name}: max error {err:.3g} vs float32 reference exceeds "
            f"{LOW_PRECISION_FACTOR[kind]} x {ref_err:.3g} (low-precision reference error) "
            f"+ {floor:.3g} = {bound:.3g}, or the cap {cap} for {dtype} {kind}s"
        )


def compiled_memory(fn, *args, **kwargs) -> dict:
    """Bytes XLA plans for `jax.jit(fn)(*args)`: temp, argument, output, generated code.

    Compiles without running, so it works for shapes too big to execute. On
    XLA:CPU set `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=` before JAX
    starts, or YNNPACK fusions hide temporaries from the analysis.

    Example:
      >>> import jax.numpy as jnp
      >>> compiled_memory(lambda x: jnp.outer(x, x).sum(), jnp.ones(1024))["temp"] >= 0
      True
    """
    import jax

    stats = jax.jit(fn).lower(*args, **kwargs).compile().memory_analysis()
    return {
        "temp": int(stats.temp_size_in_bytes),
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "code": int(stats.generated_code_size_in_bytes),
    }


def iter_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, those of sub-jaxprs (jit, loops, conds,
    custom_vjp, shard_map) included, depth first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> jaxpr = jax.make_jaxpr(lambda x: jax.lax.fori_loop(0, 2, lambda i, y: y @ y, x))(
      ...     jnp.ones((2, 2)))
      >>> any(e.primitive.name == "dot_general" for e in iter_eqns(jaxpr))
      True
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from iter_eqns(inner)


def dot_precisions(fn, *args) -> set:
    """The `precision` of every `dot_general` that `fn(*args)` traces to (as strings).

    Example:
      >>> import jax.numpy as jnp
      >>> dot_precisions(lambda a: jnp.dot(a, a, precision="highest"), jnp.ones((2, 2)))
      {'HIGHEST'}
    """
    import jax

    found = set()
    for eqn in iter_eqns(jax.make_jaxpr(fn)(*args)):
        if eqn.primitive.name == "dot_general":
            precision = eqn.params.get("precision")
            if isinstance(precision, tuple):
                precision = precision[0]
            found.add(
                "DEFAULT" if precision is None else getattr(precision, "name", str(precision))
            )
    return found
