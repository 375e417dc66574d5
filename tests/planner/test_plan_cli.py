"""`Plan` (its mesh and keyword arguments) and `shardfuse plan` end to end."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType

from shardfuse import hardware, models
from shardfuse.planner import MESH_AXES, cli, plan

REPO = Path(__file__).resolve().parents[2]
TINY = models.ModelSpec("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128,
                        num_layers=2, vocab_size=256)  # fmt: skip
EIGHT = hardware.cluster("h100", devices_per_node=8)


def _run(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.main(parser.parse_args(argv))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_plan_builds_its_mesh(axis_type):
    p = plan(TINY, EIGHT, global_batch=8, seq_len=64)[0]
    mesh = p.mesh(jax.devices()[:8], axis_types=(axis_type,) * len(MESH_AXES))
    assert mesh.axis_names == MESH_AXES and dict(mesh.shape) == p.mesh_shape
    assert set(mesh.axis_types) == {axis_type}
    with pytest.raises(ValueError, match="devices has 4 devices, the plan needs 8"):
        p.mesh(jax.devices()[:4])


def test_plan_run_options():
    """A plan converts itself into the run's options (what `parallelize` and the trainer take);
    the layers' options derive from them."""
    p = plan(TINY, EIGHT, global_batch=8, seq_len=64, zero=3, remat="full", mesh={"fsdp": 2})[0]
    options = p.run_options()
    assert (options.zero, options.remat) == (3, "full")
    assert options.replace(mesh_shape=None) == p.parallelism.options
    assert options.sequence_parallel == p.assumptions.sequence_parallel
    assert options.mesh_shape == p.mesh_shape
    layer = p.layer_options(dtype="bfloat16")
    assert layer == options.layer_options(None, dtype="bfloat16")
    assert (layer.model_axis, layer.sequence_axis, layer.data_axis, layer.fsdp_axis) == (
        "model", "sequence", "data", "fsdp"
    )  # fmt: skip
    assert (layer.zero, layer.remat) == (3, "full")


def test_cli_table_and_explain(capsys):
    argv = "--model llama3-70b --device h100 --nodes 8 --seq 8192 --batch 512 --top 3 --explain"
    assert _run(argv.split()) == 0
    out = capsys.readouterr().out
    assert "llama3-70b (70.6B parameters) on 8 x 8 H100 SXM" in out
    assert out.count("\n 1  ") == 1 and "\n 3  " in out and "\n 4  " not in out
    for term in ("compute", "elementwise", "parameters", "optimizer", "activations", "logits"):
        assert f"  {term} " in out
    # issue 27's bar: published BF16 dense runs on H100 report 38-55% MFU; the best
    # plan is at most 60%, with its communication terms shown (exposed/total)
    best = next(line for line in out.splitlines() if line.startswith(" 1  "))
    mfu = float(best.split("%")[0].split()[-1])
    assert 38.0 <= mfu <= 60.0, best
    assert "tensor_parallel " in best and "data_parallel " in best, best


def test_cli_json_round_trips(capsys):
    argv = "--model llama3-8b --device h100 --nodes 2 --seq 4096 --batch 64 --json --top 4"
    assert _run(argv.split()) == 0
    plans = json.loads(capsys.readouterr().out)
    assert len(plans) == 4
    times = [p["step_time_s"] for p in plans]
    assert times[0] <= min(times) * 1.001  # plans within 0.1% are tied (search.TIE_RULE)
    direct = plan("llama3-8b", hardware.cluster("h100", nodes=2), global_batch=64, seq_len=4096,
                  top_k=4)  # fmt: skip
    assert plans == [json.loads(json.dumps(p.to_dict())) for p in direct]
    for p in plans:
        assert set(p["mesh"]) == set(MESH_AXES) and 0 < p["mfu"] < 1
        assert p["memory_bytes"] <= p["memory_limit_bytes"]
        assert {"zero", "remat", "schedule", "num_microbatches"} <= set(p["options"])
        product = 1
        for size in p["mesh"].values():
            product *= size
        assert product == 16


def test_cli_custom_model_and_errors(capsys, tmp_path):
    spec = dict(name="mine", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=128,
                num_layers=2, vocab_size=256)  # fmt: skip
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec))
    assert _run(["--model", f"@{path}", "--seq", "64", "--batch", "8", "--dtype", "float32"]) == 0
    assert "mine (" in capsys.readouterr().out
    assert _run(["--model", "llama9", "--seq", "64", "--batch", "8"]) == 2
    assert "model 'llama9' is not one of" in capsys.readouterr().err
    assert _run(["--model", "llama3-405b", "--seq", "8192", "--batch", "8"]) == cli.EXIT_NO_PLAN
    assert "What would fit: more devices" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_as_a_command():
    """`python -m shardfuse plan` once the lead wires it; until then the module's main via -c."""
    code = (
        "import argparse, sys; from shardfuse.planner import cli; p = argparse.ArgumentParser(); "
        "cli.add_arguments(p); sys.exit(cli.main(p.parse_args(sys.argv[1:])))"
    )
    argv = ["--model", "llama3-70b", "--nodes", "8", "--seq", "8192", "--batch", "512", "--json"]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[0]["mesh"]


