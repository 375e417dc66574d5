"""Grouped matmul (the mixture-of-experts matmul): one op, several implementations behind
`api.grouped_matmul`."""

from shardfuse.kernels.grouped_matmul.api import grouped_matmul

__all__ = ["grouped_matmul"]
