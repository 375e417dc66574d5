"""The model's shape (`ModelSpec`) and the shapes of published models.

One home for model sizes and architecture options, a data module at the
bottom of the package beside `axes`, `hardware` and `flops`: it imports
nothing from shardfuse, and everything else may import it (`shardfuse.flops`
reads its parameter counts: `flops.model_flops_per_token(spec, seq_len)`; the
collective-matmul and ring-attention cost models its sizes; the planner its
whole shape). `shardfuse.models.Transformer` builds the model a spec
describes; `shardfuse.models` re-exports these names (`sf.models.ModelSpec`,
`sf.models.get`). Published training runs, the planner's data, live in
`shardfuse.planner.published`.

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
  gpt3-175b    Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1:
               d_model 12288, 96 layers, 96 heads of 128, d_ff = 4 d_model, context 2048;
               the GPT-2 BPE vocabulary of 50257 tokens; GELU MLP, tied embeddings

The GPT configurations of Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473),
Table 1: "gpt-1.7b" ... "gpt-1t", with the heads, hidden size and layers of the
table, head dim = hidden / heads, MLP 4 x hidden (GELU), vocabulary 51200 and
sequence length 2048 (the paper's section 5.1), tied input/output embeddings
(the table's runs: `shardfuse.planner.published.NARAYANAN_2021_TABLE1`).

A user model is one `ModelSpec` constructor
call (`ModelSpec("mine", hidden=..., ...)`), `ModelSpec.gpt(...)` fills in
the GPT conventions from hidden size, heads and layers, and `ModelSpec.tiny(...)`
gives a small Llama-style model (what the examples and tests train on CPU).

Architecture options beyond the sizes (defaults: Llama-style, what every
published entry but the GPTs is): `norm` ("rmsnorm" or "layernorm") and
`norm_eps`; `positions` ("rope" with `rope_theta`, "learned" absolute position
embeddings of `max_positions` rows, or "none"); `use_bias` (GPT-style biases on
every linear and the learned LayerNorm shift) and `qkv_bias` (biases on the
query, key and value projections only, as Qwen2); `activation`,
`tied_embeddings`, `window`, `logit_softcap`.

Example:
  >>> from shardfuse import models
  >>> models.get("llama3-70b").kv_heads
  8
  >>> "gemma2-9b" in models.names()
  True
"""

import dataclasses

