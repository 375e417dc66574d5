"""sf.grouped_matmul as a user calls it: errors, expert parallelism, one compilation for every
routing, compiled memory, dispatch, and its rows in `shardfuse info`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardfuse as sf
from shardfuse.kernels import registry
from shardfuse.kernels.attention import native_cpu
from shardfuse.kernels.grouped_matmul import api, base
from shardfuse.testing import assert_close
from tests.kernels.grouped_matmul.grouped_cases import zipf_sizes

needs_native = pytest.mark.skipif(not native_cpu.status("cpu")[0], reason="native_cpu not built")


def _inputs(M=24, K=8, N=6, G=3, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    return (
        jax.random.normal(keys[0], (M, K), dtype),
        jax.random.normal(keys[1], (G, K, N), dtype),
    )


@pytest.fixture
def no_backend_runs(monkeypatch):
    """Fails the test if any backend is loaded: errors must come before anything is traced."""

    def refuse(name):
        raise AssertionError(f"backend {name!r} was loaded before the inputs were checked")

    monkeypatch.setattr(api, "load_implementation", refuse)


BAD_INPUTS = [
    # (what, kwargs over good ones, error, message)
    (
        "float sizes",
        dict(group_sizes=np.array([1.0, 2.0, 3.0])),
        TypeError,
        "group_sizes has dtype",
    ),
    ("bool sizes", dict(group_sizes=np.array([True, False, True])), TypeError, "group_sizes"),
    ("negative size", dict(group_sizes=[4, -1, 3]), ValueError, "negative sizes"),
    ("sum above M", dict(group_sizes=[10, 10, 5]), ValueError, "sums to 25, more rows than lhs"),
    ("sizes of rank 2", dict(group_sizes=np.ones((3, 1), np.int32)), ValueError, "group_sizes has"),
    ("sizes for 2 of 3 groups", dict(group_sizes=[4, 4]), ValueError, "group_sizes has 2 groups"),
    ("lhs rank 3", dict(lhs=jnp.zeros((2, 24, 8))), ValueError, "lhs has rank 3"),
    ("rhs rank 2", dict(rhs=jnp.zeros((8, 6))), ValueError, "rhs has rank 2"),
    ("K mismatch", dict(rhs=jnp.zeros((3, 9, 6))), ValueError, "contracted dims differ"),
    (
        "K mismatch transposed",
        dict(rhs=jnp.zeros((3, 8, 6)), transpose_rhs=True),
        ValueError,
        r"\[G, N, K\]",
    ),
    ("dtype mismatch", dict(rhs=jnp.zeros((3, 8, 6), jnp.bfloat16)), TypeError, "share one dtype"),
    ("integer lhs", dict(lhs=jnp.zeros((24, 8), jnp.int32)), TypeError, "lhs has dtype int32"),
    ("list lhs", dict(lhs=[[1.0] * 8] * 24), TypeError, "lhs must be an array"),
    ("offset past G", dict(group_offset=2, group_sizes=[4, 4, 4, 4]), ValueError, "in \\[0, 1\\]"),
    ("negative offset", dict(group_offset=-1), ValueError, "group_offset=-1 is out of range"),
    ("float offset", dict(group_offset=1.0), TypeError, "group_offset=1.0"),
    ("offset vector", dict(group_offset=np.array([0, 1])), ValueError, "group_offset has shape"),
    ("fewer sizes than rhs", dict(group_offset=0, group_sizes=[4, 4]), ValueError, "fewer than"),
    ("out dtype", dict(preferred_element_type=jnp.int32), TypeError, "preferred_element_type"),
    ("precision", dict(precision="fastest-ever"), ValueError, "precision='fastest-ever'"),
    ("transpose flag", dict(transpose_rhs="yes"), TypeError, "transpose_rhs='yes'"),
    ("implementation", dict(implementation="cuda"), ValueError, "implementation='cuda'"),
]


@pytest.mark.parametrize(
    "kwargs, error, message", [pytest.param(*c[1:], id=c[0]) for c in BAD_INPUTS]
)
def test_bad_input_is_a_clear_error_before_tracing(kwargs, error, message, no_backend_runs):
    lhs, rhs = _inputs()
    call = dict(lhs=lhs, rhs=rhs, group_sizes=jnp.array([4, 4, 4], jnp.int32))
    if "group_offset" in kwargs:  # a shard holding 3 of 4 groups (2 of 3 with 2 sizes given)
        call["group_sizes"] = jnp.array([4, 4, 4, 4], jnp.int32)
        call["rhs"] = jnp.zeros((3, 8, 6))
    call.update(kwargs)
    with pytest.raises(error, match=message):
        sf.grouped_matmul(call.pop("lhs"), call.pop("rhs"), call.pop("group_sizes"), **call)


def test_traced_sizes_and_offset_are_checked_by_shape_and_dtype_only():
    lhs, rhs = _inputs()

    @jax.jit
    def f(sizes, offset):
        return sf.grouped_matmul(lhs, rhs[:2], sizes, group_offset=offset)

    with pytest.raises(TypeError, match="group_sizes has dtype float32"):
        f(jnp.ones(3, jnp.float32), 0)
    with pytest.raises(TypeError, match="group_offset"):
        f(jnp.ones(3, jnp.int32), 0.5)
    # A traced offset past the groups computes no rows; a traced sum above M stops at M.
    assert not f(jnp.array([4, 4, 4], jnp.int32), jnp.int32(5)).any()
    full = sf.grouped_matmul(lhs, rhs, jnp.array([4, 4, 16], jnp.int32), implementation="xla")
    clipped = jax.jit(lambda s: sf.grouped_matmul(lhs, rhs, s))(jnp.array([4, 4, 30], jnp.int32))
    assert_close(clipped, full, name="sizes past M")
    negative = jax.jit(lambda s: sf.grouped_matmul(lhs, rhs, s))(jnp.array([4, -3, 16]))
    assert_close(negative, sf.grouped_matmul(lhs, rhs, [4, 0, 16], implementation="xla"))


def test_local_groups_normal_form():
    sizes, start = base.local_groups(jnp.array([3, 0, 4, 2]), None, 4, M=10)
    assert sizes.tolist() == [3, 0, 4, 2] and start is None
    sizes, start = base.local_groups(jnp.array([3, 0, 4, 2]), 2, 2, M=10)
    assert sizes.tolist() == [4, 2] and int(start) == 3
    sizes, start = base.local_groups(jnp.array([3, -1, 4, 20]), 1, 3, M=10)
    assert sizes.tolist() == [0, 4, 3] and int(start) == 3  # negative as 0, clipped at M
    sizes, start = base.local_groups(jnp.array([3, 5]), jnp.int32(-1), 2, M=10)
    assert sizes.tolist() == [0, 3] and int(start) == 0  # traced offset before group 0


@pytest.mark.parametrize("implementation", [None, "xla", "reference"])
def test_expert_parallel_shards_sum_to_the_whole(implementation):
    """Each shard computes only its experts' rows (zeros elsewhere): the shards' outputs and
    input gradients sum to the unsharded op's; their weight gradients are its slices."""
    lhs, rhs = _inputs(M=40, G=8)
    sizes = jnp.array([3, 0, 9, 4, 6, 0, 7, 5], jnp.int32)  # 34 of 40 rows
    cotangent = jax.random.normal(jax.random.key(3), (40, 6))

    def vjp(rhs_part, offset):
        def f(lhs, rhs_part):
            return sf.grouped_matmul(
                lhs, rhs_part, sizes, group_offset=offset, implementation=implementation
            )

        out, pullback = jax.vjp(f, lhs, rhs_part)
        return (out, *pullback(cotangent))

    whole = vjp(rhs, None)
    parts = [vjp(rhs[o : o + 2], jnp.int32(o)) for o in range(0, 8, 2)]
    assert_close(sum(p[0] for p in parts), whole[0], name="out")
    assert_close(sum(p[1] for p in parts), whole[1], kind="grad", name="d_lhs")
    assert_close(jnp.concatenate([p[2] for p in parts]), whole[2], kind="grad", name="d_rhs")
    owned = np.zeros(40, bool)
    owned[3:16] = True  # shard 1 holds groups 2, 3: rows 3 to 15
    assert not np.asarray(parts[1][0])[~owned].any() and np.asarray(parts[1][0])[owned].all()


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_nan_in_rows_of_other_groups_never_reaches_an_output(implementation):
    lhs, rhs = _inputs(M=30)
    lhs = lhs.at[:6].set(jnp.nan).at[26:].set(jnp.nan)  # other shards' rows and the tail
    sizes = jnp.array([6, 8, 12, 4], jnp.int32)  # 30 rows: groups 1 and 2 are local
    cotangent = jnp.ones((30, 6)).at[:6].set(jnp.nan).at[26:].set(jnp.nan)

    def f(lhs, rhs):
        return sf.grouped_matmul(lhs, rhs, sizes, group_offset=1, implementation=implementation)

    out, pullback = jax.vjp(f, lhs, rhs[:2])
    d_lhs, d_rhs = pullback(cotangent)
    assert np.isfinite(np.asarray(out[6:26])).all() and not np.asarray(out[6:26] == 0).all()
    assert np.isfinite(np.asarray(d_rhs)).all()
    assert np.isfinite(np.asarray(d_lhs[6:26])).all()


