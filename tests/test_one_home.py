"""One home per concept: the visible (query, key) pairs and the ring cost.

Each concept is computed by one function at the bottom of the package and
read by every caller. The tests check the one function against an
independent oracle (the kernels' mask on a `[T, S]` matrix, a formula worked
by hand) and pin numbers the callers printed before their copies were merged,
so that a later change to the one home that moves them fails here.
"""

import ast
import dataclasses
import doctest
import itertools
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from shardfuse import flops, hardware, models, ring_time
from shardfuse.collectives.collective_matmul import cost_model
from shardfuse.collectives.ring_attention import ring_balance, ring_positions, strategy
from shardfuse.kernels.attention import masks
from shardfuse.kernels.attention.base import AttentionConfig
from shardfuse.planner import estimate
from shardfuse.planner.cost import axis_link
from shardfuse.planner.options import Parallelism

WINDOWS = (None, (3, 0), (0, 2), (None, 5), (10, None), (2, 2))

# ---- visible pairs ------------------------------------------------------------


@pytest.mark.parametrize("causal, window", list(itertools.product((False, True), WINDOWS)))
def test_visible_key_counts_equal_the_kernels_mask(causal, window):
    """Host-side counts == the sum over keys of `masks.visibility_mask` (the kernels' rule),
    on unsorted, gapped positions like a ring layout's."""
    rng = np.random.default_rng(0)
    q_pos = rng.permutation(40)[:17]
    kv_pos = rng.permutation(50)[:23] - 5
    config = AttentionConfig(causal=causal, window=window, logit_softcap=None, scale=1.0)
    mask = masks.visibility_mask(config, jnp.asarray(q_pos), jnp.asarray(kv_pos))
    expected = np.asarray(mask).sum(axis=1)
    counts = flops.visible_key_counts(q_pos, kv_pos, causal=causal, window=window)
    np.testing.assert_array_equal(counts, expected)


@pytest.mark.parametrize("s", [1, 2, 8, 100, 4096, 131072])
@pytest.mark.parametrize("window", [None, 0, 1, 3, 64, 4096, 200000])
def test_mean_visible_keys_equals_its_closed_form(s, window):
    """The planner's mean keys per query, now the causal pair count / s, is bitwise the
    closed form it used to compute: `(s + 1) / 2`, or `sum_i min(i + 1, W) / s`."""
    if window is None or window >= s:
        closed = (s + 1) / 2
    else:
        closed = (window * (window + 1) / 2 + (s - window) * window) / s
    assert flops.mean_visible_keys(s, window, True) == closed
    assert flops.mean_visible_keys(s, window, False) == s


def test_mean_visible_keys_refuses_an_empty_sequence():
    with pytest.raises(ValueError, match="s=0 must be a sequence length >= 1"):
        flops.mean_visible_keys(0, None, True)


@pytest.mark.parametrize(
    "layout, n, causal, window, pairs",
    [
        ("contiguous", 4, True, None, [136, 392, 648, 904]),
        ("zigzag", 4, True, (5, 0), [81, 96, 96, 96]),
        ("striped", 8, False, (3, 2), [93, 94, 95, 96, 96, 96, 95, 94]),
    ],
)
def test_ring_balance_reads_the_one_count(layout, n, causal, window, pairs):
    """`ring_balance`'s pair work: the numbers it gave with its own copy of the count, and
    the kernels' mask summed per device."""
    report = ring_balance(16 * n, n, layout, causal=causal, window=window)
    np.testing.assert_array_equal(report.pairs, pairs)
    positions = np.arange(16 * n)
    config = AttentionConfig(causal=causal, window=window, logit_softcap=None, scale=1.0)
    shards = np.asarray(ring_positions(16 * n, n, layout))
    mask = np.asarray(masks.visibility_mask(config, jnp.asarray(shards), jnp.asarray(positions)))
    np.testing.assert_array_equal(report.pairs, mask.sum(axis=(1, 2)))


# ---- ring cost ----------------------------------------------------------------


