"""`sf.profile` and `shardfuse profile`: categories that sum to the step, collectives named."""

import argparse
import doctest
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import shardfuse as sf
from shardfuse.planner import Parallelism
from shardfuse.profile import api, hlo, report, timeline
from shardfuse.profile import cli as profile_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _assert_sums_to_step(p):
    assert abs(p.total_s - p.trace_step_time_s) <= 1e-9 * max(1.0, p.trace_step_time_s)
    # the categories against the step time measured by the wall clock
    assert abs(p.total_s - p.step_time_s) <= 0.10 * p.step_time_s, (p.total_s, p.step_time_s)
    assert all(v >= 0 for v in p.categories.values())


def test_split_window_labels_every_instant_once():
    intervals = [
        (0.0, 2.0, "matmul"),
        (1.0, 3.0, "all-reduce"),  # 1 s under the matmul, 1 s exposed
        (2.5, 3.5, "other"),  # hides the last 0.5 s of the all-reduce
        (4.0, 6.0, "control"),  # a loop with one op inside
        (4.5, 5.0, "attention"),
        (5.5, 9.0, "collective-permute"),  # clipped at the window's end
    ]
    labels, hidden = timeline.split_window(intervals, 0.0, 7.0)
    assert sum(labels.values()) == pytest.approx(7.0)
    assert labels["matmul"] == 2.0 and labels["attention"] == 0.5
    assert labels["all-reduce"] == pytest.approx(0.5) and hidden["all-reduce"] == 1.5
    assert labels["other"] == pytest.approx(1.0 + 1.0)  # 2.5..3.5 op, 4..4.5 + 5..5.5 loop
    assert labels["collective-permute"] == pytest.approx(1.5)
    assert labels["idle"] == pytest.approx(0.5)  # 3.5..4.0


def test_classify_name():
    assert hlo.classify_name("reduce_scatter.3") == "reduce-scatter"
    assert hlo.classify_name("all-gather-start.1") == "all-gather"
    assert hlo.classify_name("ppermute.12") == "collective-permute"
    assert hlo.classify_name("while.4") == "control"
    assert hlo.classify_name("cudnn_flash_attention") == "attention"
    assert hlo.classify_name("copy_add_fusion") == "other"


def test_profile_shard_map_step_names_its_collectives():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def per_shard(x, w):
        y = jnp.tanh(x @ w)  # [M, C] @ [C, N]
        y = jax.lax.psum(y, "model")
        y = y + jax.lax.ppermute(y, "model", ring)
        return jax.lax.all_gather(y, "data", tiled=True).sum()

    step = jax.jit(
        jax.shard_map(
            per_shard, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False
        )
    )
    x = jax.device_put(jnp.ones((64, 128)), jax.NamedSharding(mesh, P("data")))
    w = jnp.ones((128, 128)) / 128
    p = sf.profile(
        step, x, w, steps=3, warmup=1, predicted={"compute": 1e-3, "data_parallel": 2e-3}
    )
    _assert_sums_to_step(p)
    assert p.devices == 8 and p.steps == 3 and p.attributed_by == "program"
    assert {"all-reduce", "all-gather", "collective-permute"} <= set(p.collectives)
    assert p.categories["matmul"] > 0
    assert any(op["category"] == "matmul" for op in p.top_ops)
    table = p.table()
    for text in ("compute: matmul", "comm exposed: all-reduce", "collectives seen:", "planner"):
        assert text in table
    payload = json.loads(json.dumps(p.to_json()))
    assert payload["total_s"] == pytest.approx(p.total_s)
    assert os.path.isfile(p.trace_file) and p.trace_file.startswith(p.trace_dir)


def test_profile_of_an_expert_parallel_moe_names_the_all_to_all():
    """The MoE layer on expert=4 x data=2: its dispatch and combine are named all-to-all,
    its grouped matmuls (a custom call on the CPU) count as matmul."""
    from flax import nnx

    mesh = jax.make_mesh((4, 2), ("expert", "data"))
    moe = sf.layers.ParallelMoE(16, 32, num_experts=8, top_k=2, mesh=mesh, rngs=nnx.Rngs(0))
    graph, state, rest = nnx.split(moe, nnx.Param, ...)

    @jax.jit
    def step(state, x):
        def loss(state):
            return jnp.sum(nnx.merge(graph, state, rest).forward_with_stats(x)[0] ** 2)

        return jax.grad(loss)(state)

    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (8, 16, 16)),
        jax.NamedSharding(mesh, P(("data", "expert"))),
    )
    with jax.set_mesh(mesh):
        p = sf.profile(step, state, x, steps=2, warmup=1)
    _assert_sums_to_step(p)
    assert "all-to-all" in p.collectives and p.categories["all-to-all"] >= 0
    assert "all-to-all" in p.table()
    scopes = {op["scope"] for op in p.top_ops if op["category"] == "all-to-all"}
    assert any("expert_dispatch" in s for s in scopes), scopes  # the op and where it is from
    assert any("expert_combine" in s for s in scopes), scopes
    assert p.categories["matmul"] > 0


