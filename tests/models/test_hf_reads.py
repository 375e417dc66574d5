"""Bytes `load_hf` reads, measured at the reader (`load_hf(on_read=...)`), per device.

Every slice copied out of a safetensors file is reported (`hf_reads.TensorRead`) with the
parameter block it builds; `hf_reads.bytes_per_device` charges each device the bytes of
its block. On every mesh each device's bytes equal its shard of each parameter (replicas
on the process share one read), the process reads each distinct block once and nothing
else, and a reader that reads more than its slice is caught. A tied checkpoint's
`lm_head.weight` check is the one read of no parameter. The accounting knows nothing of
the tensors' layout on disk, so a family made of one tensor per expert reports the same way.
"""

import dataclasses
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

import shardfuse as sf
from shardfuse.models import hf, hf_reads
from shardfuse.models.safetensors import SafetensorsDir, write_safetensors

SPEC = sf.models.ModelSpec("llama", hidden=64, heads=8, kv_heads=4, head_dim=8, ffn_hidden=96,
                           num_layers=2, vocab_size=128)  # fmt: skip
MESHES = {
    "data2_model4": ((2, 4), ("data", "model"), {}),
    "fsdp4_model2_zero3": ((4, 2), ("fsdp", "model"), dict(zero=3)),
    "pipeline2_data2_model2": ((2, 2, 2), ("pipeline", "data", "model"), dict(pipelined=True)),
}


def _checkpoint(directory, **changes):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    model = sf.models.Transformer(dataclasses.replace(SPEC, **changes), mesh=mesh,
                                  rngs=nnx.Rngs(0))  # fmt: skip
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = jax.random.key(zlib.crc32(".".join(map(str, path)).encode()))
        value.set_value(0.2 * jax.random.normal(key, value.shape, value.dtype))
    return hf.save_hf(model, directory, max_shard_bytes=40_000)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("llama"))


def _load(path, mesh_name):
    shape, names, options = MESHES[mesh_name]
    reads = []
    model = hf.load_hf(path, mesh=jax.make_mesh(shape, names), on_read=reads.append, **options)
    params = {".".join(map(str, p)): v[...] for p, v in hf._params(nnx.state(model, nnx.Param))}
    return reads, params


def _distinct_blocks_bytes(params):
    blocks = set()
    for name, value in params.items():
        for index in value.sharding.addressable_devices_indices_map(value.shape).values():
            blocks.add((name, hf_reads.block_of(index, value.shape), hf_reads.shard_bytes(value)))
    return sum(size for *_, size in blocks)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_each_device_reads_its_shard_of_each_parameter(checkpoint, mesh_name):
    reads, params = _load(checkpoint, mesh_name)
    per_device = hf_reads.bytes_per_device(reads, params)
    assert len(per_device) == int(np.prod(MESHES[mesh_name][0]))
    for device, per_parameter in per_device.items():
        assert set(per_parameter) == set(params)
        for name, got in per_parameter.items():
            assert got == hf_reads.shard_bytes(params[name]), (device, name, got)
    assert all(r.parameter is not None for r in reads)  # an untied head: no check reads
    assert sum(r.nbytes for r in reads) == _distinct_blocks_bytes(params)
    # a parameter made of several tensors reports each: kv_kernel's keys and values
    kv = [r for r in reads if r.parameter.endswith("kv_kernel")]
    assert {r.tensor.rsplit(".", 2)[-2] for r in kv} == {"k_proj", "v_proj"}


def test_a_reader_that_reads_more_than_its_slice_is_caught(checkpoint, monkeypatch):
    """A planted over-read (each slice of a 2-D tensor read with all its columns, then cut)
    leaves the values right and is seen only in the bytes."""
    real = SafetensorsDir.read

    def wide(self, name, index=()):
        shape, _ = self.info(name)
        if len(shape) == 2 and len(index) == 2:
            return real(self, name, (index[0], slice(None)))[:, index[1]]
        return real(self, name, index)

    monkeypatch.setattr(SafetensorsDir, "read", wide)
    reads, params = _load(checkpoint, "data2_model4")
    per_device = hf_reads.bytes_per_device(reads, params)
    over = {n for per in per_device.values() for n, got in per.items()
            if got != hf_reads.shard_bytes(params[n])}  # fmt: skip
    assert any(n.endswith("o_kernel") for n in over), over  # o_proj's columns are sliced


def test_a_tied_checkpoint_reads_the_head_once_to_check_it(tmp_path):
    """transformers may save a tied model's `lm_head.weight`; `load_hf` checks it equals the
    embedding (reading both whole, in every process), reported as reads of no parameter."""
    tied = _checkpoint(tmp_path / "tied", tied_embeddings=True)
    source = SafetensorsDir(tied)
    tensors = {name: source.read(name) for name in source.names()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    with_head = tmp_path / "with_head"
    with_head.mkdir()
    (with_head / "config.json").write_bytes((tied / "config.json").read_bytes())
    write_safetensors(with_head / "model.safetensors", tensors)
    reads, params = _load(with_head, "data2_model4")
    for device, per_parameter in hf_reads.bytes_per_device(reads, params).items():
        for name, got in per_parameter.items():
            assert got == hf_reads.shard_bytes(params[name]), (device, name, got)
    checks = [r for r in reads if r.parameter is None]
    assert {r.tensor for r in checks} == {"lm_head.weight", "model.embed_tokens.weight"}
    assert sum(r.nbytes for r in checks) == 2 * SPEC.vocab_size * SPEC.hidden * 4


def test_on_read_must_be_callable(checkpoint):
    with pytest.raises(ValueError, match="on_read=3 must be None or a callable"):
        hf.load_hf(checkpoint, mesh=jax.make_mesh((8,), ("data",)), on_read=3)
