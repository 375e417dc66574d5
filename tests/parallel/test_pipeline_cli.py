"""`shardfuse pipeline`: grid, ticks, bubble line, in-flight figures, JSON, plot, bad input."""

import argparse
import json

import pytest

from shardfuse.parallel.pipeline import cli


def _run(capsys, *argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    status = cli.main(parser.parse_args(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


def test_grid_and_figures(capsys):
    status, out, _ = _run(capsys, "--schedule", "1f1b", "-p", "4", "-m", "8")
    assert status == 0
    assert "stage 3  .  .  . F0 B0 F1 B1" in out
    assert "ticks: 22" in out
    assert "bubble: 0.2727" in out
    assert "peak in-flight microbatches per stage: 4 3 2 1" in out


def test_interleaved_json(capsys):
    status, out, _ = _run(
        capsys, "--schedule", "interleaved", "-p", "4", "-m", "8", "-v", "2", "--json"
    )
    figures = json.loads(out)
    assert status == 0 and figures["v"] == 2 and figures["ticks"] == 38
    assert figures["bubble"] == pytest.approx(3 / 19)
    assert len(figures["actions"]) == 4 and len(figures["actions"][0]) == 38


def test_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    status, out, _ = _run(capsys, "--schedule", "zb-h1", "-p", "2", "-m", "4", "--plot", str(path))
    assert status == 0 and path.stat().st_size > 0 and "bubble: 0.0769" in out  # (p-1)/(3m+p-1)


def test_bad_input_exit_status_2(capsys):
    status, _, err = _run(capsys, "--schedule", "interleaved", "-p", "4", "-m", "6")
    assert status == 2
    assert "num_microbatches=6 must be a multiple of the number of pipeline stages p=4" in err


def test_lockstep_table(capsys):
    status, out, _ = _run(capsys, "--schedule", "1f1b", "-p", "4", "-m", "8", "--lockstep")
    assert status == 0
    assert "stage 3" in out and "F0/B0" in out
    assert "ticks: 14" in out  # m + 2 (p - 1)
    assert "lockstep work / ideal (B = 2 F): 1.3750" in out  # (m + p - 1) / m
    assert "peak in-flight microbatches per stage: 7 5 3 1" in out
