"""`load_hf` and `save_hf` in two processes (`jax.distributed` on loopback) as in one.

Two processes of four CPU devices each (`examples/launch_local.py`, gloo collectives)
load a checkpoint on a mesh spanning both, compute logits and save the model again
(`tests/models/hf_two_processes.py`). One process of eight devices does the same here.
Then: the exports are the same files byte for byte (`config.json`, the index, every shard
file, written by whichever process owned it), the parameters are bitwise the same, the
logits are the same, each process read for each of its devices exactly that device's
shard of each parameter (and every distinct block once), and each process loads the
export back at once, bitwise (`save_hf` returns when every process's files are written).
The data2_model4 mesh splits the data axis over the processes; the spread one puts
every axis across them, with ZeRO-3.
"""

import json
import pathlib
import subprocess
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.models import hf
from tests.models import hf_two_processes as worker

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCH = str(ROOT / "examples" / "launch_local.py")
SPEC = sf.models.ModelSpec("llama", hidden=64, heads=8, kv_heads=4, head_dim=8, ffn_hidden=96,
                           num_layers=2, vocab_size=128)  # fmt: skip
MAX_SHARD_BYTES = 40_000  # about ten shard files: both processes write some


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Llama checkpoint of random parameters (written by one process on one device)."""
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    model = sf.models.Transformer(SPEC, mesh=mesh, rngs=nnx.Rngs(0))
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = jax.random.key(zlib.crc32(".".join(map(str, path)).encode()))
        value.set_value(0.2 * jax.random.normal(key, value.shape, value.dtype))
    return hf.save_hf(model, tmp_path_factory.mktemp("source"))


def _two_processes(checkpoint, out, mesh_name, *extra):
    command = [sys.executable, LAUNCH, "--num-processes=2", "--devices-per-process=4",
               "--timeout=240", "--", sys.executable, str(pathlib.Path(worker.__file__)),
               str(checkpoint), str(out), mesh_name, str(MAX_SHARD_BYTES), *extra]  # fmt: skip
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return time.monotonic() - start


def _check_files_and_reads(out, single, params):
    """The export in `out` is `single`, byte for byte, each shard file written by one process;
    each process read exactly each of its devices' shards, each distinct block once."""
    export = out / "export"
    names = sorted(p.name for p in single.iterdir())
    assert sorted(p.name for p in export.iterdir()) == names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 2
    for name in names:
        assert (export / name).read_bytes() == (single / name).read_bytes(), name
    reports = [json.loads((out / f"p{p}.json").read_text()) for p in (0, 1)]
    written = [r["written"] for r in reports]
    assert all(written) and not set(written[0]) & set(written[1])  # both wrote, never the same
    assert sorted(written[0] + written[1]) == shards
    for process, report in enumerate(reports):
        assert len(report["devices"]) == 4
        for device, per_parameter in report["devices"].items():
            assert set(per_parameter) == set(params)
            for name, (read, shard) in per_parameter.items():
                assert read == shard, (process, device, name, read, shard)
        assert report["total"] == report["blocks"]  # each distinct block read once
    return reports


@pytest.mark.slow  # 54 s on 2 cores, 34 s of it the two processes (startup, the gathers)
@pytest.mark.timeout(300)
def test_two_processes_write_the_files_one_process_writes(checkpoint, tmp_path):
    """The shorter variant: load, bytes read and export (no logits, no reload). The default
    suite measures the bytes read in one process (test_hf_reads.py)."""
    seconds = _two_processes(checkpoint, tmp_path, "data2_model4", "files")
    mesh, options = worker.mesh_of("data2_model4")
    model = hf.load_hf(checkpoint, mesh=mesh, **options)
    single = hf.save_hf(model, tmp_path / "single", max_shard_bytes=MAX_SHARD_BYTES)
    _check_files_and_reads(tmp_path, single, worker.params_of(model))
    print(f"two processes, files only: {seconds:.0f} s")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh_name", ["data2_model4", "spread_fsdp4_model2"])
def test_two_processes_save_and_load_as_one_process(checkpoint, tmp_path, mesh_name):
    seconds = _two_processes(checkpoint, tmp_path, mesh_name)
    mesh, options = worker.mesh_of(mesh_name)
    model = hf.load_hf(checkpoint, mesh=mesh, **options)
    logits = np.asarray(model(jnp.asarray(worker.TOKENS, jnp.int32)))
    params = {n: np.asarray(v) for n, v in worker.params_of(model).items()}
    single = hf.save_hf(model, tmp_path / "single", max_shard_bytes=MAX_SHARD_BYTES)
    reports = _check_files_and_reads(tmp_path, single, params)
    for process, report in enumerate(reports):
        got = np.load(tmp_path / f"p{process}.npz")
        # the same program on the same shards; gloo's sums over the model axis happen to
        # add in the same order as one process's: bitwise
        np.testing.assert_array_equal(got["logits"], logits)
        assert set(got.files) == {"logits", *params}
        for name, value in params.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
        assert report["reloaded_differs"] == []
    print(f"two processes ({mesh_name}): {seconds:.0f} s")
