"""The planner's activation memory against Korthikanti et al. 2022's published accounting.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(arXiv:2205.05198), sec. 4 and Table 2: the activation memory of one GPT layer in bytes
(16-bit activations, 1-byte dropout masks; s sequence, b microbatch, h hidden, a heads,
t tensor-parallel size):

| configuration | bytes per layer |
|---|---|
| no parallelism | `sbh (34 + 5 a s / h)` |
| tensor parallel | `sbh (10 + 24 / t + 5 a s / (h t))` |
| tensor + sequence parallel | `sbh (34 / t + 5 a s / (h t))` |
| tensor parallel + selective recompute | `sbh (10 + 24 / t)` |
| tensor + sequence parallel + selective recompute | `sbh 34 / t` |
| full recompute | `2 sbh` |

For GPT-3 175B (a = 96, s = 2048, h = 12288) `5 a s / h = 80`, and selective recompute
keeps 34 of the 114: 70% less (sec. 4.2). With 1F1B the first pipeline stage holds `p`
microbatches of `L / p` layers, `L` layers' worth (sec. 4.2.3), and the interleaved
schedule `1 + (p - 1) / (p v)` times that. The planner keeps this accounting for
Megatron's systems (`Assumptions.saved_activations="korthikanti"`, the Megatron presets),
and shardfuse's own layers' for shardfuse (checked against compiled steps in
tests/planner/test_memory.py).
"""

import pytest

from shardfuse import hardware
from shardfuse.planner import Assumptions, Parallelism, estimate
from shardfuse.planner.memory import saved_elements_per_token
from shardfuse.planner.published import GPT_175B, RUNS

S, B, H, A = 2048, 1, GPT_175B.hidden, GPT_175B.heads
SBH = S * B * H
T = 8
TABLE2 = [  # (tensor parallel, sequence parallel, remat, bytes per layer)
    (1, False, "none", SBH * (34 + 5 * A * S / H)),
    (T, False, "none", SBH * (10 + 24 / T + 5 * A * S / (H * T))),
    (T, True, "none", SBH * (34 / T + 5 * A * S / (H * T))),
    (1, False, "selective", SBH * 34),
    (T, False, "selective", SBH * (10 + 24 / T)),
    (T, True, "selective", SBH * 34 / T),
    (1, False, "full", 2 * SBH),
]


def _layer_bytes(t, sequence_parallel, remat, **overrides):
    a = Assumptions.preset("megatron-2022", sequence_parallel=sequence_parallel, **overrides)
    per_token = saved_elements_per_token(GPT_175B, Parallelism.of(model=t, remat=remat), a, S)
    return S * B * (per_token["saved"] * a.activation_bytes + per_token["scores"])


@pytest.mark.parametrize("t, sequence_parallel, remat, published", TABLE2)
def test_gpt3_175b_layer_activations_are_table2(t, sequence_parallel, remat, published):
    assert _layer_bytes(t, sequence_parallel, remat) == pytest.approx(published, rel=1e-12)


def test_selective_recompute_saves_70_percent_on_gpt3():
    assert 5 * A * S / H == 80
    saved = 1 - _layer_bytes(1, False, "selective") / _layer_bytes(1, False, "none")
    assert saved == pytest.approx(0.70, abs=0.005)
    # shardfuse's own "selective" recomputes the norms and the MLP activation too: less
    shardfuse = _layer_bytes(1, False, "selective", saved_activations="shardfuse")
    assert shardfuse < _layer_bytes(1, False, "selective")


@pytest.mark.parametrize("name, factor", [("Korthikanti 175B", 1.0), ("MegaScale 175B", None)])
def test_first_stage_holds_the_papers_activations(name, factor):
    """The pipelined GPT-3 175B runs (t = 8, p = 8, sequence parallel, selective, b = 1):
    the first stage's activations are `L` layers of `sbh 34 / t` (1F1B), times
    `1 + (p - 1) / (p v)` interleaved, residuals stored (no stage recompute)."""
    from shardfuse.planner.published import parallelism_of

    run = next(r for r in RUNS if r.name == name)
    parallelism = parallelism_of(run)
    p, v = parallelism.pipeline, parallelism.options.virtual_stages
    if factor is None:
        factor = 1 + (p - 1) / (p * v)
    cluster = hardware.cluster(run.device, nodes=run.nodes)
    a = Assumptions.preset(run.preset)
    assert not a.pipeline_recompute
    e = estimate(run.model, cluster, parallelism, assumptions=a, global_batch=run.global_batch,
                 seq_len=run.seq_len)  # fmt: skip
    activations = {t.name: t.value for t in e.memory}["activations"]
    assert activations == pytest.approx(GPT_175B.num_layers * SBH * 34 / T * factor, rel=1e-12)
