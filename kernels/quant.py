"""Quantized weight formats, their pure-torch reference (the test oracle of
csrc/quant.cpp), and the calls into the native kernels.

A quantized matrix is [N, row_bytes] bytes: each of its N output channels is one row of
blocks along K, exactly as a GGUF file stores it, or, for "int8", K signed bytes with one
fp32 scale per row (symmetric, per output channel). The block types are those of the
GGUF files people serve: Q4_K_M and Q5_K_M files (Q4_K, Q5_K, Q6_K, with Q5_0 and Q8_0
where a row is not a multiple of 256, as in Gemma 3 270M and Qwen2.5 0.5B), the legacy
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 files, and gpt-oss's MXFP4 experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu

# GGML's type numbers; INT8_ROWS is ours.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, INT8_ROWS = 2, 3, 6, 7, 8, 12, 13, 14, 39, 1000
# MXFP4's E2M1 values, doubled so that they are integers (its scale byte e then stands
# for 2^(e - 128), half the format's 2^(e - 127)).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass(frozen=True)
class Format:
    name: str
    block: int  # weights per block
    bytes: int  # bytes per block


FORMATS = {
    Q8_0: Format("Q8_0", 32, 34),
    Q4_0: Format("Q4_0", 32, 18),
    Q4_1: Format("Q4_1", 32, 20),
    Q5_0: Format("Q5_0", 32, 22),
    Q5_1: Format("Q5_1", 32, 24),
    Q4_K: Format("Q4_K", 256, 144),
    Q5_K: Format("Q5_K", 256, 176),
    Q6_K: Format("Q6_K", 256, 210),
    MXFP4: Format("MXFP4", 32, 17),
    INT8_ROWS: Format("int8", 1, 1),
}


def row_bytes(qtype: int, k: int) -> int:
    f = FORMATS[qtype]
    return k // f.block * f.bytes


KERNELS = {"auto": 0, "few": 1, "many": 2}


def qlinear(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, qtype: int, k: int,
            kernel: str = "auto", int8_activations: bool = False) -> torch.Tensor:
    """x [M, K] fp32 or bf16 times the quantized W [N, K] transposed, in x's dtype
    (module-level so profilers can wrap it). `kernel` forces quant.cpp's few-rows kernel
    or qgemm.cpp's many-rows one, which "auto" picks between by row count. With
    `int8_activations` the few-rows kernel rounds x to int8 per 32 values first
    (quant_a8.cpp; a8_reference is its product); the many-rows kernel keeps x as it is.
    bf16 rows compute in fp32 on the exact weights, except many on the AMX tiles
    (`bf16_tiles`)."""
    return cpu.op("qlinear")(x, w, scales, qtype, k, KERNELS[kernel], int8_activations)


def few_rows_available(qtype: int, k: int) -> bool:
    """Whether this build streams qtype's blocks in the few-rows kernel (AVX2 and FMA; every
    block type, and int8 rows with K a multiple of 32). Where it does not, every row count
    takes the many-rows kernel."""
    return cpu.available() and bool(cpu.op("few_rows_fit")(qtype, k))


def bf16_tiles(qtype: int, m: int, k: int, kernel: str = "auto", int8_activations: bool = False) -> bool:
    """Whether m bf16 rows run on the AMX tiles (a CPU and build with AMX, K a multiple of
    32): the weights then enter the product rounded to bf16, as a bf16 model holds them.
    Elsewhere bf16 rows compute in fp32 on the exact weights."""
    return cpu.available() and bool(cpu.op("bf16_tiles")(qtype, m, k, KERNELS[kernel], int8_activations))


def dequant_rows(w: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, qtype: int, k: int
                 ) -> torch.Tensor:
    return cpu.op("dequant_rows")(w, scales, ids, qtype, k)


# -- the reference ----------------------------------------------------------------------
def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from [..., 2] bytes."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: low nibbles are weights 0-15, high ones 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes -> [..., 32]: bit i of the little-endian 32-bit word, as 0 or 16."""
    bits = (qh.long()[..., :, None] >> torch.arange(8)) & 1
    return bits.flatten(-2).float() * 16


