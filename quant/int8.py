"""dgemma's INT8 weight format: symmetric, one float32 scale per output channel.

For a weight W [N, K]: `weight` int8 [N, K] and `weight_scale` float32 [N]; value = weight * weight_scale[:, None]
(float32). Quantization: weight = round(W / weight_scale) clamped to [-127, 127] (round half to even, torch.round);
-128 is never used, so the format is symmetric. Plain absmax sets weight_scale = amax|W[n, :]| / 127. With
`search=True` each row also tries scales a little below absmax (clipping its few largest values) and keeps the one
with the smallest squared error; absmax is a candidate, so the search never does worse, row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Row-scale candidates of the search, as fractions of the absmax scale (1.0 first: ties keep absmax).
SEARCH_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8)


@dataclass
class Int8Weight:
    weight: torch.Tensor  # int8 [N, K]
    weight_scale: torch.Tensor  # float32 [N]


def _round_rows(w: torch.Tensor, scale: torch.Tensor):
    q = torch.round(w / scale[:, None]).clamp(-127, 127)
    return q.to(torch.int8), (q * scale[:, None] - w).pow(2).sum(dim=1)


def quantize(w: torch.Tensor, search: bool = False) -> Int8Weight:
    w = w.float()
    absmax = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    scale = absmax
    q, err = _round_rows(w, scale)
    if search:
        for f in SEARCH_FACTORS[1:]:
            cand = (absmax * f).clamp(min=torch.finfo(torch.float32).tiny)
            cq, cerr = _round_rows(w, cand)
            better = cerr < err
            q = torch.where(better[:, None], cq, q)
            scale = torch.where(better, cand, scale)
            err = torch.where(better, cerr, err)
    return Int8Weight(q, scale)


def dequantize_packed(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    """weight int8 [..., N, K], weight_scale float32 [..., N] -> [..., N, K] in `dtype` (float32 product, cast)."""
    return (weight.float() * weight_scale.float()[..., None]).to(dtype)


def dequantize(q: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_packed(q.weight, q.weight_scale, dtype)