def test_empty_inputs_give_zeros():
    lhs, rhs = _inputs(M=0)
    assert sf.grouped_matmul(lhs, rhs, [0, 0, 0]).shape == (0, 6)
    lhs, rhs = _inputs(K=0)
    out, pullback = jax.vjp(lambda r: sf.grouped_matmul(lhs, r, [4, 4, 4]), rhs)
    assert out.shape == (24, 6) and not out.any() and pullback(out)[0].shape == rhs.shape


@needs_native
def test_registered_with_native_cpu_the_cpu_default_and_float16_falling_back(monkeypatch):
    op = registry.get("grouped_matmul")
    assert op.names == ("reference", "xla", "native_cpu", "pallas_tpu", "triton")
    assert op.preference["cpu"] == ("native_cpu", "xla")
    report = sf.info(print_report=False)
    assert report["implementations"]["grouped_matmul"]["native_cpu"][0]
    assert report["preference"]["grouped_matmul"][0] == "native_cpu"
    used = []
    original = api.load_implementation

    def spy(name):
        used.append(name)
        return original(name)

    monkeypatch.setattr(api, "load_implementation", spy)
    lhs, rhs = _inputs()
    sf.grouped_matmul(lhs, rhs, [4, 4, 4])
    assert used == ["native_cpu"]
    used.clear()
    lhs16, rhs16 = (x.astype(jnp.float16) for x in (lhs, rhs))
    out = sf.grouped_matmul(lhs16, rhs16, [4, 4, 4])
    assert used == ["native_cpu", "xla"] and out.dtype == jnp.float16
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        sf.grouped_matmul(lhs16, rhs16, [4, 4, 4], implementation="native_cpu")


