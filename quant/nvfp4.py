"""NVFP4 in NVIDIA ModelOpt's on-disk layout: pack, unpack, reference quantize and dequantize.

For a weight W [N, K] (K a multiple of 16):
- weight        uint8 [N, K/2]: two E2M1 codes per byte, element 2i in the low nibble, 2i+1 in the high one;
- weight_scale  float8_e4m3fn [N, K/16]: one scale per 16 consecutive inputs of a row;
- weight_scale_2 float32 []: the global scale.
value[n, k] = E2M1[code] * float32(weight_scale[n, k // 16]) * weight_scale_2.
An E2M1 code is 4 bits: bit 3 the sign, bits 0-2 an index into the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Quantization (reference, plain absmax): weight_scale_2 = amax|W| / (6 * 448), so the largest block scale is
e4m3's largest value; each block's scale is amax(block) / 6 / weight_scale_2 rounded to e4m3; elements round to the
nearest E2M1 value, ties to the even code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
# Midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


@dataclass
class NVFP4Weight:
    weight: torch.Tensor  # uint8 [N, K/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [N, K/16]
    weight_scale_2: torch.Tensor  # float32 []

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * 2


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float tensor (already divided by its scales) -> uint8 codes 0..15, round to nearest, ties to even."""
    mag = x.abs().float().clamp(max=6.0)
    mids = _MIDPOINTS.to(mag.device)
    idx = torch.bucketize(mag, mids)  # mids[i-1] < mag <= mids[i] -> i, so a tie lands on the lower index
    tie = (idx < 7) & (mag == mids[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # ties go to the even code
    sign = (x < 0) & (idx > 0)
    return (idx + 8 * sign).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> float32 values."""
    c = codes.long()
    mag = E2M1.to(codes.device)[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> [N, K/2] bytes, element 2i in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] bytes -> [N, K] codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def quantize(w: torch.Tensor) -> NVFP4Weight:
    """Reference NVFP4 quantization of W [N, K] with plain absmax scales."""
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of {BLOCK} (got {K})")
    w = w.float()
    amax = w.abs().max()
    scale_2 = (amax / (6.0 * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    blocks = w.view(N, K // BLOCK, BLOCK)
    block_scale = (blocks.abs().amax(dim=-1) / 6.0 / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = block_scale.float() * scale_2
    scaled = torch.where(denom[..., None] > 0, blocks / denom[..., None], torch.zeros_like(blocks))
    codes = encode_e2m1(scaled).view(N, K)
    return NVFP4Weight(pack_nibbles(codes), block_scale, scale_2.reshape(()).float())


def dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, K = q.shape
    values = decode_e2m1(unpack_nibbles(q.weight)).view(N, K // BLOCK, BLOCK)
    scales = q.weight_scale.float() * q.weight_scale_2.float()
    return (values * scales[..., None]).view(N, K).to(dtype)
