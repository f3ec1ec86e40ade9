"""dgemma's INT8 weight format: symmetric, one float32 scale per output channel.

For a weight W [N, K]: `weight` int8 [N, K] and `weight_scale` float32 [N]; value = weight * weight_scale[:, None].
Reference quantization: weight_scale = amax|W[n, :]| / 127, weight = round(W / weight_scale) clamped to [-127, 127]
(round half to even, torch.round). -128 is never used, so the format is symmetric.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Weight:
    weight: torch.Tensor  # int8 [N, K]
    weight_scale: torch.Tensor  # float32 [N]


def quantize(w: torch.Tensor) -> Int8Weight:
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def dequantize(q: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.weight.float() * q.weight_scale.float()[:, None]).to(dtype)
