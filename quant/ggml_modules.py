"""GGUF weights held as their blocks: a linear and an expert stack that keep a tensor's bytes as the file has them
(rows of ggml blocks, quant/ggml.py) and decode them where they are used, so a GGUF model takes its file's size in
memory, not its 16-bit size.

The decode is one Triton kernel where it runs (kernels/ggml_decode.py), else torch's (quant/ggml.py); both are bit
for bit `gguf.dequantize` in the interpreter. A linear decodes its matrix each call, an expert stack a few experts at
a time as the other packed stacks do (dgemma_cli/model.py QuantizedExperts: one layer's experts unpacked at most).
No matmul reads the blocks in its tiles yet: a layer's decode is written out and read back.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import ggml
from .modules import _Stack


def decode(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The blocks' weights: one Triton kernel where it runs (kernels/ggml_decode.py, checked on first use), else
    quant/ggml.py's torch decode."""
    from .kernels import use_triton
    from .kernels.probe import family_ok

    if kind in ggml_decode_kinds() and use_triton(raw.device) and family_ok("ggml_decode", raw.device, dtype):
        from .kernels.ggml_decode import ggml_decode

        return ggml_decode(raw, kind, shape, dtype)
    return ggml.decode(raw, kind, shape, dtype)


def ggml_decode_kinds() -> tuple[str, ...]:
    from .kernels.ggml_decode import KINDS

    return KINDS


class GGUFLinear(nn.Module):
    """y = x W^T with W [out, in] held as ggml blocks of `kind` (uint8 [out, row bytes])."""

    format = "gguf"

    def __init__(self, in_features: int, out_features: int, kind: str, device=None):
        super().__init__()
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.register_buffer("weight", torch.empty(out_features, ggml.row_bytes(kind, in_features), dtype=torch.uint8,
                                                   device=device))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return decode(self.weight, self.kind, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class GGUFStack(_Stack):
    """E matrices [N, K] held as ggml blocks of `kind` (uint8 [E, N, row bytes]): the routed experts' gate-up (gate
    rows, then up) or down stack as the file stores it."""

    format = "gguf"

    def __init__(self, num: int, out_features: int, in_features: int, kind: str, device=None):
        super().__init__()
        self.shape, self.kind = (num, out_features, in_features), kind
        self.register_buffer("weight", torch.empty(num, out_features, ggml.row_bytes(kind, in_features),
                                                   dtype=torch.uint8, device=device))

    def dequantize_experts(self, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        _, N, K = self.shape
        return decode(self.weight[lo:hi], self.kind, (hi - lo, N, K), dtype)

    def fused_experts(self, down, x, top_k_index, top_k_weights, ordered: bool = False, lora=None):
        return None  # no fused kernel reads ggml blocks yet: the reference path, a layer unpacked at a time

    def takes_pair_order(self, down, x) -> bool:
        return False
