"""Deterministic token streams for the training examples: synthetic or a text file.

Every batch is a pure function of `(step, row)`, so a process can load just
the rows its devices hold, and a resumed run continues exactly where the
saved data position says.

- synthetic: arithmetic sequences `token[t + 1] = (token[t] + step) % vocab`
  with a random start and step per row (learnable in a few dozen steps);
- text: byte-level tokens (vocabulary 256) of a UTF-8 text file, windows of
  `seq_len + 1` bytes at positions drawn per `(step, row)`.
"""

import pathlib

import numpy as np

CORPUS = pathlib.Path(__file__).resolve().parent / "corpus.txt"


class SyntheticTokens:
    """Arithmetic sequences over a vocabulary of `vocab` tokens."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """int32 `[stop - start, seq_len + 1]`: rows start..stop-1 of batch `step`."""
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        for i, row in enumerate(range(start, stop)):
            rng = np.random.default_rng((self.seed, step, row))
            first, stride = rng.integers(0, self.vocab), rng.integers(1, 5)
            out[i] = (first + stride * np.arange(self.seq_len + 1)) % self.vocab
        return out


class TextTokens:
    """Byte-level windows of a text file (vocabulary 256)."""

    vocab = 256

    def __init__(self, path, seq_len: int, seed: int = 0):
        self.path = pathlib.Path(path)
        self.data = np.frombuffer(self.path.read_bytes(), np.uint8).astype(np.int32)
        if self.data.size < seq_len + 2:
            raise ValueError(
                f"text file {self.path} has {self.data.size} bytes; "
                f"needs more than seq_len + 1 = {seq_len + 1}"
            )
        self.seq_len, self.seed = seq_len, seed

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """int32 `[stop - start, seq_len + 1]`: rows start..stop-1 of batch `step`."""
        span = self.data.size - self.seq_len - 1
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        for i, row in enumerate(range(start, stop)):
            offset = np.random.default_rng((self.seed, step, row)).integers(0, span)
            out[i] = self.data[offset : offset + self.seq_len + 1]
        return out