ACTIVATIONS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
POSITIONS = ("rope", "learned", "none")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
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
      activation: MLP activation: "swiglu" (gated: three `hidden x ffn_hidden`
        matrices, Llama, Mistral, Gemma) or "gelu" (two, GPT).
      tied_embeddings: the output projection reuses the input embedding (GPT).
      norm: "rmsnorm" (scale only) or "layernorm" (scale and shift).
      norm_eps: epsilon of every norm (added to the mean square).
      positions: "rope" (rotary, base `rope_theta`), "learned" (a `[max_positions,
        hidden]` table added to the token embeddings, GPT-2) or "none".
      rope_theta: RoPE base (with `positions="rope"`).
      rope_scaling: None, or Llama 3.1's RoPE frequency scaling `(factor,
        low_freq_factor, high_freq_factor, original_max_positions)`
        (`sf.layers.attention.rope_frequencies`).
      max_positions: rows of the learned position table (required with
        `positions="learned"`: the longest sequence the model reads), else None.
      use_bias: biases on every linear layer (q, k, v, o and the MLP), GPT-style.
      qkv_bias: biases on the q, k and v projections only (Qwen2); implied by
        `use_bias`.

    Raises:
      ValueError: a size is not a positive int, `heads % kv_heads != 0`, or an
        option outside its valid values (the message names the field).

    Example:
      >>> from shardfuse.models import ModelSpec
      >>> ModelSpec("tiny", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn_hidden=256,
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
    activation: str = "swiglu"
    tied_embeddings: bool = False
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    positions: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None
    max_positions: int | None = None
    use_bias: bool = False
    qkv_bias: bool = False

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
                raise ValueError(f"ModelSpec.{field}={value!r} must be a positive int")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelSpec heads={self.heads} must be a multiple of kv_heads={self.kv_heads}"
            )
        for field, valid in (
            ("activation", ACTIVATIONS),
            ("norm", NORMS),
            ("positions", POSITIONS),
        ):
            if getattr(self, field) not in valid:
                raise ValueError(
                    f"ModelSpec.{field}={getattr(self, field)!r} must be one of {valid}"
                )
        for field in ("tied_embeddings", "use_bias", "qkv_bias"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"ModelSpec.{field}={getattr(self, field)!r} must be a bool (True or False)"
                )
        for field, optional in (
            ("norm_eps", False),
            ("rope_theta", False),
            ("logit_softcap", True),
        ):
            value = getattr(self, field)
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"ModelSpec.{field}={value!r} must be a positive number")
        for field in ("window", "max_positions"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"ModelSpec.{field}={value!r} must be None or a positive int")
        if self.rope_scaling is not None:
            scaling = self.rope_scaling
            if (
                not isinstance(scaling, tuple)
                or len(scaling) != 4
                or not all(isinstance(x, int | float) and x > 0 for x in scaling)
                or not scaling[2] > scaling[1]
            ):
                raise ValueError(
                    f"ModelSpec.rope_scaling={scaling!r} must be None or a tuple (factor, "
                    "low_freq_factor, high_freq_factor, original_max_positions) of positive "
                    "numbers with high_freq_factor > low_freq_factor"
                )
        if self.positions == "learned" and self.max_positions is None:
            raise ValueError(
                "ModelSpec.max_positions=None: positions='learned' needs the number of "
                "position embeddings (the longest sequence), e.g. max_positions=2048"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(
                f"ModelSpec.head_dim={self.head_dim} must be even with positions='rope' "
                "(rotary embeddings rotate pairs)"
            )

    @classmethod
    def gpt(cls, name: str, hidden: int, heads: int, num_layers: int, vocab_size: int = 51200):
        """A GPT-style model: MHA, head dim `hidden / heads`, GELU MLP of `4 * hidden`, tied.

        Raises:
          ValueError: `hidden % heads != 0`, or a size that is not a positive int.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> ModelSpec.gpt("gpt-small", 768, 12, 12).ffn_hidden
          3072
        """
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
            raise ValueError(f"hidden={hidden!r} and heads={heads!r} must be positive ints")
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        return cls(
            name,
            hidden,
            heads,
            heads,
            hidden // heads,
            4 * hidden,
            num_layers=num_layers,
            vocab_size=vocab_size,
            activation="gelu",
            tied_embeddings=True,
        )

    @classmethod
    def tiny(
        cls,
        name: str = "tiny",
        *,
        hidden: int = 64,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int | None = None,
        ffn_hidden: int = 128,
        num_layers: int = 4,
        vocab_size: int = 256,
        **options,
    ):
        """A small model, Llama-style by default, that trains on 8 CPU devices in seconds.

        Sizes by keyword, `head_dim` defaulting to `hidden // heads`; `options`: any
        other field (`activation="gelu"`, `positions="learned"`, `max_positions=...`).

        Raises:
          ValueError: `hidden % heads != 0` without a `head_dim`, or an invalid field.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> spec = ModelSpec.tiny(num_layers=2)
          >>> spec.hidden, spec.head_dim, spec.num_layers
          (64, 16, 2)
        """
        if head_dim is None:
            if not isinstance(heads, int) or heads < 1 or not isinstance(hidden, int):
                raise ValueError(f"hidden={hidden!r} and heads={heads!r} must be positive ints")
            if hidden % heads:
                raise ValueError(
                    f"hidden={hidden} must be a multiple of heads={heads}; or pass head_dim"
                )
            head_dim = hidden // heads
        return cls(
            name,
            hidden,
            heads,
            kv_heads,
            head_dim,
            ffn_hidden,
            num_layers=num_layers,
            vocab_size=vocab_size,
            **options,
        )

    def replace(self, **fields):
        """A copy with `fields` changed (validated again): `dataclasses.replace`.

        Example:
          >>> from shardfuse.models import ModelSpec
          >>> ModelSpec.tiny().replace(num_layers=1).num_layers
          1
        """
        return dataclasses.replace(self, **fields)

    @property
    def mlp_matrices(self) -> int:
        """`hidden x ffn_hidden` matrices per MLP: 3 gated (swiglu), 2 plain (gelu)."""
        return 3 if self.activation == "swiglu" else 2

    def layer_matmul_params(self) -> int:
        """Matmul weights of one block: q, k, v, o projections and the MLP (what FLOPs count).

        Example:
          >>> from shardfuse import models
          >>> models.get("llama3-8b").layer_matmul_params()
          218103808
        """
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        attention = self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden
        return attention + self.mlp_matrices * self.hidden * self.ffn_hidden

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: scale (RMSNorm), scale and shift (LayerNorm)."""
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def layer_params(self) -> int:
        """Weights of one transformer block: q, k, v, o projections, MLP, biases, two norms.

        Example:
          >>> from shardfuse import models
          >>> models.get("llama3-8b").layer_params()
          218112000
        """
        biases = 0
        if self.use_bias or self.qkv_bias:
            biases += (self.heads + 2 * self.kv_heads) * self.head_dim
        if self.use_bias:  # o; MLP up (2 x ffn_hidden when gated) and down
            biases += self.hidden + (self.mlp_matrices - 1) * self.ffn_hidden + self.hidden
        return self.layer_matmul_params() + biases + 2 * self.norm_params

    def embedding_params(self) -> int:
        """Input embedding, output projection (once when tied), positions, the final norm."""
        tables = 1 if self.tied_embeddings else 2
        positions = self.max_positions * self.hidden if self.positions == "learned" else 0
        return tables * self.vocab_size * self.hidden + positions + self.norm_params

    def num_params(self) -> int:
        """Total weights: `num_layers * layer_params() + embedding_params()`.

        Example:
          >>> from shardfuse import models
          >>> round(models.get("llama3-8b").num_params() / 1e9, 2)
          8.03
        """
        return self.num_layers * self.layer_params() + self.embedding_params()

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
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama3-8b", 4096, 32, 8, 128, 14336, num_layers=32, vocab_size=128256),
        ModelSpec("llama3-70b", 8192, 64, 8, 128, 28672, num_layers=80, vocab_size=128256),
        ModelSpec("llama3-405b", 16384, 128, 8, 128, 53248, num_layers=126, vocab_size=128256),
        ModelSpec(
            "mistral-7b", 4096, 32, 8, 128, 14336, num_layers=32, vocab_size=32000, window=4096
        ),
        ModelSpec("gemma-7b", 3072, 16, 16, 256, 24576, num_layers=28, vocab_size=256000),
        ModelSpec(
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
        ModelSpec(
            "gpt3-175b",
            12288,
            96,
            96,
            128,
            49152,
            num_layers=96,
            vocab_size=50257,
            activation="gelu",
            tied_embeddings=True,
        ),
        # Narayanan et al. 2021, Table 1 (heads, hidden, layers); vocabulary 51200.
        ModelSpec.gpt("gpt-1.7b", 2304, 24, 24),
        ModelSpec.gpt("gpt-3.6b", 3072, 32, 30),
        ModelSpec.gpt("gpt-7.5b", 4096, 32, 36),
        ModelSpec.gpt("gpt-18b", 6144, 48, 40),
        ModelSpec.gpt("gpt-39b", 8192, 64, 48),
        ModelSpec.gpt("gpt-76b", 10240, 80, 60),
        ModelSpec.gpt("gpt-145b", 12288, 96, 80),
        ModelSpec.gpt("gpt-310b", 16384, 128, 96),
        ModelSpec.gpt("gpt-530b", 20480, 128, 105),
        ModelSpec.gpt("gpt-1t", 25600, 160, 128),
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


def get(name: str) -> ModelSpec:
    """The `ModelSpec` called `name`.

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
