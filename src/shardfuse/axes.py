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
- `SEQUENCE` ("sequence"): the sequence (context parallelism: ring attention);
- `MODEL` ("model"): heads and hidden units (tensor parallelism; Megatron sequence
  parallelism shards the sequence over it too).

`MESH_AXES` is their order on a mesh, outermost to innermost: the most
communication-heavy axis (`model`) on the closest devices.

Example usage::

  >>> from shardfuse import axes
  >>> axes.MESH_AXES
  ('pipeline', 'data', 'fsdp', 'sequence', 'model')
  >>> axes.BATCH_AXES  # the axes a batch is split over
  ('data', 'fsdp')
"""

PIPELINE = "pipeline"
DATA = "data"
FSDP = "fsdp"
SEQUENCE = "sequence"
MODEL = "model"

MESH_AXES = (PIPELINE, DATA, FSDP, SEQUENCE, MODEL)  # outermost -> innermost
LAYER_AXES = (DATA, FSDP, SEQUENCE, MODEL)  # the axes a layer's activations and weights use
BATCH_AXES = (DATA, FSDP)  # the data-parallel axes, in the order a batch entry lists them

__all__ = ["BATCH_AXES", "DATA", "FSDP", "LAYER_AXES", "MESH_AXES", "MODEL", "PIPELINE", "SEQUENCE"]
