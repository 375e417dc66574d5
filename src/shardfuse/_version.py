"""The package version, in one place: `shardfuse.__version__` and `shardfuse info` read it."""

__version__ = "0.1.0"
