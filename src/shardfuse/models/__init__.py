"""Models: the one decoder-only transformer built from a `ModelSpec`, its checkpoints, generation.

The model's shape, `ModelSpec` (sizes and architecture options) and the
shapes of published models (`get`, `names`, `MODELS`), live at the bottom of
the package in `shardfuse.model_spec`, where `shardfuse.flops`, the cost
models and the planner read them; they are re-exported here.
`shardfuse.models.transformer` holds `Transformer`, the NNX model a spec
describes, built from `shardfuse.layers`; `shardfuse.models.hf` reads and
writes Hugging Face checkpoints (`load_hf`, `save_hf`; `hf_config` the
`config.json` half), `shardfuse.models.generation` generates text with a
sharded KV cache (`generate`).

Example:
  >>> from shardfuse import models
  >>> models.get("llama3-70b").kv_heads
  8
  >>> models.ModelSpec.tiny(num_layers=2).num_layers
  2
"""

import warnings

from shardfuse.model_spec import (
    ACTIVATIONS,
    MODELS,
    NORMS,
    POSITIONS,
    ModelSpec,
    get,
    names,
)
from shardfuse.models.generation import generate
from shardfuse.models.hf import load_hf, save_hf
from shardfuse.models.transformer import LMHead, Transformer, token_loss

__all__ = [
    "ACTIVATIONS",
    "MODELS",
    "NORMS",
    "POSITIONS",
    "LMHead",
    "ModelSpec",
    "Transformer",
    "generate",
    "get",
    "load_hf",
    "names",
    "save_hf",
    "token_loss",
]

# Names of earlier releases: name -> (the value now, what to use).
_DEPRECATED = {"ModelShape": (ModelSpec, "sf.models.ModelSpec")}


def __getattr__(name):
    if name in _DEPRECATED:
        value, instead = _DEPRECATED[name]
        warnings.warn(
            f"sf.models.{name} is deprecated and will be removed in the next release: use "
            f"{instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'shardfuse.models' has no attribute {name!r}")
