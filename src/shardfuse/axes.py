"""Mesh axis names: the one home of the names the library uses by default, and their order.

A data module at the bottom of the package (it imports nothing): the layers,
`shardfuse.parallel`, the collectives' global wrappers and the planner read
their default axis names here. Every keyword that names an axis
(`model_axis=`, `sequence_axis=`, ...) accepts any name of the mesh; these
are only the defaults.

- `PIPELINE` ("pipeline"): the layers, as pipeline stages (`sf.layers.Stack(layer_axis=)`,
  `sf.parallel.Pipeline`);
- `DATA` ("data"): the batch (data parallelism: every layer, `sf.parallel.accumulate`);
- `FSDP` ("fsdp"): the batch too, and under ZeRO the training state (`zero=`);
- `EXPERT` ("expert"): the experts of a mixture-of-experts layer (expert parallelism,
  `sf.layers.ParallelMoE`); everywhere else it is one more data axis: tokens (the batch)
  are split over it too, so that the layers outside the experts (attention, norms, dense
  MLPs) do not compute the same tokens once per expert shard;
- `SEQUENCE` ("sequence"): the sequence (context parallelism: ring attention);
- `MODEL` ("model"): heads and hidden units (tensor parallelism; Megatron sequence
  parallelism shards the sequence over it too).

`MESH_AXES` is their order on a mesh, outermost to innermost: the most
communication-heavy axis (`model`) on the closest devices.

Example usage::

  >>> from shardfuse import axes
  >>> axes.MESH_AXES
  ('pipeline', 'data', 'fsdp', 'expert', 'sequence', 'model')
  >>> axes.BATCH_AXES  # the axes a batch is split over
  ('data', 'fsdp', 'expert')
"""

PIPELINE = "pipeline"
DATA = "data"
FSDP = "fsdp"
EXPERT = "expert"
SEQUENCE = "sequence"
MODEL = "model"

MESH_AXES = (PIPELINE, DATA, FSDP, EXPERT, SEQUENCE, MODEL)  # outermost -> innermost
# the axes a layer's activations and weights use
LAYER_AXES = (DATA, FSDP, EXPERT, SEQUENCE, MODEL)
# the data-parallel axes, in the order a batch entry lists them (expert: outside the experts)
BATCH_AXES = (DATA, FSDP, EXPERT)


def parse_mesh(text: str) -> dict:
    """`"data=2,model=4"` -> `{"data": 2, "model": 4}`: mesh sizes as a command line gives them.

    Raises:
      ValueError: an entry that is not `AXIS=SIZE` with AXIS in `MESH_AXES` and SIZE >= 1.

    Example usage::

      >>> from shardfuse import axes
      >>> axes.parse_mesh("pipeline=2, model=4")
      {'pipeline': 2, 'model': 4}
      >>> axes.parse_mesh("expert=4,data=2")
      {'expert': 4, 'data': 2}
    """
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = (s.strip() for s in part.partition("="))
        if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh entry {part!r} must be AXIS=SIZE with AXIS in {MESH_AXES}")
        sizes[name] = int(value)
    return sizes


__all__ = [
    "BATCH_AXES",
    "DATA",
    "EXPERT",
    "FSDP",
    "LAYER_AXES",
    "MESH_AXES",
    "MODEL",
    "PIPELINE",
    "SEQUENCE",
    "parse_mesh",
]
