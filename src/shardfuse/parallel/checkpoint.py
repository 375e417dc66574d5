"""Checkpoints of a training run with orbax-checkpoint: save on one mesh, restore on any other.

A checkpoint holds the model's and the optimizer's state (every array, as
the global array it is, whatever its sharding), the step and the data
position (a JSON dict the caller chooses, e.g. the index of the next batch).
Restoring reads each array directly into the sharding the *current* model and
optimizer have: build them on the new mesh (same hyperparameters), then call
`restore`. A different mesh shape, axis set or process count is fine; orbax
reads only the pieces each process's devices need.

Writes are atomic (orbax writes into a temporary directory and renames it
when every process has finished), so a run killed mid-save resumes from the
last complete checkpoint. Every process calls `save`/`restore`; orbax
coordinates them (one process writes the metadata, each writes the shards
it owns), so no two processes write the same file.
"""

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["Checkpointer"]


def _state_dict(model, optimizer) -> dict:
    """The arrays of `model` and `optimizer` as one pure nested dict."""
    state = {"model": nnx.to_pure_dict(nnx.state(model))}
    if optimizer is not None:
        state["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
    return state


def _abstract(tree):
    """ShapeDtypeStructs with the shardings of `tree`'s arrays (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    """Saves and restores `(model, optimizer, step, data position)` in `directory`.

    Args:
      directory: where the checkpoints go (one subdirectory per step); created if needed.
      every: `save(step, ...)` writes only when `step % every == 0` (or `force=True`).
      keep: how many of the newest checkpoints to keep (None: all).
      asynchronous: write in a background thread (the next training step runs
        meanwhile); `wait()` or `close()` blocks until the writes are done.

    Example usage::

      >>> import tempfile, jax, numpy as np, optax
      >>> from flax import nnx
      >>> import shardfuse as sf
      >>> from shardfuse.parallel.checkpoint import Checkpointer
      >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
      >>> model = sf.layers.ColumnParallelLinear(8, 16, mesh=mesh, rngs=nnx.Rngs(0))
      >>> opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), every=1)
      >>> ckpt.save(1, model, opt, data_position={"batch": 1}, force=True)
      True
      >>> other = jax.make_mesh((4, 2), ("data", "model"))  # restore on another mesh
      >>> new = sf.layers.ColumnParallelLinear(8, 16, mesh=other, rngs=nnx.Rngs(1))
      >>> new_opt = nnx.Optimizer(new, optax.adam(1e-3), wrt=nnx.Param)
      >>> ckpt.restore(new, new_opt)
      {'step': 1, 'data_position': {'batch': 1}}
      >>> np.array_equal(new.kernel[...], model.kernel[...]), new.kernel.sharding.spec
      (True, P(None, 'model'))
      >>> ckpt.close()
    """

    def __init__(self, directory, *, every: int = 100, keep: int | None = 3, asynchronous=True):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} must be an int >= 1 (save every `every` steps)")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep={keep!r} must be None (keep all) or an int >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=bool(asynchronous),
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, model, optimizer=None, *, data_position=None, force=False) -> bool:
        """Writes a checkpoint of `step` if `step % every == 0` or `force`; returns whether it did.

        Args:
          step: the number of optimizer steps taken so far.
          model: an NNX module (its whole state is saved).
          optimizer: an `nnx.Optimizer` or None.
          data_position: JSON-serializable dict saying where the data stream is.
          force: save whatever the step.
        """
        if not force and step % self.every:
            return False
        if step in self._manager.all_steps():
            return False
        meta = {"step": int(step), "data_position": data_position or {}}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(_state_dict(model, optimizer)),
            meta=ocp.args.JsonSave(meta),
        )
        return bool(self._manager.save(int(step), args=args, force=True))

    def restore(self, model, optimizer=None, *, step: int | None = None) -> dict:
        """Loads checkpoint `step` (default: the latest) into `model` and `optimizer` in place.

        Each array is read straight into the sharding that array has in the
        given model/optimizer (their mesh may differ from the one that saved).

        Returns:
          `{"step": ..., "data_position": ...}` as saved.

        Raises:
          FileNotFoundError: there is no complete checkpoint (or not `step`).
        """
        steps = self._manager.all_steps()
        if step is None:
            step = self._manager.latest_step()
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"no complete checkpoint {'' if step is None else f'of step {step} '}in "
                f"{self.directory} (steps there: {sorted(steps)})"
            )
        target = _state_dict(model, optimizer)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_abstract(target)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        for name, node in (("model", model), ("optimizer", optimizer)):
            if node is None:
                continue
            state = nnx.state(node)
            nnx.replace_by_pure_dict(state, restored["state"][name])
            nnx.update(node, state)
        meta = dict(restored["meta"])
        return {"step": int(meta["step"]), "data_position": meta.get("data_position", {})}

    def wait(self):
        """Blocks until every pending (asynchronous) write has finished."""
        self._manager.wait_until_finished()

    def close(self):
        """Waits for pending writes and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()
