"""The logits' soft-capping, fused with their conversion to float32: out = tanh(float32(x) / cap) * cap, one pass.

The torch path (dgemma_cli/model.py DiffusionGemma.logits) copies the 16-bit logits into the sampler's float32
buffer and caps them in place: four passes over a canvas x vocab float32 tensor (268 MB per canvas of 256 at the
real vocabulary). Here: x read once (16-bit), out written once. tanh is computed as sign(v) (1 - e^(-2|v|)) /
(1 + e^(-2|v|)), which differs from torch's tanh by at most 3e-6 in absolute terms at cap 30 (measured over 100,003
values of scale 40 in bfloat16): far below what sampling can tell. x and out contiguous [N] (any shape, flattened).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def softcap_kernel(x_ptr, out_ptr, N, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.math.div_rn(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), cap)
    e = tl.exp(-2.0 * tl.abs(v))
    t = (1.0 - e) / (1.0 + e)
    tl.store(out_ptr + offs, tl.where(v < 0, -t, t) * cap, mask=mask)


def softcap_into(out: torch.Tensor, x: torch.Tensor, cap: float) -> torch.Tensor:
    """out (float32, x's element count) = tanh(x / cap) * cap; returns out."""
    if out.dtype != torch.float32 or out.numel() != x.numel() or not out.is_contiguous():
        raise ValueError("out must be a contiguous float32 tensor with x's element count")
    N = x.numel()
    if N:
        softcap_kernel[(triton.cdiv(N, BLOCK),)](x.contiguous(), out, N, float(cap), BLOCK, num_warps=8)
    return out
