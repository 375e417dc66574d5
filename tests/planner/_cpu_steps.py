"""Times the training example's step on several meshes of the 8 CPU devices (a subprocess).

Run by tests/planner/test_calibration.py as `python _cpu_steps.py '<json>'`
with `{"meshes": [...], "rounds": R, "probe": bool}` and glibc told to keep
its heap (`ALLOCATOR_ENV`); prints one JSON line: `{"seconds": [...], "cpu":
<calibrate.measure_cpu>, "wall_s": {"compile", "rounds", "probe"}}`.
Seconds per step are the process's CPU seconds over the cores (the host's
other load does not count), the minimum over `rounds` rounds that time
every mesh once, all meshes compiled first.
"""

import json
import sys
import time

# glibc returns a freed block above its mmap threshold (at most 32 MiB) to the
# kernel at once, so an XLA:CPU step whose temp buffer is larger page-faults
# and zeroes all of it again on every call (perf: 50-70 ms of a 0.5 s step,
# in the kernel's clear_page and do_anonymous_page). Accelerator runtimes keep
# their arenas (XLA's BFC allocator); so does glibc told not to use mmap and
# not to trim the heap.
ALLOCATOR_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


def main(request):
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from shardfuse.models import ModelSpec
    from shardfuse.parallel import RunOptions
    from shardfuse.planner.calibrate import measure_cpu
    from shardfuse.train import TrainConfig, Trainer

    cores = request["cores"]
    clock = time.perf_counter()
    walls = {}
    runs = []
    for mesh in request["meshes"]:
        zero = 3 if mesh.get("fsdp", 1) > 1 else 0
        model = ModelSpec.tiny(**request["model"])
        config = TrainConfig(model=model, mesh=mesh, options=RunOptions(zero=zero),
                             **request["config"])  # fmt: skip
        trainer = Trainer(config, log=lambda line: None)
        step, args = trainer.step_call()
        with jax.set_mesh(trainer.mesh):
            jax.block_until_ready(step(*args))  # compiles
        runs.append((trainer.mesh, step, args))
    walls["compile"] = time.perf_counter() - clock
    best = [float("inf")] * len(runs)
    for _ in range(request["rounds"]):
        for i, (mesh, step, args) in enumerate(runs):
            with jax.set_mesh(mesh):
                start = time.process_time()
                jax.block_until_ready(step(*args))
                best[i] = min(best[i], (time.process_time() - start) / cores)
    walls["rounds"] = time.perf_counter() - clock - walls["compile"]
    cpu = measure_cpu(8, cores=cores) if request.get("probe") else None
    walls["probe"] = time.perf_counter() - clock - walls["compile"] - walls["rounds"]
    print(json.dumps({"seconds": best, "cpu": cpu, "wall_s": walls}))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
