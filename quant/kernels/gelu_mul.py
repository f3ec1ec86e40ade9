"""The gated MLP's activation and product in one pass: h = gelu_tanh(gate) * up, as the two torch ops compute it.

Where the dense MLP's two products are torch's 8-bit matmuls (W8A8: compressed-tensors FP8 / INT8 with per-token
activations), their outputs are 16-bit tensors, and torch would run `gelu` and `*` as two kernels, writing and
reading the activation between them. Here gate and up are read once and h written once, rounded as torch rounds:
gelu_tanh computed in float32 (common.gelu_tanh) and rounded to the compute dtype, the product of that and up in
float32, rounded again. gate, up and h are contiguous [..., N] of one shape and dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import gelu_tanh, store_rounded, to_compute

BLOCK = 2048


@triton.jit
def gelu_mul_kernel(g_ptr, u_ptr, h_ptr, N, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    gate = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = to_compute(gelu_tanh(gate), h_ptr.dtype.element_ty, EMULATE).to(tl.float32)
    store_rounded(h_ptr + offs, act * up, mask, EMULATE)


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up, [..., N] -> [..., N] in their dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    h = torch.empty_like(gate, memory_format=torch.contiguous_format)
    N = h.numel()
    if N:
        gelu_mul_kernel[(triton.cdiv(N, BLOCK),)](gate.contiguous(), up.contiguous(), h, N, BLOCK, interpreting(),
                                                  num_warps=8)
    return h


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The two torch ops the kernel replaces."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
