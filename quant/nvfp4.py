"""NVFP4 in NVIDIA ModelOpt's on-disk layout: pack, unpack, reference quantize and dequantize.

For a weight W [N, K] (K a multiple of 16):
- weight        uint8 [N, K/2]: two E2M1 codes per byte, element 2i in the low nibble, 2i+1 in the high one;
- weight_scale  float8_e4m3fn [N, K/16]: one scale per 16 consecutive inputs of a row;
- weight_scale_2 float32 []: the global scale.
value[n, k] = (E2M1[code] * float32(weight_scale[n, k // 16])) * weight_scale_2, in that order: the first product
is exact in float32, so there is exactly one rounding and every implementation can reproduce the same bits.
An E2M1 code is 4 bits: bit 3 the sign, bits 0-2 an index into the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.

Quantization: weight_scale_2 = amax|W| / (6 * 448) (or given, e.g. shared by an expert's gate and up), so the
largest block scale is e4m3's largest value. Plain absmax then sets each block's scale to amax(block) / 6 /
weight_scale_2 rounded to e4m3, and elements round to the nearest E2M1 value (ties to the even code). With
`search=True` each block also tries the e4m3 scales a few steps below and one step above that one and keeps the
one with the smallest squared error: a smaller scale spends the 8 levels on the bulk of the block instead of its
largest element. Absmax is one of the candidates, so the search never does worse, block by block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
E4M3_MAX_BITS = 0x7E  # 448: the largest finite e4m3 value (0x7F is NaN)
# Midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
# Block-scale candidates of the search, in e4m3 steps from the absmax scale (0 first: ties keep absmax).
SEARCH_STEPS = (0, -1, -2, -3, -4, -5, 1)


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


def _byte_table() -> torch.Tensor:
    """[256, 2] float32: the two values a packed byte holds (low nibble first)."""
    b = torch.arange(256)
    return torch.stack([decode_e2m1(b & 0x0F), decode_e2m1(b >> 4)], dim=-1)


BYTE_TABLE = _byte_table()
_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def byte_table(device: torch.device) -> torch.Tensor:
    """BYTE_TABLE on `device`, copied there once (a copy per call would be a host transfer inside a CUDA graph)."""
    table = _BYTE_TABLES.get(device)
    if table is None:
        table = _BYTE_TABLES[device] = BYTE_TABLE.to(device)
    return table


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 for a tensor (or tensors sharing one): amax / (6 * 448), float32 []."""
    amax = w.detach().abs().max().float()
    return (amax / (6.0 * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny).reshape(())


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, ties to the even code, saturating at +-6 (float in, float out).

    The grid has step 0.5 below 2, 1 from 2 to 4 and 2 from 4 to 6, and round-half-to-even on the multiple of the
    step lands on the even code at every tie, so one division and one torch.round do it.
    """
    mag = x.abs().clamp(max=6.0)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    return torch.round(mag / step) * step * torch.sign(x)


def _codes_of(values: torch.Tensor) -> torch.Tensor:
    """Exact E2M1 values -> uint8 codes."""
    mag = values.abs()
    idx = torch.where(mag <= 2.0, mag * 2, torch.where(mag < 6.0, mag + 2, 7.0)).to(torch.uint8)
    return idx | ((values < 0) & (idx > 0)).to(torch.uint8) << 3


def _round_blocks(blocks: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor):
    """blocks [N, B, 16] float32, scale e4m3 [N, B] -> (E2M1 values [N, B, 16], squared error [N, B])."""
    s = scale.float()[..., None]
    denom = s * scale_2
    values = _round_e2m1(torch.where(denom > 0, blocks / denom, 0.0))
    return values, (values * s * scale_2 - blocks).pow(2).sum(-1)  # the format's own order of products


def quantize(w: torch.Tensor, scale_2: torch.Tensor | None = None, search: bool = False) -> NVFP4Weight:
    """NVFP4 quantization of W [N, K]: absmax block scales, or the best of a few near them with `search`."""
    N, K = w.shape
    if K % BLOCK:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of {BLOCK} (got {K})")
    blocks = w.float().reshape(N, K // BLOCK, BLOCK)
    scale_2 = global_scale(w) if scale_2 is None else scale_2.float().reshape(())
    absmax = (blocks.abs().amax(dim=-1) / 6.0 / scale_2).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    scale = absmax
    values, err = _round_blocks(blocks, scale, scale_2)
    if search:
        bits = absmax.view(torch.uint8).to(torch.int16)
        for step in SEARCH_STEPS[1:]:
            cand_bits = torch.where(bits == 0, bits, (bits + step).clamp(1, E4M3_MAX_BITS))
            cand = cand_bits.to(torch.uint8).view(torch.float8_e4m3fn)
            cand_values, cand_err = _round_blocks(blocks, cand, scale_2)
            better = cand_err < err
            scale = torch.where(better, cand.view(torch.uint8), scale.view(torch.uint8)).view(torch.float8_e4m3fn)
            values = torch.where(better[..., None], cand_values, values)
            err = torch.where(better, cand_err, err)
    return NVFP4Weight(pack_nibbles(_codes_of(values).reshape(N, K)), scale, scale_2.clone())


def dequantize_packed(weight: torch.Tensor, weight_scale: torch.Tensor, row_scale_2: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight uint8 [..., N, K/2], weight_scale e4m3 [..., N, K/16], row_scale_2 float32 [..., N] (each row's
    global scale) -> [..., N, K] in `dtype`, computed in float32 in the format's order, then cast."""
    *lead, N, half = weight.shape
    values = byte_table(weight.device)[weight.long()].reshape(*lead, N, 2 * half // BLOCK, BLOCK)
    out = values * weight_scale.float()[..., None]  # exact: 3 significant bits times 4
    out = out * row_scale_2.float()[..., None, None]
    return out.reshape(*lead, N, 2 * half).to(dtype)


def dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    N, _ = q.shape
    return dequantize_packed(q.weight, q.weight_scale, q.weight_scale_2.float().expand(N), dtype)
