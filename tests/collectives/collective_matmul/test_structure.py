"""The xla rings move data with ppermute only, N - 1 per direction, and overlap.

"Overlap" is checked on the jaxpr: within ring step s (the named scope
`ring_step_{s}`), no dot_general depends, even indirectly, on a ppermute
issued in step s, so XLA's async collectives can run them side by side.
"""

import re

import jax
import pytest

from tests.collectives.collective_matmul.common import Case
from tests.jaxprs import sub_jaxprs

_STEP = re.compile(r"ring_step_(\d+)")
_FORBIDDEN = {"all_gather", "all_gather_invariant", "reduce_scatter", "psum", "all_to_all"}


def _step(eqn, prefix):
    found = _STEP.findall(prefix + "/" + str(eqn.source_info.name_stack))
    return (prefix + "/" + str(eqn.source_info.name_stack), int(found[-1])) if found else None


def _is_var(atom):
    return not hasattr(atom, "val")  # jaxpr Literals carry .val and are not hashable


def analyse(jaxpr, prefix="", inherited=None):
    """Counts primitives everywhere; lists dots that depend on a same-step ppermute.

    Dependence is tracked through sub-jaxprs (jit, custom_vjp, shard_map):
    `inherited[k]` is the set of `(scope, step)` ppermutes the k-th input depends on.
    """
    counts, violations = {}, []
    depends = {}  # var -> set of (scope, step) of the ppermutes it depends on
    for var, deps in zip(jaxpr.invars, inherited or [], strict=False):
        depends[var] = deps
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        counts[name] = counts.get(name, 0) + 1
        inputs = [depends.get(v, set()) if _is_var(v) else set() for v in eqn.invars]
        ancestors = set().union(*inputs)
        step = _step(eqn, prefix)
        if name == "dot_general" and step is not None and step in ancestors:
            violations.append(f"dot_general in {step[0]} consumes a ppermute of the same step")
        if name == "ppermute" and step is not None:
            ancestors = ancestors | {step}
        scope = prefix + "/" + str(eqn.source_info.name_stack)
        for sub in sub_jaxprs(eqn):
            sub_counts, sub_violations, sub_ancestors = analyse(sub, scope, inputs)
            for key, value in sub_counts.items():
                counts[key] = counts.get(key, 0) + value
            violations += sub_violations
            ancestors = ancestors | sub_ancestors
        for var in eqn.outvars:
            depends[var] = ancestors
    produced = set().union(*(depends.get(v, set()) for v in jaxpr.outvars if _is_var(v)))
    return counts, violations, produced


def _jaxprs(case: Case):
    x, w, cotangent = case.inputs()
    f = case.sharded(case.call("xla"))
    forward = jax.make_jaxpr(f)(x, w)

    def grads(x, w, cotangent):
        _, vjp = jax.vjp(f, x, w)
        return vjp(cotangent)

    backward = jax.make_jaxpr(grads)(x, w, cotangent)
    return forward.jaxpr, backward.jaxpr


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_ring_structure(op, bidirectional):
    n = 4
    directions = 2 if bidirectional else 1
    forward, backward = _jaxprs(Case(op, n, bidirectional=bidirectional))
    counts, violations, _ = analyse(forward)
    assert counts.get("ppermute", 0) == directions * (n - 1), counts
    assert not _FORBIDDEN & set(counts), counts
    assert not violations, violations
    assert counts["dot_general"] == directions * n

    counts, violations, _ = analyse(backward)
    # The vjp jaxpr holds the forward ring and the backward rings: for
    # all_gather_matmul x travels again and the dx partial sums travel; for
    # matmul_reduce_scatter dy travels.
    rings = 2 if op == "all_gather_matmul" else 1
    assert counts.get("ppermute", 0) == (1 + rings) * directions * (n - 1), counts
    assert not (_FORBIDDEN - {"psum"}) & set(counts), counts
    assert not violations, violations


def test_all_reduce_structure():
    n = 4
    forward, _ = _jaxprs(Case("matmul_all_reduce", n))
    counts, violations, _ = analyse(forward)
    assert counts.get("ppermute", 0) == 2 * (n - 1), counts  # bidirectional reduce-scatter
    assert not {"psum", "reduce_scatter"} & set(counts), counts
    assert not violations, violations


def test_detector_flags_a_dot_on_the_same_step_ppermute():
    """The analysis itself can fail: a ring that multiplies what it just received."""
    from jax import lax

    from tests.collectives.collective_matmul.common import ring_mesh

    def serial_ring(x, w):
        with jax.named_scope("ring_step_1"):
            received = lax.ppermute(x, "model", [(0, 1), (1, 0)])
            return received @ w

    f = jax.shard_map(
        serial_ring,
        mesh=ring_mesh(2),
        in_specs=(jax.P("model"), jax.P()),
        out_specs=jax.P("model"),
    )
    jaxpr = jax.make_jaxpr(f)(jax.numpy.ones((4, 3)), jax.numpy.ones((3, 2))).jaxpr
    _, violations, _ = analyse(jaxpr)
    assert violations
