"""`python -m shardfuse.bench.suites` prints the folder of the installed suites (for pytest)."""

from pathlib import Path

print(Path(__file__).resolve().parent)
