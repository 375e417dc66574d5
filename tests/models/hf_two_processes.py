"""One process of a multi-process `load_hf` / `save_hf` run (tests/models/test_hf_processes.py).

Run by `examples/launch_local.py`, which sets the `jax.distributed` environment:

    hf_two_processes.py CHECKPOINT OUT MESH MAX_SHARD_BYTES [files]

loads CHECKPOINT on MESH (`mesh_of`), writes the logits of `TOKENS` and every parameter,
gathered, to OUT/p{process}.npz and the bytes this process read for each parameter's
shard on each of its devices to OUT/p{process}.json (with the shard files it wrote);
saves the model to OUT/export with shard files of at most MAX_SHARD_BYTES and loads that
export back at once (every file must be complete when `save_hf` returns on any process).
With `files`, only the load, the bytes read and the export: no logits, parameters or reload.
"""

import json
import sys

TOKENS = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]] * 4


def mesh_of(name):
    """`(mesh, load_hf options)`: `data2_model4` in the default device order (two processes:
    the data axis across them), `spread_fsdp4_model2` with every axis across the processes
    (`spread_devices`) and ZeRO-3. The same call in one process gives the same layout."""
    import jax
    from jax.sharding import AxisType, Mesh

    from shardfuse.parallel.distributed import spread_devices

    if name == "data2_model4":
        return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2), {}
    if name == "spread_fsdp4_model2":
        devices = spread_devices((4, 2))
        return Mesh(devices, ("fsdp", "model"), axis_types=(AxisType.Explicit,) * 2), {"zero": 3}
    raise ValueError(f"unknown mesh {name!r}")


def params_of(model):
    """Dot-joined parameter path -> the global array."""
    from flax import nnx

    from shardfuse.models import hf

    return {".".join(map(str, p)): v[...] for p, v in hf._params(nnx.state(model, nnx.Param))}


def read_report(reads, params):
    """`{"devices": {device id: {parameter: [bytes read, shard bytes]}}, "total": bytes read,
    "blocks": bytes of the distinct blocks this process holds}`."""
    from shardfuse.models import hf_reads

    devices = hf_reads.bytes_per_device(reads, params)
    blocks = set()
    for name, value in params.items():
        for index in value.sharding.addressable_devices_indices_map(value.shape).values():
            block = hf_reads.block_of(index, value.shape)
            blocks.add((name, block, hf_reads.shard_bytes(value)))
    return {
        "devices": {
            str(d.id): {n: [got, hf_reads.shard_bytes(params[n])] for n, got in per.items()}
            for d, per in devices.items()
        },
        "total": sum(r.nbytes for r in reads),
        "blocks": sum(size for _, _, size in blocks),
    }


def main(argv):
    from shardfuse.parallel import distributed

    distributed.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from shardfuse.models import hf

    checkpoint, out, mesh_name, max_shard_bytes, *files_only = argv
    mesh, options = mesh_of(mesh_name)
    reads = []
    model = hf.load_hf(checkpoint, mesh=mesh, on_read=reads.append, **options)
    params = params_of(model)
    me = jax.process_index()
    report = read_report(reads, params)
    if not files_only:
        logits = model(jnp.asarray(TOKENS, jnp.int32))
        gathered = {n: multihost_utils.process_allgather(v, tiled=True) for n, v in params.items()}
        logits = multihost_utils.process_allgather(logits, tiled=True)
        np.savez(f"{out}/p{me}.npz", logits=np.asarray(logits), **gathered)
    written, write = [], hf.write_safetensors
    hf.write_safetensors = lambda path, *args, **kw: (
        written.append(path.name),
        write(path, *args, **kw),
    )
    hf.save_hf(model, f"{out}/export", max_shard_bytes=int(max_shard_bytes))
    hf.write_safetensors = write
    report["written"] = written
    if not files_only:
        again = params_of(hf.load_hf(f"{out}/export", mesh=mesh, **options))
        report["reloaded_differs"] = [
            n
            for n, v in again.items()
            if not all(
                np.array_equal(np.asarray(a.data), np.asarray(b.data))
                for a, b in zip(v.addressable_shards, params[n].addressable_shards, strict=True)
            )
        ]
    with open(f"{out}/p{me}.json", "w") as f:
        json.dump(report, f)
    print(f"process {me} of {jax.process_count()}: done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
