"""Attention: one op, several implementations behind `api.flash_attention`."""

from shardfuse.kernels.attention.api import attention_reference, flash_attention
from shardfuse.kernels.attention.base import BlockSizes

__all__ = ["BlockSizes", "attention_reference", "flash_attention"]
