"""MXFP4 expert weights (gpt-oss's hub checkpoints), dequantized on load.

OCP Microscaling FP4 (MX, "OCP Microscaling Formats (MX) v1.0", 2023): blocks of 32
values share one power-of-two scale; each value is an FP4 e2m1 code (sign, 2 exponent
bits, 1 mantissa bit: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}). gpt-oss's checkpoints
(`quantization_config: {quant_method: mxfp4}`) hold each routed expert projection `P`
of a layer as two tensors:

    mlp.experts.P_blocks  uint8 [E, rows, cols / 32, 16]  two codes a byte: the low nibble
                                                          the even column, the high one the odd
    mlp.experts.P_scales  uint8 [E, rows, cols / 32]      the exponents, biased by 127

with `[rows, cols]` = `[2I, F]` for `gate_up_proj` and `[F, I]` for `down_proj` (out x in),
so that `value[e, r, c] = FP4[code] * 2 ** (scale[e, r, c // 32] - 127)`, transposed to
our `[E, in, out]` (transformers' `integrations/mxfp4.py`: `convert_moe_packed_tensors`,
which this computes, in float32, exactly). `dequantize` takes any block of rows and
groups, so a device reads only its experts' and its columns' bytes (`hf._Checkpoint`).
"""

import numpy as np

# the 16 FP4 e2m1 codes (transformers' `FP4_VALUES`)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
GROUP = 32  # values per scale
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks, scales) -> np.ndarray:
    """float32 `[..., rows, groups * 32]` of MXFP4 `blocks` `[..., rows, groups, 16]` (uint8)
    and `scales` `[..., rows, groups]` (uint8), in the checkpoint's out x in layout.

    Example:
      >>> import numpy as np
      >>> blocks = np.zeros((1, 1, 16), np.uint8)
      >>> blocks[0, 0, 0] = 0x72  # codes 2 (1.0), then 7 (6.0)
      >>> dequantize(blocks, np.full((1, 1), 128, np.uint8))[0, :3].tolist()  # x 2 ** 1
      [2.0, 12.0, 0.0]
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks of shape {blocks.shape} and scales of shape {scales.shape}: blocks "
            f"must be [..., groups, {GROUP // 2}] and scales [..., groups]"
        )
    values = np.empty((*blocks.shape[:-1], GROUP), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - 127
    values = np.ldexp(values, exponents)  # exact: codes of 2 significant bits
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP)


__all__ = ["FP4_VALUES", "GROUP", "SUFFIXES", "dequantize"]
