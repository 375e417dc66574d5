"""Models: the spec of a decoder-only transformer (data) and the one model built from it.

`shardfuse.models.spec` is a data module at the bottom of the package (sizes
of published models, `ModelSpec`, the published runs); its names are
re-exported here eagerly, so that the planner, `shardfuse.flops` and the
benchmarks read specs without importing Flax or the layers.
`shardfuse.models.transformer` holds `Transformer`, the NNX model a spec
describes, built from `shardfuse.layers`; it is imported lazily, on first use
of one of its names (`sf.models.Transformer`). `shardfuse.models.hf` reads and
writes Hugging Face checkpoints (`load_hf`, `save_hf`), `shardfuse.models.generation`
generates text with a sharded KV cache (`generate`); both lazy too.

Example:
  >>> from shardfuse import models
  >>> models.get("llama3-70b").kv_heads
  8
  >>> models.ModelSpec.tiny(num_layers=2).num_layers
  2
"""

import importlib

from shardfuse.models.spec import (
    ACTIVATIONS,
    MODELS,
    NARAYANAN_2021_TABLE1,
    NORMS,
    POSITIONS,
    ModelShape,
    ModelSpec,
    PublishedRun,
    get,
    names,
)

# name -> submodule defining it, imported on first access (PEP 562): the model pulls in
# Flax and the layers, which the data readers of this package must not depend on.
_LAZY = {
    "Transformer": "transformer",
    "LMHead": "transformer",
    "token_loss": "transformer",
    "load_hf": "hf",
    "save_hf": "hf",
    "generate": "generation",
}

__all__ = [
    "ACTIVATIONS",
    "MODELS",
    "NARAYANAN_2021_TABLE1",
    "NORMS",
    "POSITIONS",
    "LMHead",
    "ModelShape",
    "ModelSpec",
    "PublishedRun",
    "Transformer",
    "generate",
    "get",
    "load_hf",
    "names",
    "save_hf",
    "token_loss",
]


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f"shardfuse.models.{_LAZY[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardfuse.models' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