def _q5(b: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0's and Q5_1's 5-bit quants: 4 low bits as Q4's nibbles, bit i of qh on weight i."""
    return _nibbles(b[:, offset + 4:]) + _high_bits(b[:, offset:offset + 4])


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    half_scale = torch.ldexp(torch.ones(b.shape[0]), b[:, 0].long() - 128)  # 2^(e - 128), subnormal below -126
    return half_scale[:, None] * lut[_nibbles(b[:, 1:]).long()]


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's eight sub-block scales and mins, d and dmin applied: [n, 8] each."""
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    s = b[:, 4:16].long()
    low = torch.cat((s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)), dim=1)
    mins = torch.cat((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), dim=1)
    return d * low.float(), dmin * mins.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    scale, mn = _k_scales(b)
    q = b[:, 16:].reshape(-1, 4, 32).long()
    vals = torch.stack((q & 0x0F, q >> 4), dim=2).reshape(-1, 8, 32).float()  # sub-block j = 2g + (high)
    return scale[:, :, None] * vals - mn[:, :, None]


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout with 32 bytes of fifth bits before the nibbles: bit j of qh[l] is the
    fifth bit of sub-block j's weight l."""
    scale, mn = _k_scales(b)
    qh = b[:, 16:48].long()
    q = b[:, 48:].reshape(-1, 4, 32).long()
    vals = torch.stack((q & 0x0F, q >> 4), dim=2).reshape(-1, 8, 32)
    vals = vals + ((qh[:, None, :] >> torch.arange(8)[:, None]) & 1) * 16
    return scale[:, :, None] * vals.float() - mn[:, :, None]


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, :128].long().reshape(-1, 2, 64), b[:, 128:192].long().reshape(-1, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 8)
    d = _f16(b[:, 208:210])[:, None, None]
    q1 = (ql[:, :, :32] & 0x0F) | (((qh >> 0) & 3) << 4)
    q2 = (ql[:, :, 32:] & 0x0F) | (((qh >> 2) & 3) << 4)
    q3 = (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = torch.stack((q1, q2, q3, q4), dim=2).float() - 32  # [n, half, 4 groups of 32, 32]
    scale = torch.stack([sc[:, :, 2 * g:2 * g + 2] for g in range(4)], dim=2)  # [n, half, 4, 2]
    scale = scale.repeat_interleave(16, dim=3)  # each scale covers 16 weights
    return (d[..., None] * scale * q).reshape(-1, 256)


def dequantize(w: torch.Tensor, scales: torch.Tensor | None, qtype: int, k: int) -> torch.Tensor:
    """The fp32 [N, K] values a quantized matrix stands for."""
    n = w.shape[0]
    if qtype == INT8_ROWS:
        return w.view(torch.int8).float() * scales[:, None]
    f = FORMATS[qtype]
    b = w.view(torch.uint8).reshape(-1, f.bytes)
    if qtype == Q8_0:
        vals = _f16(b[:, :2])[:, None] * b[:, 2:].contiguous().view(torch.int8).float()
    elif qtype == Q4_0:
        vals = _f16(b[:, :2])[:, None] * (_nibbles(b[:, 2:]) - 8)
    elif qtype == Q4_1:
        vals = _f16(b[:, :2])[:, None] * _nibbles(b[:, 4:]) + _f16(b[:, 2:4])[:, None]
    elif qtype == Q5_0:
        vals = _f16(b[:, :2])[:, None] * (_q5(b, 2) - 16)
    elif qtype == Q5_1:
        vals = _f16(b[:, :2])[:, None] * _q5(b, 4) + _f16(b[:, 2:4])[:, None]
    elif qtype == MXFP4:
        vals = _mxfp4(b)
    elif qtype == Q4_K:
        vals = _q4_k(b)
    elif qtype == Q5_K:
        vals = _q5_k(b)
    else:
        vals = _q6_k(b)
    return vals.reshape(n, k)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 32) as the int8-activation kernel sees it: each 32 values
    q * d with d = max|x| / 127 and q = round(x * 127 / max|x|), in fp32 as the kernel
    computes them (a group of zeros stays zeros)."""
    g = x.float().reshape(x.shape[0], -1, 32)
    top = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    return (torch.round(g * inv) * (top / 127)).reshape(x.shape)


def _offsets(w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The part of each weight that does not scale its quant (Q4_0's -8d, Q5_0's -16d, Q4_1's
    and Q5_1's m, the K-quants' -dmin * min; zero for the signed types): the blocks with
    their quants zeroed."""
    cleared = {Q4_0: (2, 18), Q4_1: (4, 20), Q5_0: (2, 22), Q5_1: (4, 24), Q4_K: (16, 144),
               Q5_K: (16, 176)}.get(qtype)
    if cleared is None:
        return torch.zeros(w.shape[0], k)
    f = FORMATS[qtype]
    b = w.view(torch.uint8).reshape(-1, f.bytes).clone()
    b[:, cleared[0]:cleared[1]] = 0
    return dequantize(b.reshape(w.shape), None, qtype, k)


def a8_reference(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, qtype: int, k: int
                 ) -> torch.Tensor:
    """The product the int8-activation kernel computes, in float64: the rounded activations
    times the quants' scaled part of each weight, plus the exact x times the offsets."""
    dense, offsets = dequantize(w, scales, qtype, k).double(), _offsets(w, qtype, k).double()
    return round_activations(x).double() @ (dense - offsets).T + x.double() @ offsets.T


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (int8 [N, K], fp32 scale [N]) with
    weight ~= q * scale and |q| <= 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale
