"""How big a benchmark run is: which models of `shardfuse.models`, sequence lengths, dtype.

Every suite takes its shapes from `shardfuse.models.MODELS` through a `Scale`: on accelerators
the real head counts and head dims at sequence lengths 1k to 16k with a
constant number of tokens per batch (16k, the FlashAttention benchmark
convention); on CPU the head counts and attention windows are divided by 8
(the GQA ratio kept) at short sequence lengths, so that a run takes minutes.
The model figures themselves (and their sources) live in `shardfuse.models`.
"""

import dataclasses

from shardfuse.flops import FWD, MODES
from shardfuse.models import MODELS, ModelSpec

GRID_MODES = ("longest", "all", None)


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big a benchmark run is.

    Attributes:
      name: "cpu", "cpu-quick", "device" or "device-quick".
      models: which entries of `shardfuse.models.MODELS` the suites use.
      seq_lens: sequence lengths T (= S for self-attention).
      tokens_per_batch: batch size B = max(1, tokens_per_batch // T).
      divisor: heads, kv heads, widths and windows are divided by it
        (never below 1), so CPU runs keep each model's GQA ratio and head dim.
      dtype: the input dtype.
      target_seconds: timed rounds per case are about `target_seconds` divided
        by the time of one call, clamped to `[min_rounds, max_rounds]`.
      min_rounds, max_rounds: bounds on the timed rounds.
      warmup_rounds: untimed calls before the timed rounds, beyond the first call that
        compiles nothing (compiled ahead) but checks the outputs; quick scales: none.
    """

    name: str
    models: tuple[str, ...]
    seq_lens: tuple[int, ...]
    tokens_per_batch: int
    divisor: int
    dtype: str
    target_seconds: float
    min_rounds: int
    max_rounds: int
    warmup_rounds: int = 1

    def batch(self, seq_len: int) -> int:
        """Batch size at `seq_len`: constant tokens per batch, at least 1."""
        return max(1, self.tokens_per_batch // seq_len)

    def scaled(self, model: ModelSpec) -> ModelSpec:
        """`model` with heads, widths and window divided by `divisor` (at least 1)."""
        d = self.divisor

        def down(x):
            return None if x is None else max(1, x // d)

        return dataclasses.replace(
            model,
            hidden=down(model.hidden),
            heads=down(model.heads),
            kv_heads=down(model.kv_heads),
            ffn_hidden=down(model.ffn_hidden),
            window=down(model.window),
        )

    def models_scaled(self) -> list[ModelSpec]:
        """The run's models, scaled."""
        return [self.scaled(MODELS[name]) for name in self.models]

    def grid(self, choices, *, models=None, modes="longest") -> tuple[list[tuple], list[str]]:
        """The cases of a suite, `(params, ids)` for `metafunc.parametrize`.

        Every model, sequence length, mode and choice, as tuples
        `(model, seq_len, mode, *choice)` with ids `"{model}-T{seq_len}-{mode}-{choice}"`.

        Args:
          choices: what else varies: strings (implementations) or tuples of
            strings (an op and an implementation).
          models: model names; default the scale's.
          modes: "longest" (forward at every length, forward + backward at the
            longest only: a backward costs 2.5 forwards), "all" (both at every
            length), or None (no mode in the tuples or ids).

        Example:
          >>> from shardfuse.bench.scales import SCALES
          >>> params, ids = SCALES["cpu-quick"].grid(["xla"], models=["llama3-8b"])
          >>> ids
          ['llama3-8b-T256-fwd-xla', 'llama3-8b-T512-fwd-xla', 'llama3-8b-T512-fwd+bwd-xla']
          >>> params[0]
          ('llama3-8b', 256, 'fwd', 'xla')
        """
        if modes not in GRID_MODES:
            raise ValueError(f"modes={modes!r} must be one of {GRID_MODES}")
        choices = [choice if isinstance(choice, tuple) else (choice,) for choice in choices]
        params = []
        for model in self.models if models is None else models:
            for seq_len in self.seq_lens:
                if modes is None:
                    timed = [()]
                elif modes == "all" or seq_len == max(self.seq_lens):
                    timed = [(mode,) for mode in MODES]
                else:
                    timed = [(FWD,)]
                params += [(model, seq_len, *mode, *choice) for mode in timed for choice in choices]
        ids = ["-".join((model, f"T{seq_len}", *rest)) for model, seq_len, *rest in params]
        return params, ids


SCALES = {
    "cpu": Scale(
        "cpu",
        models=("llama3-8b", "llama3-70b", "mistral-7b", "gemma2-9b"),
        seq_lens=(512, 1024, 2048),
        tokens_per_batch=1,
        divisor=8,
        dtype="float32",
        target_seconds=1.0,
        min_rounds=3,
        max_rounds=20,
    ),
    "cpu-quick": Scale(
        "cpu-quick",
        models=("llama3-8b", "gemma2-9b"),
        seq_lens=(256, 512),
        tokens_per_batch=1,
        divisor=8,
        dtype="float32",
        target_seconds=0.3,
        min_rounds=2,
        max_rounds=10,
        warmup_rounds=0,
    ),
    "device": Scale(
        "device",
        models=("llama3-8b", "llama3-70b", "mistral-7b", "gemma-7b", "gemma2-9b"),
        seq_lens=(1024, 2048, 4096, 8192, 16384),
        tokens_per_batch=16384,
        divisor=1,
        dtype="bfloat16",
        target_seconds=1.0,
        min_rounds=10,
        max_rounds=100,
    ),
    "device-quick": Scale(
        "device-quick",
        models=("llama3-8b", "gemma2-9b"),
        seq_lens=(2048, 8192),
        tokens_per_batch=16384,
        divisor=1,
        dtype="bfloat16",
        target_seconds=0.3,
        min_rounds=5,
        max_rounds=30,
        warmup_rounds=0,
    ),
}


def pick_scale(backend: str, quick: bool, override: str | None = None) -> Scale:
    """The `Scale` for a run: `override` if given, else by backend ("cpu" or not) and `quick`.

    Raises:
      ValueError: `override` is not a key of `SCALES`.

    Example:
      >>> from shardfuse.bench.scales import pick_scale
      >>> pick_scale("cpu", quick=True).name
      'cpu-quick'
      >>> pick_scale("gpu", quick=False).name
      'device'
    """
    if override is not None:
        if override not in SCALES:
            raise ValueError(f"scale={override!r} is not one of {sorted(SCALES)}")
        return SCALES[override]
    name = "cpu" if backend == "cpu" else "device"
    return SCALES[f"{name}-quick" if quick else name]
