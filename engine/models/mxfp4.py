"""MXFP4 weights (the OCP Microscaling format gpt-oss ships its experts in), dequantized at
load: every 32 consecutive values of a row share one E8M0 scale byte (2^(byte - 127)), and
each value is a 4-bit E2M1 float, two to a byte, the low nibble first.

Tensors come in pairs, `<name>_blocks` uint8 [..., G, 16] and `<name>_scales` uint8
[..., G], for rows of G * 32 values. GGUF files (GGML's MXFP4 type) hold the same values
as 17-byte blocks, the scale byte first and the low nibbles as values 0-15; they are
checked here when the file is converted, before either path (dequantized, or the
kernels' `quantization: gguf`) reads them. A scale byte of 255 is NaN in E8M0, and a scale
that makes a value overflow fp32 is not a weight anyone trained: both are refused,
naming the tensor."""

from __future__ import annotations

import torch

from kernels import quant

# E2M1: sign, two exponent bits, one mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
NAN_SCALE = 255


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}_blocks and {name}_scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}_blocks {tuple(blocks.shape)} and {name}_scales {tuple(scales.shape)} do not "
                         f"pair as [..., G, {BLOCK // 2}] and [..., G]")
    if bool((scales == NAN_SCALE).any()):
        raise ValueError(f"{name}_scales holds {NAN_SCALE}, which is NaN in E8M0: the checkpoint is damaged")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 [..., G * 32] from blocks [..., G, 16] and scales [..., G]; a ValueError naming
    `name` for a malformed pair or a scale out of range."""
    _check_pair(blocks, scales, name)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    out = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{name}_scales are out of range: a scale of 2^{int(scales.max()) - 127} overflows fp32")
    return out.flatten(-2)


def to_gguf_blocks(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """Rows of the checkpoint's pairs (blocks [N, G, 16], scales [N, G]) as GGML's 17-byte
    MXFP4 blocks, [N, G * 17], which the kernels compute on (`quantization: mxfp4`): the
    same scale byte first, then the nibbles regrouped (a checkpoint byte holds values 2i
    and 2i + 1 of its 32, a GGML byte values i and i + 16). The values are unchanged; a
    ValueError as dequantize's for a malformed pair or a scale out of range."""
    _check_pair(blocks, scales, name)
    values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [N, G, 32]
    packed = values[..., :BLOCK // 2] | (values[..., BLOCK // 2:] << 4)
    out = torch.cat((scales[..., None], packed), dim=-1).reshape(blocks.shape[0], -1)
    check_gguf_blocks(out, name)
    return out


def check_gguf_blocks(data: torch.Tensor, name: str) -> None:
    """A ValueError naming the GGUF tensor `name` if one of its 17-byte MXFP4 blocks has a
    NaN scale or a value that overflows fp32; else nothing. Only the blocks whose scale
    could overflow (2^126 and up) are expanded."""
    blocks = data.reshape(-1, 17)
    scales = blocks[:, 0]
    if bool((scales == NAN_SCALE).any()):
        raise ValueError(f"GGUF tensor {name!r} holds an MXFP4 scale of {NAN_SCALE}, which is NaN in E8M0: the file "
                         "is damaged")
    high = blocks[scales >= 253]
    if high.numel() and not bool(torch.isfinite(quant.dequantize(high, None, quant.MXFP4, BLOCK)).all()):
        raise ValueError(f"GGUF tensor {name!r} has MXFP4 scales out of range: a scale of "
                         f"2^{int(scales.max()) - 127} overflows fp32")
