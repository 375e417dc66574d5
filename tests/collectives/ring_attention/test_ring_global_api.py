"""The global `sf.ring_attention` on every kind of mesh, context and transformation.

Matrix: {Explicit mesh, Auto mesh} x {no mesh context, `jax.set_mesh(mesh)`}
x {eager, jax.jit, jax.grad, jax.vjp}. Each case checks the values against
`sf.attention_reference` on the full sequence (float32: 1e-5 outputs and
lse, 2e-5 gradients) and that out and lse come back sharded over the
sequence axis (a replicated output is an all-gather on every device).
Then: a 3-axis mesh with data_axis / model_axis, inputs sharded any way,
lengths the ring does not divide, the keyword renames, and bad axes.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.collectives.sharding import typed_on_explicit_mesh
from shardfuse.testing import assert_close
from tests.pairwise import pairwise

pytestmark = pytest.mark.timeout(300)

B, T, H, K, D = 1, 32, 4, 2, 16
RING = 4
KWARGS = dict(causal=True)


def _mesh(kind, shape=(RING,), names=("sequence",)):
    devices = jax.devices()[: int(np.prod(shape))]
    if kind == "explicit":
        return jax.make_mesh(shape, names, devices=devices)  # Explicit: make_mesh's default
    if kind == "auto":
        return jax.make_mesh(
            shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices
        )
    return jax.sharding.Mesh(np.array(devices).reshape(shape), names)  # "mesh": Auto, by hand


def _inputs(b=B, t=T, h=H, kv=K, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, t, h, D), jnp.float32)
    k = jax.random.normal(keys[1], (b, t, kv, D), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, kv, D), jnp.float32)
    d_out = jax.random.normal(keys[3], (b, t, h, D), jnp.float32)
    d_lse = jax.random.normal(keys[4], (b, h, t), jnp.float32)
    return q, k, v, d_out, d_lse


def _spec(x):
    """`x.sharding.spec` as a tuple without trailing Nones."""
    spec = list(x.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


def _reference(q, k, v, d_out, d_lse, **kwargs):
    def attend(q, k, v):
        with jax.default_matmul_precision("highest"):
            return sf.attention_reference(q, k, v, return_lse=True, **KWARGS, **kwargs)

    (out, lse), vjp = jax.vjp(attend, q, k, v)
    return out, lse, vjp((d_out, d_lse))


def _check(out, lse, grads, expected, out_spec, lse_spec):
    e_out, e_lse, e_grads = expected
    assert_close(out, e_out, name="out")
    assert_close(lse, e_lse, name="lse")
    if grads is not None:
        for name, g, e in zip(("dq", "dk", "dv"), grads, e_grads, strict=True):
            assert_close(g, e, kind="grad", name=name)
    assert _spec(out) == out_spec, out.sharding
    assert _spec(lse) == lse_spec, lse.sharding


def _run(mode, attend, mesh, q, k, v, d_out, d_lse):
    """(out, lse, grads or None) of `attend` under `mode`."""
    if mode == "eager":
        return (*attend(q, k, v), None)
    if mode == "jit":
        return (*jax.jit(attend)(q, k, v), None)
    if mode == "grad":

        def loss(q, k, v, d_out, d_lse):
            out, lse = attend(q, k, v)
            return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)

        grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
        if jax.sharding.get_abstract_mesh().empty and typed_on_explicit_mesh((q, k, v)):
            # JAX itself cannot seed an eager jax.grad whose loss is typed on an Explicit
            # mesh without a mesh context ("Length of device assignment 1"), whatever the
            # loss: jit supplies the devices. Plain inputs give a loss typed on no mesh
            # (test_plain_inputs_grad_without_context), so they run eagerly.
            grad = jax.jit(grad)
        grads, (out, lse) = grad(q, k, v, d_out, d_lse)
        return out, lse, grads
    (out, lse), vjp = jax.vjp(attend, q, k, v)
    return out, lse, vjp((d_out, d_lse))


MODES = ("eager", "jit", "grad", "vjp")


def _context_id(context):
    return "set_mesh" if context else "no_context"


def _matrix_cells():
    """{Explicit, Auto} x {no context, set_mesh} x {eager, jit, grad, vjp}. The default run
    keeps the README's pattern (jax.make_mesh's Explicit mesh, no set_mesh) in every mode,
    and Auto + set_mesh under jit; -m slow adds the cells that cover every pair of the
    three factors (tests/pairwise.py)."""
    default = [("explicit", False, mode) for mode in MODES] + [("auto", True, "jit")]
    slow = [c for c in pairwise(("explicit", "auto"), (False, True), MODES) if c not in default]
    return [
        pytest.param(*cell, id=f"{cell[0]}-{_context_id(cell[1])}-{cell[2]}", marks=marks)
        for cells, marks in ((default, ()), (slow, (pytest.mark.slow,)))
        for cell in cells
    ]


@pytest.mark.parametrize("mesh_kind, context, mode", _matrix_cells())
def test_matrix(mesh_kind, context, mode):
    mesh = _mesh(mesh_kind)
    q, k, v, d_out, d_lse = _inputs()
    expected = _reference(q, k, v, d_out, d_lse)

    def attend(q, k, v):
        return sf.ring_attention(q, k, v, mesh=mesh, layout="zigzag", return_lse=True, **KWARGS)

    ctx = jax.sharding.set_mesh(mesh) if context else contextlib.nullcontext()
    with ctx:
        out, lse, grads = _run(mode, attend, mesh, q, k, v, d_out, d_lse)
    _check(out, lse, grads, expected, (None, "sequence"), (None, None, "sequence"))


def _strategy_cells():
    """Ulysses and USP over {Explicit, Auto} x {no context, set_mesh} x {eager, jit, grad,
    vjp}: the default run keeps USP under jax.grad on the README's Explicit mesh without a
    context (numerics: test_ulysses.py); -m slow adds the cells that cover every pair of the
    four factors (tests/pairwise.py)."""
    default = ("ulysses_ring", "explicit", False, "grad")
    cells = pairwise(("ulysses", "ulysses_ring"), ("explicit", "auto"), (False, True), MODES)
    return [pytest.param(*default, id="ulysses_ring-explicit-no_context-grad")] + [
        pytest.param(*c, id=f"{c[0]}-{c[1]}-{_context_id(c[2])}-{c[3]}", marks=pytest.mark.slow)
        for c in cells
        if c != default
    ]


@pytest.mark.parametrize("strategy, mesh_kind, context, mode", _strategy_cells())
def test_strategy_matrix(strategy, mesh_kind, context, mode):
    if strategy == "ulysses":
        mesh, axis, seq = _mesh(mesh_kind), "sequence", "sequence"
    else:
        mesh = _mesh(mesh_kind, (2, 2), ("ring", "ulysses"))
        axis, seq = ("ulysses", "ring"), ("ring", "ulysses")  # sharded ring-major
    q, k, v, d_out, d_lse = _inputs()
    expected = _reference(q, k, v, d_out, d_lse)

    def attend(q, k, v):
        return sf.ring_attention(
            q, k, v, mesh=mesh, sequence_axis=axis, strategy=strategy, return_lse=True,
            **KWARGS,
        )  # fmt: skip

    ctx = jax.sharding.set_mesh(mesh) if context else contextlib.nullcontext()
    with ctx:
        out, lse, grads = _run(mode, attend, mesh, q, k, v, d_out, d_lse)
    _check(out, lse, grads, expected, (None, seq), (None, None, seq))


@pytest.mark.parametrize("how", ["grad", "grad_of_jit"])
def test_plain_inputs_grad_without_context(how):
    """The README's pattern: plain arrays, the mesh jax.make_mesh gives (Explicit), no
    set_mesh, a scalar loss, and jax.grad outside (of the function, or of its jit). The
    output's type follows the inputs: sharded over the sequence, but not typed Explicit,
    so jax.grad can seed the scalar cotangent."""
    mesh = _mesh("explicit")
    q, k, v, d_out, d_lse = _inputs()
    _, _, (e_dq, _, _) = _reference(q, k, v, d_out, d_lse)

    def loss(q):
        out, lse = sf.ring_attention(q, k, v, mesh=mesh, return_lse=True, **KWARGS)
        assert not typed_on_explicit_mesh(out)
        return jnp.sum(out * d_out) + jnp.sum(lse * d_lse)

    dq = jax.grad(loss if how == "grad" else jax.jit(loss))(q)
    assert_close(dq, e_dq, kind="grad", name="dq")
    out = sf.ring_attention(q, k, v, mesh=mesh, **KWARGS)
    assert _spec(out) == (None, "sequence")


def test_output_typed_explicit_when_inputs_are():
    mesh = _mesh("explicit")
    q, k, v, _, _ = _inputs()
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "sequence"))) for x in (q, k, v))
    out = jax.jit(lambda q, k, v: sf.ring_attention(q, k, v, mesh=mesh, **KWARGS))(q, k, v)
    assert typed_on_explicit_mesh(out)
    assert _spec(out) == (None, "sequence")


@pytest.mark.parametrize(
    "mesh_kind, strategy",
    [
        ("explicit", "ring"),
        pytest.param("explicit", "all_gather", marks=pytest.mark.slow),
        pytest.param("auto", "ring", marks=pytest.mark.slow),
        pytest.param("explicit", "ulysses", marks=pytest.mark.slow),
        pytest.param("auto", "ulysses", marks=pytest.mark.slow),
    ],
)
def test_three_axis_mesh(mesh_kind, strategy):
    mesh = _mesh(mesh_kind, (2, 2, 2), ("data", "sequence", "model"))
    q, k, v, d_out, d_lse = _inputs(b=2, t=16)
    expected = _reference(q, k, v, d_out, d_lse)

    def attend(q, k, v):
        return sf.ring_attention(
            q, k, v, mesh=mesh, strategy=strategy, data_axis="data", model_axis="model",
            return_lse=True, **KWARGS,
        )  # fmt: skip

    out, lse, grads = _run("vjp", jax.jit(attend), mesh, q, k, v, d_out, d_lse)
    _check(out, lse, grads, expected, ("data", "sequence", "model"), ("data", "model", "sequence"))


@pytest.mark.parametrize("mesh_kind", ["explicit", "mesh"])
def test_inputs_sharded_any_way(mesh_kind):
    mesh = _mesh(mesh_kind)
    q, k, v, d_out, d_lse = _inputs()
    expected = _reference(q, k, v, d_out, d_lse)
    q = jax.device_put(q, NamedSharding(mesh, P(None, None, "sequence")))  # heads over the ring
    k = jax.device_put(k, jax.devices()[5])  # one device outside the mesh
    v = jax.device_put(v, NamedSharding(mesh, P(None, "sequence")))

    def attend(q, k, v):
        return sf.ring_attention(q, k, v, mesh=mesh, return_lse=True, **KWARGS)

    out, lse, _ = _run("eager", attend, mesh, q, k, v, d_out, d_lse)
    _check(out, lse, None, expected, (None, "sequence"), (None, None, "sequence"))


@pytest.mark.parametrize(
    "mesh_kind, t",
    [
        pytest.param("explicit", 28, marks=pytest.mark.slow),
        pytest.param("auto", 30, marks=pytest.mark.slow),
        pytest.param("explicit", 30, marks=pytest.mark.slow),
        pytest.param("auto", 28, marks=pytest.mark.slow),
    ],
)
def test_lengths_the_ring_does_not_divide(mesh_kind, t):
    """Padded inside (zigzag: to a multiple of 2 x ring = 8). The output is sharded over the
    sequence when the ring divides its length (28); 30 comes back replicated over the ring
    (a jax.Array cannot hold an uneven split), on Auto and Explicit meshes alike."""
    mesh = _mesh(mesh_kind)
    q, k, v, d_out, d_lse = _inputs(t=t)
    expected = _reference(q, k, v, d_out, d_lse)

    def attend(q, k, v):
        return sf.ring_attention(q, k, v, mesh=mesh, return_lse=True, **KWARGS)

    seq = "sequence" if t % RING == 0 else None
    out_spec, lse_spec = ((None, seq), (None, None, seq)) if seq else ((), ())
    out, lse, grads = _run("vjp", jax.jit(attend), mesh, q, k, v, d_out, d_lse)
    _check(out, lse, grads, expected, out_spec, lse_spec)


@pytest.mark.parametrize(
    "old, new, value, strategy",
    [("seq_axis", "sequence_axis", "sequence", "ring"), ("batch_axis", "data_axis", None, "ring"),
     ("head_axis", "model_axis", None, "ring"),
     pytest.param("seq_axis", "sequence_axis", ("ulysses", "ring"), "ulysses_ring",
                  marks=pytest.mark.slow)],
)  # fmt: skip
def test_renamed_keywords(old, new, value, strategy):
    if strategy == "ulysses_ring":
        mesh = _mesh("auto", (2, 2), ("ring", "ulysses"))
    else:
        mesh = _mesh("auto")
    q, k, v, *_ = _inputs(t=16)
    with pytest.warns(
        DeprecationWarning, match=rf"ring_attention\({old}=\.\.\.\) is deprecated.*use {new}="
    ):
        out = sf.ring_attention(q, k, v, mesh=mesh, strategy=strategy, **{old: value}, **KWARGS)
    assert_close(out, sf.attention_reference(q, k, v, **KWARGS), name="out")
    with pytest.raises(TypeError, match=rf"both {old}= \(deprecated\) and {new}="):
        sf.ring_attention(q, k, v, mesh=mesh, **{old: value, new: value})


@pytest.mark.parametrize("keyword", ["sequence_axis", "data_axis", "model_axis"])
def test_axis_absent_from_mesh(keyword):
    mesh = _mesh("explicit", (2, 2, 2), ("data", "sequence", "model"))
    q, k, v, *_ = _inputs(b=2, t=16)
    match = (
        rf"{keyword}='context': axis 'context' is not in the mesh, "
        r"whose axes are \['data', 'sequence', 'model'\]"
    )
    with pytest.raises(ValueError, match=match):
        sf.ring_attention(q, k, v, mesh=mesh, **{keyword: "context"})
    with pytest.raises(ValueError, match=match):  # under jit too, before anything is traced
        jax.jit(lambda q: sf.ring_attention(q, k, v, mesh=mesh, **{keyword: "context"}))(q)


def test_other_mesh_in_context():
    mesh = _mesh("explicit")
    q, k, v, *_ = _inputs(t=16)
    with jax.sharding.set_mesh(_mesh("explicit", (2, 2), ("data", "sequence"))):
        with pytest.raises(
            ValueError, match=r"mesh context .* has axes \{'data': 2, 'sequence': 2\}"
        ):
            sf.ring_attention(q, k, v, mesh=mesh)


def test_same_axis_twice():
    mesh = _mesh("auto", (2, 2, 2), ("data", "sequence", "model"))
    q, k, v, *_ = _inputs(b=2, t=16)
    with pytest.raises(
        ValueError, match="sequence_axis='sequence' and data_axis='sequence' both use"
    ):
        sf.ring_attention(q, k, v, mesh=mesh, data_axis="sequence")


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("context", [False, True], ids=["no_context", "set_mesh"])
def test_layout_helpers_under_jit_on_explicit_mesh(layout, context):
    mesh = _mesh("explicit", (2,), ("sequence",))
    x = jnp.arange(2 * 16 * 3, dtype=jnp.float32).reshape(2, 16, 3)
    sharded = jax.device_put(x, NamedSharding(mesh, P(None, "sequence")))
    expected = sf.to_ring_layout(x, 2, layout)
    ctx = jax.sharding.set_mesh(mesh) if context else contextlib.nullcontext()
    with ctx:
        ring = jax.jit(lambda x: sf.to_ring_layout(x, 2, layout))(sharded)
        back = jax.jit(lambda x: sf.from_ring_layout(x, 2, layout))(ring)
    np.testing.assert_array_equal(ring, expected)
    np.testing.assert_array_equal(back, x)
    assert _spec(ring) == (None, "sequence") and _spec(back) == (None, "sequence")


def test_explicit_mesh_never_gathers_the_sequence():
    """Compiled HLO on an Explicit mesh: K/V move by collective-permute only; nothing
    (input, output or lse) is all-gathered over the ring (the old replicated output was)."""
    mesh = _mesh("explicit")
    q, k, v, *_ = _inputs()
    q, k, v = (jax.device_put(x, NamedSharding(mesh, P(None, "sequence"))) for x in (q, k, v))
    attend = jax.jit(lambda q, k, v: sf.ring_attention(q, k, v, mesh=mesh, return_lse=True))
    hlo = attend.lower(q, k, v).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    assert "collective-permute" in hlo