def test_cli_pins_every_field_and_records_assumptions(capsys):
    argv = (
        "--model llama3-8b --device h100 --nodes 2 --seq 4096 --batch 64 --json --top 3 "
        "--mesh pipeline=2,model=2 --microbatch-size 2 --schedule interleaved "
        "--virtual-stages 8 --zero 1 --remat selective --assumptions megatron-2022"
    )
    assert _run(argv.split()) == 0
    plans = json.loads(capsys.readouterr().out)
    for p in plans:
        assert p["mesh"]["pipeline"] == 2 and p["mesh"]["model"] == 2
        o = p["options"]
        assert (o["microbatch_size"], o["schedule"], o["virtual_stages"]) == (2, "interleaved", 8)
        assert (o["zero"], o["remat"]) == (1, "selective")
        a = p["assumptions"]
        assert a["name"] == "megatron-2022" and a["pipeline_executor"] == "async"
        assert 0 < a["compute_efficiency"] < 1 and "overlap" in a
        assert set(p["communication_total_s"]) >= {"tensor_parallel", "pipeline_p2p"}


def test_cli_table_explains_columns_ties_and_alternatives(capsys):
    argv = "--model llama3-8b --device h100 --nodes 2 --seq 4096 --batch 64 --top 3 --explain"
    assert _run(argv.split()) == 0
    out = capsys.readouterr().out
    assert "columns: # rank; mesh sizes" in out and "ties: plans within 0.1%" in out
    assert "why the next-best lost" in out and "\n  #2 " in out and "\n  #3 " in out
    assert "assumptions 'shardfuse': matmul efficiency 0.653" in out


def test_infeasible_pins_name_the_rule(capsys):
    # PaLM's 12-way model parallelism at s = 2048: plans without sequence parallelism ...
    palm = ("--model {\"name\":\"p\",\"hidden\":1536,\"heads\":48,\"kv_heads\":1,\"head_dim\":32,"
            "\"ffn_hidden\":6144,\"num_layers\":4,\"vocab_size\":1200} --device v4 "
            "--devices-per-node 24 --seq 2048 --batch 8 --mesh model=12")  # fmt: skip
    assert _run(palm.split() + ["--assumptions", "palm"]) == 0
    capsys.readouterr()
    # ... and with it the rule that fails is named
    assert _run(palm.split()) == cli.EXIT_NO_PLAN
    err = capsys.readouterr().err
    assert "seq_len=2048 % (sequence chunks=1 x model=12, sequence parallel) != 0" in err
    argv = "--model llama3-8b --seq 4096 --batch 64 --mesh pipeline=3".split()
    assert _run(argv) == cli.EXIT_NO_PLAN
    assert "rule: the mesh product is the device count" in capsys.readouterr().err
    argv = ("--model llama3-8b --seq 4096 --batch 64 --mesh pipeline=2,model=4 "
            "--schedule interleaved --virtual-stages 3").split()  # fmt: skip
    assert _run(argv) == cli.EXIT_NO_PLAN
    assert "num_layers=32 % (pipeline=2 x virtual=3) != 0" in capsys.readouterr().err


def test_the_names_of_earlier_releases_are_deprecated():
    """ "layout" is the ring's token order: the planner's `Layout` is `Parallelism` (the run's
    options embedded), `Plan.layout` `Plan.parallelism`, `layout_constraints`
    `parallelism_constraints`, `sf.train.layout_of` `parallelism_of`; the old names warn."""
    import shardfuse as sf
    from shardfuse.planner import Parallelism
    from shardfuse.train import TrainConfig

    with pytest.warns(DeprecationWarning, match="sf.planner.Layout is deprecated"):
        old = sf.planner.Layout(fsdp=2, zero=3, num_microbatches=2)
    assert old == Parallelism.of(fsdp=2, zero=3, num_microbatches=2)
    assert old.options == sf.parallel.RunOptions(zero=3, num_microbatches=2)
    p = plan(TINY, EIGHT, global_batch=8, seq_len=64)[0]
    with pytest.warns(DeprecationWarning, match="Plan.layout is deprecated"):
        assert p.layout is p.parallelism
    with pytest.warns(DeprecationWarning, match="layout_constraints is deprecated"):
        assert sf.planner.layout_constraints is sf.planner.parallelism_constraints
    config = TrainConfig(mesh={"data": 8})
    with pytest.warns(DeprecationWarning, match="sf.train.layout_of is deprecated"):
        assert sf.train.layout_of(config, 8) == sf.train.parallelism_of(config, 8)
