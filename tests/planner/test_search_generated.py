"""`sf.plan` over generated models, clusters and pins: plans, or a PlanningError naming why.

Hypothesis draws dense models (heads, kv heads, head dim, MLP, layers, vocabulary,
activation, window: sizes that divide and sizes that do not), clusters (every device of
`shardfuse.hardware`, 1 to 6144 chips, odd node sizes), batches and sequence lengths (odd
ones among them) and, one draw in two, options pinned the way a user pins them (mesh
sizes, ZeRO stage, remat, schedule, virtual stages, microbatch size). Whatever is drawn,
`plan` returns plans that keep every rule and fit, or raises `PlanningError` whose
message names the rule that failed or the memory that does not fit; never another
exception (an internal error: the PaLM-540B case below once raised the pipeline
schedule's `ValueError` for a candidate with fewer microbatches than stages).

Budgets: `tests/differential/budget.py` (fixed draws; `SHARDFUSE_TEST_SEED` for others),
a small one in the default suite on up to 512 chips, a large one under `-m slow`.
"""

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from shardfuse import hardware, models
from shardfuse.planner import PlanningError, parallelism_constraints, plan
from shardfuse.planner.published import PALM_540B
from tests.differential.budget import seeded, settings

DEVICES = tuple(hardware.DEVICES)
# What a PlanningError must name: a failed rule (its values) or the memory that does not fit.
NAMES_THE_CONSTRAINT = re.compile(
    r"respects the divisibility rules .*(rules that failed: .*\d|mesh shapes tried)"
    r"|fits in [\d.e+]+ GB per device: the smallest needs [\d.e+]+ GB"
    r"|the pinned sizes multiply to \d+"
    r"|refused by the rules: .*\d"
)


@st.composite
def models_(draw):
    """A dense `ModelSpec`: GQA/MQA/MHA, head dims that do and do not make `hidden`."""
    kv_heads = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    head_dim = draw(st.sampled_from([16, 64, 80, 128, 256]))
    hidden = heads * head_dim if draw(st.booleans()) else draw(st.integers(64, 20000))
    return models.ModelSpec(
        "generated",
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden=draw(
            st.one_of(st.sampled_from([2, 3, 4]).map(lambda k: k * hidden), st.integers(64, 80000))
        ),
        num_layers=draw(st.one_of(st.integers(1, 12), st.sampled_from([24, 35, 61, 96, 118]))),
        vocab_size=draw(st.sampled_from([256, 1000, 32000, 50257, 128256, 256000])),
        activation=draw(st.sampled_from(["swiglu", "gelu"])),
        tied_embeddings=draw(st.booleans()),
        window=draw(st.sampled_from([None, None, 512, 4096])),
    )