@pytest.mark.parametrize("implementation", [None, "xla"])
def test_one_compilation_serves_every_routing(implementation):
    """Three routings of the same shapes (balanced, skewed, everything in one group plus
    rows past the sum) through one jitted forward + backward: traced once, compiled once."""
    lhs, rhs = _inputs(M=64, G=4)
    cotangent = jnp.ones((64, 6))
    traces = []

    @jax.jit
    def step(lhs, rhs, sizes):
        traces.append(1)
        out, pullback = jax.vjp(
            lambda a, b: sf.grouped_matmul(a, b, sizes, implementation=implementation), lhs, rhs
        )
        return out, pullback(cotangent)

    routings = ([16, 16, 16, 16], [50, 2, 0, 12], [0, 0, 60, 0])
    for routing in routings:
        out, (d_lhs, d_rhs) = step(lhs, rhs, jnp.array(routing, jnp.int32))
        expected = sf.grouped_matmul(lhs, rhs, routing, implementation="reference")
        assert_close(out, expected, atol=1e-4, name=f"routing {routing}")
    assert len(traces) == 1 and step._cache_size() == 1


@needs_native
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_compiled_temp_memory_is_linear_in_the_operands(mode):
    """XLA's temp buffers for the default implementation stay within a small multiple of
    M*K + G*K*N + M*N (the operands): no [G, M, K] or [M, G, N] expansion. At these sizes
    one such expansion is 64x lhs (16 MiB); the bound allows 2x the operands (0.75 MiB)."""
    M, K, N, G = 1024, 64, 32, 64
    lhs, rhs = _inputs(M=M, K=K, N=N, G=G)
    sizes = jnp.array(zipf_sizes(G, M), jnp.int32)
    cotangent = jnp.ones((M, N))

    def forward(lhs, rhs, sizes, cotangent):
        return sf.grouped_matmul(lhs, rhs, sizes)

    def forward_backward(lhs, rhs, sizes, cotangent):
        out, pullback = jax.vjp(lambda a, b: sf.grouped_matmul(a, b, sizes), lhs, rhs)
        return out, pullback(cotangent)

    fn = forward if mode == "fwd" else forward_backward
    compiled = jax.jit(fn).lower(lhs, rhs, sizes, cotangent).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    operands = 4 * (M * K + G * K * N + M * N)
    expansion = 4 * G * M * K
    assert temp <= 2 * operands, (temp, operands)
    assert temp < expansion / 16, (temp, expansion)
    # The xla implementation on CPU is lax.ragged_dot's dense expansion: the contrast.
    xla = jax.jit(
        lambda lhs, rhs, sizes, cotangent: sf.grouped_matmul(lhs, rhs, sizes, implementation="xla")
    )
    xla_temp = xla.lower(lhs, rhs, sizes, cotangent).compile().memory_analysis().temp_size_in_bytes
    assert xla_temp >= expansion, (xla_temp, expansion)


@needs_native
@pytest.mark.parametrize("K", [1024, 1000])
def test_native_rows_packed_or_read_in_place(K):
    """float32 rows are read in place unless 4 KiB apart (K = 1024: packed, as bfloat16's
    always are): both paths against the float64 loop."""
    from tests.kernels.grouped_matmul.grouped_cases import Case, assert_matches, make_inputs

    case = Case(f"K{K}", 45, K, 24, (20, 0, 13))
    inputs = make_inputs(case)

    def f(lhs, rhs):
        return sf.grouped_matmul(lhs, rhs, list(case.sizes), implementation="native_cpu")

    out, pullback = jax.vjp(f, inputs.lhs, inputs.rhs)
    got = tuple(np.asarray(x) for x in (out, *pullback(inputs.cotangent)))
    assert_matches(got, case, case.name, references=None)
