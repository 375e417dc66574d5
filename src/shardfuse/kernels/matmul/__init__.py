"""Matmul-plus-reduce: one op, several implementations behind `api.matmul`."""

from shardfuse.kernels.matmul.api import matmul
from shardfuse.kernels.matmul.base import MatmulBlockSizes

__all__ = ["MatmulBlockSizes", "matmul"]