@st.composite
def problems(draw, max_devices):
    """`(model, cluster, plan keywords)`: a model, a cluster of at most `max_devices`
    chips, a batch and sequence length and, one draw in two, some pinned options."""
    model = draw(models_())
    device = draw(st.sampled_from(DEVICES))
    per_node = draw(st.sampled_from([None, 1, 4, 6, 8, 16, 64, 256]))
    default_per_node = hardware.cluster(device).devices_per_node
    most_nodes = max(1, max_devices // (per_node or default_per_node))
    cluster = hardware.cluster(device, nodes=draw(st.integers(1, min(most_nodes, 64))),
                               devices_per_node=per_node)  # fmt: skip
    kwargs = dict(
        global_batch=draw(st.one_of(st.integers(1, 64), st.sampled_from([256, 1000, 2048]))),
        seq_len=draw(st.sampled_from([1, 97, 512, 2048, 4096, 8192, 32768])),
        top_k=draw(st.integers(1, 5)),
    )
    if draw(st.booleans()):
        n = cluster.num_devices
        for axis in draw(st.sets(st.sampled_from(["pipeline", "data", "fsdp", "model"]),
                                 max_size=2)):  # fmt: skip
            kwargs.setdefault("mesh", {})[axis] = draw(
                st.sampled_from([d for d in (1, 2, 3, 4, 8, 16) if n % d == 0])
            )
        if draw(st.booleans()):
            kwargs["zero"] = draw(st.sampled_from([0, 1, 2, 3, (0, 3)]))
        if draw(st.booleans()):
            kwargs["remat"] = draw(st.sampled_from(["none", "selective", "full", "dots"]))
        schedule = draw(st.sampled_from([None, "gpipe", "1f1b", "zb-h1", "interleaved"]))
        if schedule is not None:
            kwargs["schedule"] = schedule
        if schedule == "interleaved" and draw(st.booleans()):
            kwargs["virtual_stages"] = draw(st.sampled_from([2, 3, 4]))
        if draw(st.booleans()):
            kwargs["microbatch_size"] = draw(st.sampled_from([1, 2, 4]))
    return model, cluster, kwargs


def _plans_or_named_error(problem):
    model, cluster, kwargs = problem
    try:
        plans = plan(model, cluster, **kwargs)
    except PlanningError as error:
        assert NAMES_THE_CONSTRAINT.search(str(error)), str(error)
        return
    assert 1 <= len(plans) <= kwargs["top_k"]
    sizes = dict(global_batch=kwargs["global_batch"], seq_len=kwargs["seq_len"])
    for p in plans:
        assert parallelism_constraints(model, p.parallelism, **sizes) == []
        assert p.memory_bytes <= p.estimate.memory_limit_bytes
        assert p.parallelism.num_devices == cluster.num_devices


PALM_ON_TWO_PODS = (
    PALM_540B,
    hardware.cluster("tpu-v4", nodes=2, devices_per_node=3072),
    dict(global_batch=2048, seq_len=2048, top_k=1, mesh={"model": 12}),
)


@pytest.mark.parametrize("max_examples, max_devices", [
    pytest.param(30, 512, id="default"),
    pytest.param(300, 6144, id="slow", marks=pytest.mark.slow),
])  # fmt: skip
def test_plan_returns_plans_or_names_the_constraint(max_examples, max_devices):
    @settings(max_examples)
    @given(problems(max_devices))
    @example(PALM_ON_TWO_PODS)
    def drawn(problem):
        _plans_or_named_error(problem)

    seeded(drawn)()


def test_a_pipeline_without_a_microbatch_per_stage_is_not_a_candidate():
    """The search skips the meshes whose batch per replica is under the pipeline size (no
    schedule runs them), and names the rule when the pins leave only those."""
    kwargs = dict(global_batch=4, seq_len=64)
    tiny = models.ModelSpec("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16,
                            ffn_hidden=128, num_layers=8, vocab_size=256)  # fmt: skip
    cluster = hardware.cluster("h100")
    with pytest.raises(PlanningError, match=r"= 2 microbatches at most < pipeline=4"):
        plan(tiny, cluster, mesh={"pipeline": 4, "data": 2}, **kwargs)
    plans = plan(tiny, cluster, mesh={"pipeline": 2}, top_k=50, **kwargs)
    assert plans and all(4 // p.parallelism.mesh_shape["data"] >= 2 for p in plans)


def test_a_pinned_option_that_breaks_a_rule_is_named_not_memory():
    """When the candidates that fit all break a rule (here the pinned virtual stages), the
    error names the rule, not the memory."""
    tiny = models.ModelSpec("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16,
                            ffn_hidden=128, num_layers=8, vocab_size=256)  # fmt: skip
    with pytest.raises(PlanningError, match=r"num_layers=8 % \(pipeline=2 x virtual=3\)") as e:
        plan(tiny, hardware.cluster("h100"), global_batch=8, seq_len=64, mesh={"pipeline": 2},
             schedule="interleaved", virtual_stages=3)  # fmt: skip
    assert "fits in" not in str(e.value)


def test_the_generator_catches_candidates_the_rules_did_not_check(monkeypatch):
    """Planted bug: the search's rule check turned off. The generated problems then reach a
    candidate that the schedule refuses (an internal ValueError) or a plan that breaks a
    rule (the body's assertion)."""
    import hypothesis

    from shardfuse.planner import search

    monkeypatch.setattr(search, "parallelism_constraints", lambda *args, **kwargs: [])
    no_shrink = hypothesis.settings(settings(30), phases=(hypothesis.Phase.generate,))

    @no_shrink
    @given(problems(512))
    def drawn(problem):
        _plans_or_named_error(problem)

    with pytest.raises((AssertionError, ValueError)) as caught:
        drawn()
    assert not isinstance(caught.value, PlanningError)
