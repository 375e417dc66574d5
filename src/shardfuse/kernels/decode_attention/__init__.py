"""Decode attention (flash-decoding): one op, its implementations behind `api.decode_attention`."""

from shardfuse.kernels.decode_attention.api import decode_attention

__all__ = ["decode_attention"]
