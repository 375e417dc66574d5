"""Multi-host runs on JAX's own runtime: `jax.distributed`, one mesh over every process.

shardfuse adds no distributed layer of its own. `initialize` calls
`jax.distributed.initialize` (from arguments, or from the environment
variables JAX and cluster managers set), and picks the gloo CPU collectives
when the devices are CPUs so that a mesh can span processes. `global_batch`
builds a global array of which each process loads only the rows its own
devices hold.

Launching: one process per host (GPU/TPU) or several local processes for
testing (`examples/launch_local.py`); every process runs the same program.
"""

import os

import jax
import numpy as np

__all__ = ["initialize", "global_batch", "is_primary", "spread_devices"]

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize(coordinator: str | None = None, num_processes=None, process_id=None) -> bool:
    """Joins a multi-process run; returns True if one was joined.

    Must run before anything touches a JAX backend. With no arguments it
    reads `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`
    (all three, or none); without them, inside a SLURM job of several tasks
    it lets `jax.distributed.initialize()` read SLURM's variables; otherwise
    it does nothing (a single-process run). On CPU it selects the gloo collectives,
    which cross-process CPU meshes need.

    Args:
      coordinator: "host:port" of process 0.
      num_processes: total number of processes.
      process_id: this process's index, 0..num_processes-1.

    Raises:
      ValueError: some but not all of the three are given, or they are out of range.

    Example usage::

      >>> from shardfuse.parallel import distributed
      >>> distributed.initialize()  # no arguments, no environment: single process
      False
    """
    if coordinator is None and num_processes is None and process_id is None:
        found = [os.environ.get(name) for name in _ENV]
        if not any(found):
            if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:  # JAX reads SLURM's variables
                _use_gloo_on_cpu()
                jax.distributed.initialize()
                return True
            return False
        if not all(found):
            raise ValueError(
                f"set all of {_ENV} or none; got "
                + ", ".join(f"{n}={v!r}" for n, v in zip(_ENV, found, strict=True))
            )
        coordinator, num_processes, process_id = found[0], int(found[1]), int(found[2])
    if coordinator is None or num_processes is None or process_id is None:
        raise ValueError(
            "coordinator, num_processes and process_id go together; got "
            f"{coordinator=}, {num_processes=}, {process_id=}"
        )
    num_processes, process_id = int(num_processes), int(process_id)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    if ":" not in coordinator:
        raise ValueError(f"coordinator={coordinator!r} must be 'host:port'")
    _use_gloo_on_cpu()
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return True


def _use_gloo_on_cpu():
    """CPU meshes across processes need the gloo collectives (harmless on GPU/TPU runs)."""
    platforms = os.environ.get("JAX_PLATFORMS", "") or jax.config.jax_platforms or ""
    if platforms in ("", "cpu") or "cpu" in platforms.split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_primary() -> bool:
    """True on process 0 (the one that prints and writes logs)."""
    return jax.process_index() == 0


def global_batch(load_rows, global_shape, sharding):
    """A global array of `global_shape` on `sharding`; each process loads only its rows.

    Args:
      load_rows: `load_rows(start, stop) -> np.ndarray` of shape
        `(stop - start, *global_shape[1:])`: rows `start..stop-1` of the
        global batch. Called only for rows that this process's devices hold.
      global_shape: shape of the global batch (rows first).
      sharding: a `jax.sharding.Sharding` (e.g. `NamedSharding(mesh, P(("data", "fsdp")))`).

    Returns:
      A `jax.Array` of `global_shape` with `sharding`.

    Example usage::

      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from shardfuse.parallel.distributed import global_batch
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> rows = lambda start, stop: np.arange(start, stop)[:, None] * np.ones((1, 4), np.int32)
      >>> x = global_batch(rows, (16, 4), NamedSharding(mesh, P("data")))
      >>> x.shape, int(np.asarray(x)[5, 0])
      ((16, 4), 5)
    """
    cache = {}

    def piece(index):
        rows = index[0]
        start, stop, _ = rows.indices(global_shape[0])
        if (start, stop) not in cache:
            data = np.asarray(load_rows(start, stop))
            want = (stop - start, *global_shape[1:])
            if data.shape != want:
                raise ValueError(
                    f"load_rows({start}, {stop}) returned shape {data.shape}; want {want}"
                )
            cache[(start, stop)] = data
        return cache[(start, stop)][(slice(None), *index[1:])]

    return jax.make_array_from_callback(tuple(global_shape), sharding, piece)


def spread_devices(shape, devices=None) -> np.ndarray:
    """Devices arranged as `shape` so that every axis of size > 1 crosses processes.

    A checkerboard: the device at mesh position `(i, j, ...)` belongs to
    process `(i + j + ...) % num_processes`. Useful to test that nothing
    assumes an axis stays inside one host (the default `jax.make_mesh` order
    keeps the inner axes on one host, which is what real runs want).

    Args:
      shape: the mesh shape.
      devices: the devices (default `jax.devices()`).

    Returns:
      An object array of devices of `shape`, for `jax.sharding.Mesh(devices, names)`.

    Raises:
      ValueError: the checkerboard does not give every process the same
        number of positions (no axis length is a multiple of the process count).

    Example usage::

      >>> import jax
      >>> from shardfuse.parallel.distributed import spread_devices
      >>> spread_devices((2, 4)).shape
      (2, 4)
    """
    devices = list(jax.devices() if devices is None else devices)
    processes = sorted({d.process_index for d in devices})
    by_process = {
        p: sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
        for p in processes
    }
    count = len(processes)
    grid = np.empty(tuple(shape), dtype=object)
    if grid.size != len(devices):
        raise ValueError(f"shape {tuple(shape)} has {grid.size} positions; {len(devices)} devices")
    taken = dict.fromkeys(processes, 0)
    for index in np.ndindex(*grid.shape):
        process = processes[sum(index) % count]
        if taken[process] >= len(by_process[process]):
            raise ValueError(f"shape {tuple(shape)} cannot be spread evenly over {count} processes")
        grid[index] = by_process[process][taken[process]]
        taken[process] += 1
    return grid
