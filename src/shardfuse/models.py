"""Transformer shapes of published models: the data that benchmarks, cost models and planner read.

One home for model sizes. This module sits at the bottom of the package: it
imports nothing from shardfuse, and everything else may import it.

Every figure is the published checkpoint's `config.json` on the Hugging Face Hub:

  llama3-8b    meta-llama/Meta-Llama-3-8B      hidden_size 4096, num_attention_heads 32,
               num_key_value_heads 8, intermediate_size 14336, num_hidden_layers 32,
               vocab_size 128256 (head dim = 4096 / 32 = 128)
  llama3-70b   meta-llama/Meta-Llama-3-70B     8192, 64, 8, 28672, 80 layers, vocab 128256
  llama3-405b  meta-llama/Llama-3.1-405B       16384, 128, 8, 53248, 126 layers, vocab 128256
  mistral-7b   mistralai/Mistral-7B-v0.1       4096, 32, 8, 14336, 32 layers, vocab 32000,
               sliding_window 4096
  gemma-7b     google/gemma-7b                 3072, 16, 16, head_dim 256, 24576, 28 layers,
               vocab 256000
  gemma2-9b    google/gemma-2-9b               3584, 16, 8, head_dim 256, 14336, 42 layers,
               vocab 256000, sliding_window 4096 (its local layers),
               attn_logit_softcapping 50.0

Example:
  >>> from shardfuse import models
  >>> models.get("llama3-70b").kv_heads
  8
  >>> "gemma2-9b" in models.names()
  True
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of one decoder-only transformer.

    Attributes:
      name: short name, the key of `MODELS` ("llama3-8b").
      hidden: model width (`hidden_size`).
      heads: query heads H.
      kv_heads: key/value heads K (`H % K == 0`; K < H is GQA, K == 1 MQA).
      head_dim: D (may differ from `hidden // heads`, as in Gemma).
      ffn_hidden: MLP hidden size (`intermediate_size`).
      num_layers: transformer blocks.
      vocab_size: embedding rows.
      window: sliding-window size (keys, the query itself included) of its local
        attention layers, or None (global attention only).
      logit_softcap: attention logit softcap, or None.

    Raises:
      ValueError: a size is not a positive int, or `heads % kv_heads != 0`.

    Example:
      >>> from shardfuse.models import ModelShape
      >>> ModelShape("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=256,
      ...            num_layers=2, vocab_size=1000).heads
      4
    """

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden: int
    num_layers: int
    vocab_size: int
    window: int | None = None
    logit_softcap: float | None = None

    def __post_init__(self):
        for field in (
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "ffn_hidden",
            "num_layers",
            "vocab_size",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field}={value!r} must be a positive int")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelShape heads={self.heads} must be a multiple of kv_heads={self.kv_heads}"
            )

    @property
    def causal_mask(self) -> tuple[tuple[int, int] | None, str]:
        """`(window, variant)` of its causal self-attention.

        `window` is the `window=` argument of `sf.flash_attention` (a window of W
        keys is `(W - 1, 0)`, None without one); `variant` labels the mask and
        options ("causal window=4096 softcap=50").

        Example:
          >>> from shardfuse import models
          >>> models.get("mistral-7b").causal_mask
          ((4095, 0), 'causal window=4096')
        """
        window = (self.window - 1, 0) if self.window else None
        variant = "causal"
        if window:
            variant += f" window={self.window}"
        if self.logit_softcap:
            variant += f" softcap={self.logit_softcap:g}"
        return window, variant


# Figures and sources: the module docstring.
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama3-8b", 4096, 32, 8, 128, 14336, num_layers=32, vocab_size=128256),
        ModelShape("llama3-70b", 8192, 64, 8, 128, 28672, num_layers=80, vocab_size=128256),
        ModelShape("llama3-405b", 16384, 128, 8, 128, 53248, num_layers=126, vocab_size=128256),
        ModelShape(
            "mistral-7b", 4096, 32, 8, 128, 14336, num_layers=32, vocab_size=32000, window=4096
        ),
        ModelShape("gemma-7b", 3072, 16, 16, 256, 24576, num_layers=28, vocab_size=256000),
        ModelShape(
            "gemma2-9b",
            3584,
            16,
            8,
            256,
            14336,
            num_layers=42,
            vocab_size=256000,
            window=4096,
            logit_softcap=50.0,
        ),
    )
}


def names() -> list[str]:
    """The names `get` accepts, sorted.

    Example:
      >>> from shardfuse import models
      >>> models.names()[:2]
      ['gemma-7b', 'gemma2-9b']
    """
    return sorted(MODELS)


def get(name: str) -> ModelShape:
    """The `ModelShape` called `name`.

    Args:
      name: a key of `MODELS`, e.g. "llama3-8b".

    Returns:
      The model's shape.

    Raises:
      ValueError: unknown `name` (the message lists the valid ones).

    Example:
      >>> from shardfuse import models
      >>> models.get("llama3-8b").ffn_hidden
      14336
    """
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"model {name!r} is not one of {names()}") from None
