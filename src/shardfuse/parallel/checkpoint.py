"""Checkpoints of a training run with orbax-checkpoint: save on one mesh, restore on any other.

A checkpoint holds the model's and the optimizer's state (every array, as
the global array it is, whatever its sharding), the step and the data
position (a JSON dict the caller chooses, e.g. the index of the next batch).
Restoring reads each array directly into the sharding the *current* model and
optimizer have: build them on the new mesh (same hyperparameters), then call
`restore`. A different mesh shape, axis set or process count is fine; orbax
reads only the pieces each process's devices need. A `Stack` with uneven
pipeline stages (`stage_layers`: zero rows pad the lighter stages) is saved one
row per layer, in order, and padded again on restore to the stages of the model
restored into, so a checkpoint moves between any stage layouts (pipeline 4 with
stages (3, 3, 2, 2) to pipeline 3 with (4, 3, 3), or to no pipeline).

Writes are atomic (orbax writes into a temporary directory and renames it
when every process has finished), so a run killed mid-save resumes from the
last complete checkpoint. Every process calls `save`/`restore`; orbax
coordinates them (one process writes the metadata, each writes the shards
it owns), so no two processes write the same file.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardfuse.layers.stack import Stack

__all__ = ["Checkpointer"]

# Meta key of checkpoints whose stacked layers are saved one row per layer, in order
# (checkpoints written before it hold a padded stack's rows as they were).
_LAYERS_IN_ORDER = "stacked_layers_in_order"


def _state_dict(model, optimizer) -> dict:
    """The arrays of `model` and `optimizer` as one pure nested dict."""
    state = {"model": nnx.to_pure_dict(nnx.state(model))}
    if optimizer is not None:
        state["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
    return state


def _abstract(tree):
    """ShapeDtypeStructs with the shardings of `tree`'s arrays (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _padded_stacks(model) -> dict:
    """`{key path of a Stack in model: the layer of each row (-1: padding)}` for every
    `Stack` whose rows are not its layers in order (uneven pipeline stages)."""
    stacks = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Stack):
            rows = node.layer_rows()
            if rows != list(range(node.num_layers)):
                stacks[tuple(str(k) for k in path)] = rows
    return stacks


def _row_map(key_path, leaf, stacks):
    """The row map of `leaf` if it is a padded stack's parameter, or mirrors one (optimizer
    moments hold the parameter's path after their own keys: `opt_state/0/mu/blocks/...`)."""
    keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in key_path)
    for stack, rows in stacks.items():
        n = len(stack)
        for start in range(len(keys) - n):
            if keys[start : start + n] == stack and getattr(leaf, "shape", ())[:1] == (len(rows),):
                return rows
    return None


def _unpadded_spec(x):
    """x's sharding with the layer axis whole: (mesh, spec)."""
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    return x.sharding.mesh, P(None, *spec[1:])


def _layers_in_order(state, stacks):
    """`state` with each padded stack's leaves as `[num_layers, ...]`, layers in order."""
    if not stacks:
        return state

    def one(key_path, x):
        rows = _row_map(key_path, x, stacks)
        if rows is None:
            return x
        mesh, spec = _unpadded_spec(x)
        order = np.array([rows.index(layer) for layer in range(max(rows) + 1)])
        whole = jax.device_put(x, NamedSharding(mesh, spec))
        return jax.jit(lambda w: w[order], out_shardings=NamedSharding(mesh, spec))(whole)

    return jax.tree_util.tree_map_with_path(one, state)


def _in_order_target(target, stacks):
    """The restore target of a checkpoint saved layers-in-order, for padded `target` leaves."""

    def one(key_path, x):
        rows = _row_map(key_path, x, stacks)
        if rows is None:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        mesh, spec = _unpadded_spec(x)
        shape = (max(rows) + 1, *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, target)


def _padded(restored, target, stacks):
    """Restored layers-in-order leaves back into the padded rows (zeros) of `target`'s."""

    def one(key_path, x, like):
        rows = _row_map(key_path, like, stacks)
        if rows is None:
            return x
        take = np.array([max(layer, 0) for layer in rows])
        real = np.array([layer >= 0 for layer in rows]).reshape((-1,) + (1,) * (x.ndim - 1))
        mesh, spec = _unpadded_spec(like)

        def pad(w):
            return jnp.where(real, w[take], jnp.zeros((), w.dtype))

        padded = jax.jit(pad, out_shardings=NamedSharding(mesh, spec))(x)
        return jax.device_put(padded, like.sharding)

    return jax.tree_util.tree_map_with_path(one, restored, target)


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
        meta = {"step": int(step), "data_position": data_position or {}, _LAYERS_IN_ORDER: True}
        state = _layers_in_order(_state_dict(model, optimizer), _padded_stacks(model))
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
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
        stacks = _padded_stacks(model)
        saved_meta = self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
        if not saved_meta["meta"].get(_LAYERS_IN_ORDER):
            stacks = {}  # an older checkpoint: its stacks' rows as they were saved
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(_in_order_target(target, stacks)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        arrays = _padded(restored["state"], target, stacks)
        for name, node in (("model", model), ("optimizer", optimizer)):
            if node is None:
                continue
            state = nnx.state(node)
            nnx.replace_by_pure_dict(state, arrays[name])
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