def test_ring_time_formulas_worked_by_hand():
    # 4 devices, 1 GB/s, 0.5 s per step: 3 steps of 1 GB chunks
    assert ring_time.ring_transfer_s(4, 1e9, 1e9, 0.5) == 3 * (1.0 + 0.5)
    assert ring_time.ring_transfer_s(1, 1e9, 1e9, 0.5) == 0.0
    # all-gather of 4 GB over 4: each device sends 3 of its 1 GB chunks; all-reduce twice
    assert ring_time.ring_collective_s(4, 4e9, 1e9, 0.25) == 3.0 + 3 * 0.25
    assert ring_time.ring_collective_s(4, 4e9, 1e9, 0.25, factor=2.0) == 2 * (3.0 + 0.75)
    assert ring_time.ring_collective_s(1, 4e9, 1e9, 0.25) == 0.0
    # overlap: compute-bound rings cost N computes, link-bound ones 1 compute + N - 1 transfers
    assert ring_time.overlapped_ring_s(4, 1.0, 0.5) == 4.0
    assert ring_time.overlapped_ring_s(4, 1.0, 2.0) == 1.0 + 3 * 2.0
    assert ring_time.overlapped_ring_s(1, 1.0, 2.0) == 1.0
    # a switch (link == egress): the second direction adds nothing; a torus doubles
    assert ring_time.ring_bandwidth(450.0, 450.0, bidirectional=True) == 450e9
    assert ring_time.ring_bandwidth(100.0, 600.0, bidirectional=True) == 200e9
    assert ring_time.ring_bandwidth(100.0, 150.0, bidirectional=True) == 150e9
    assert ring_time.ring_bandwidth(100.0, 600.0, bidirectional=False) == 100e9
    assert doctest.testmod(ring_time).failed == 0
    with pytest.raises(ValueError, match="bandwidth=0"):
        ring_time.ring_transfer_s(4, 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="latency=-1"):
        ring_time.ring_collective_s(4, 1.0, 1e9, -1)
    with pytest.raises(ValueError, match="egress_gb_per_s=0"):
        ring_time.ring_bandwidth(1.0, 0, bidirectional=True)


@pytest.mark.parametrize("key", hardware.names())
def test_every_ring_reader_uses_the_one_bandwidth(key):
    device = hardware.device(key)
    if device.link is None or device.peak_tflops("bfloat16") is None:
        pytest.skip(f"{key} has no link figures")
    link = device.link
    figures = cost_model.Hardware.from_device(device)
    for bidirectional in (False, True):
        expected = ring_time.ring_bandwidth(
            link.gb_per_s, link.egress_gb_per_s, bidirectional=bidirectional
        )
        assert figures.ring_bandwidth(bidirectional) == expected
    cluster = hardware.Cluster(
        device, nodes=2, devices_per_node=8, intra_link=link, inter_link=link
    )
    bandwidth, latency, _ = axis_link(cluster, Parallelism(data=2, model=8), "model")
    assert bandwidth == ring_time.ring_bandwidth(
        link.gb_per_s, link.egress_gb_per_s, bidirectional=True
    )
    assert latency == link.latency_us * 1e-6


# Numbers the three ring cost models printed with their own copies of the formulas
# (before `shardfuse.ring_time`): collective matmul and the strategy rule bitwise, the
# planner to the last bits (its products are now taken in another order).
def test_collective_matmul_ring_cost_is_unchanged():
    cost = cost_model.ring_cost(
        "matmul_all_reduce",
        rows=8192,
        contract=4096,
        cols=14336,
        ring_size=8,
        hardware="tpu_v5p_ici",
        bidirectional=True,
    )
    assert (cost.compute_s, cost.transfer_s, cost.serial_s, cost.overlapped_s) == (
        0.0002620023622832244,
        0.00308281344,
        0.003344815802283225,
        0.0031155637352854038,
    )
    cost = cost_model.ring_cost(
        "all_gather_matmul",
        rows=8192,
        contract=4096,
        cols=14336,
        ring_size=8,
        hardware="h100_nvlink",
    )
    assert (cost.serial_s, cost.overlapped_s, cost.hidden_fraction) == (
        0.00025203694543494374,
        0.00014568289373492353,
        0.8150394178289871,
    )


def test_ring_attention_strategy_costs_are_unchanged():
    costs = strategy.strategy_costs(
        batch=2,
        seq_len=131072,
        heads=32,
        kv_heads=8,
        head_dim=128,
        sequence_size=8,
        ulysses_size=2,
        hardware="tpu-v5p",
    )
    times = {c.strategy: (c.forward_s, c.backward_s) for c in costs}
    assert times["ring"] == (0.07665499024899347, 0.19432483018248367)
    assert times["all_gather"] == (0.08135861072899347, 0.19634109610248368)
    assert times["ulysses_ring"] == (0.07835819760899347, 0.19602803754248366)
    costs = strategy.strategy_costs(
        batch=2,
        seq_len=8192,
        heads=32,
        kv_heads=8,
        head_dim=128,
        sequence_size=2,
        causal=False,
        hardware="h100-sxm",
    )
    assert (costs[0].forward_s, costs[0].backward_s) == (
        0.0011112913157226602,
        0.0029303590981955394,
    )
    assert (costs[1].forward_s, costs[1].backward_s) == (
        0.0011918567201671046,
        0.002858793693751095,
    )