def test_advice_rules_fire():
    step = 1.0
    fields = dict(
        categories={**dict.fromkeys(timeline.LABELS, 0.0), "idle": 0.5},
        overlapped={},
        collectives={"all-reduce": {"calls": 1, "seconds": 0.25}},
        device_busy_s={"0": 0.5, "1": 0.5, "2": 0.9, "3": 0.9},
        trace_step_time_s=step,
    )
    parallelism = Parallelism.of(pipeline=2, model=16, num_microbatches=8)
    lines = report.advice(fields, parallelism, devices_per_node=8, seq_len=1024)
    text = "\n".join(lines)
    assert "all-reduce takes 25% of the step" in text
    assert "tensor parallelism model=16 spans more than one node" in text
    assert "8 microbatches of 64 tokens per device" in text
    assert "pipeline stage 1 is busy 1.80x" in text
    assert "devices idle 50%" in text
    fields["collectives"] = {"all-reduce": {"calls": 1, "seconds": 0.1}}
    fields["categories"]["idle"] = 0.1
    quiet = report.advice(fields, Parallelism.of(data=2, model=4), devices_per_node=8, seq_len=1024)
    assert quiet == ()


def test_profile_rejects_bad_counts():
    with pytest.raises(ValueError, match="steps=0"):
        sf.profile(jax.jit(jnp.sin), jnp.ones(2), steps=0)
    with pytest.raises(ValueError, match="warmup=-1"):
        sf.profile(jax.jit(jnp.sin), jnp.ones(2), warmup=-1)
    # layout= (the planner's layout of earlier releases) is a deprecated keyword: parallelism=
    with pytest.warns(DeprecationWarning, match=r"profile\(layout=\.\.\.\) is deprecated"):
        with pytest.raises(ValueError, match="steps=0"):
            sf.profile(jax.jit(jnp.sin), jnp.ones(2), steps=0, layout=Parallelism())


def test_cli_profiles_train_lm_on_data2_model4(tmp_path, capsys):
    """The done-when: the table on `examples/train_lm.py --mesh data=2,model=4`."""
    parser = argparse.ArgumentParser()
    profile_cli.add_arguments(parser)
    out = tmp_path / "profile.json"
    script = os.path.join(REPO, "examples", "train_lm.py")
    flags = ["--mesh", "data=2,model=4", "--layers", "1", "--seq-len", "32"]
    args = parser.parse_args(
        ["--steps", "2", "--warmup", "1", "--trace-dir", str(tmp_path / "trace")]
        + ["--json", str(out), "--", script, *flags]
    )
    assert profile_cli.main(args) == 0
    printed = capsys.readouterr().out
    for text in ("compute: matmul", "compute: attention", "idle", "total (sum of the above)"):
        assert text in printed
    assert "collectives seen: all-reduce" in printed and "collective-permute" in printed
    assert "planner prediction" in printed and "tensor_parallel" in printed
    payload = json.loads(out.read_text())
    assert abs(payload["total_s"] - payload["step_time_s"]) <= 0.10 * payload["step_time_s"]
    assert {"all-reduce", "collective-permute"} <= set(payload["collectives"])
    assert payload["predicted"]["compute"] > 0
    assert any(f.endswith(".xplane.pb") for _, _, fs in os.walk(tmp_path / "trace") for f in fs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["profile", "--steps", "0"], "--steps=0 must be >= 1"),
        (["profile", "--", "no_such_script.py"], "no_such_script.py"),
    ],
)
def test_cli_error_is_one_line(argv, message):
    result = subprocess.run(
        [sys.executable, "-m", "shardfuse", "--cpu-devices", "1", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr


@pytest.mark.parametrize("module", [api, hlo, timeline], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    assert doctest.testmod(module).failed == 0