@pytest.mark.parametrize(
    "cluster, parallelism, terms",
    [
        (
            ("h100", 2),
            dict(data=2, fsdp=2, sequence=2, model=2, zero=2),
            dict(
                tensor_parallel=0.001546855765333333,
                context_parallel=0.0003116354560000001,
                data_parallel=0.014726533728000007,
            ),
        ),
        (
            ("tpu-v5p", 1),
            dict(data=560, sequence=4, model=4, cp_strategy="ulysses"),
            dict(
                tensor_parallel=0.01297702614812691,
                context_parallel=0.0030925824,
                data_parallel=0.03750157896986644,
            ),
        ),
    ],
)
def test_planner_communication_terms_are_unchanged(cluster, parallelism, terms):
    model = models.get("llama3-8b")
    result = estimate(
        model,
        hardware.cluster(cluster[0], nodes=cluster[1]),
        Parallelism.of(**parallelism),
        global_batch=64,
        seq_len=8192,
    )
    got = {term.name: term.value for term in result.time if term.name in terms}
    assert got == pytest.approx(terms, rel=1e-14, abs=0)


# ---- the run's vocabulary ---------------------------------------------------------
# One definition each of the model's shape class, the ZeRO stages, the remat policies
# and the microbatch count's name; each run choice checked by one function.

SRC = pathlib.Path(flops.__file__).resolve().parent


def _sources():
    return {p.relative_to(SRC).as_posix(): p.read_text() for p in sorted(SRC.rglob("*.py"))}


def _definitions(name: str) -> list[str]:
    """Files of `src/shardfuse` that define `name` (a class, a function or a module constant)."""
    found = []
    for path, text in _sources().items():
        for node in ast.parse(text).body:
            targets = []
            if isinstance(node, ast.ClassDef | ast.FunctionDef):
                targets = [node.name]
            elif isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if name in targets:
                found.append(path)
    return found


def test_each_word_of_a_run_is_defined_once():
    from shardfuse.layers import fsdp
    from shardfuse.planner import options as planner_options

    assert _definitions("ModelSpec") == ["model_spec.py"]
    assert _definitions("ZERO_STAGES") == ["layers/fsdp.py"]
    assert _definitions("REMAT_POLICIES") == ["flops.py"]
    assert planner_options.ZERO_STAGES is fsdp.ZERO_STAGES
    assert planner_options.REMAT_POLICIES is flops.REMAT_POLICIES
    for check in ("check_zero", "check_remat", "check_schedule", "check_count", "check_layout"):
        assert len(_definitions(check)) == 1, (check, _definitions(check))
    # no other copy of the lists, nor of the old class name but its deprecated alias
    for path, text in _sources().items():
        stages = text.replace("must be one of (0, 1, 2, 3)", "")  # error texts in docstrings
        assert "(0, 1, 2, 3)" not in stages or path == "layers/fsdp.py", path
        assert '"none", "full", "selective", "dots", "offload"' not in text or path == "flops.py"
        assert "ModelShape" not in text or path == "models/__init__.py", path


def test_the_microbatch_count_has_one_name():
    """`num_microbatches` in every signature and options field of the library; `microbatches`
    only as the deprecated spelling (`RunOptions(microbatches=)`, `TrainConfig(microbatches=)`)."""
    import inspect

    import shardfuse as sf

    for path, text in _sources().items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.arg):
                assert node.arg != "microbatches", f"{path}:{node.lineno}"
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                assert node.target.id != "microbatches", f"{path}:{node.lineno}"
    assert "num_microbatches" in inspect.signature(sf.parallel.Pipeline.__init__).parameters
    assert "num_microbatches" in inspect.signature(sf.parallel.accumulate).parameters
    assert "num_microbatches" in {f.name for f in dataclasses.fields(sf.parallel.RunOptions)}


def test_the_old_homes_of_moved_names_warn():
    """Names whose one home moved stay one release as deprecated aliases of the new one."""
    import jax

    from shardfuse.layers import fsdp, remat
    from shardfuse.parallel import zero

    with pytest.warns(DeprecationWarning, match=r"remat.POLICIES is deprecated.*REMAT_POLICIES"):
        assert remat.POLICIES is flops.REMAT_POLICIES
    with pytest.warns(DeprecationWarning, match=r"remat.check_policy is deprecated.*check_remat"):
        assert remat.check_policy is flops.check_remat
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.warns(DeprecationWarning, match=r"fsdp_axis_of is deprecated.*fsdp_axis_on"):
        assert zero.fsdp_axis_of(mesh, "fsdp") is None is fsdp.fsdp_axis_on(mesh, "fsdp")
