"""Routed experts, first half: h = gelu_tanh(x W_gate^T) * (x W_up^T) per token-expert assignment, fused.

Operands (E experts, hidden H, expert width I, T tokens, top-k K):
- x            [T, H] compute dtype (float32 / bfloat16), rows contiguous;
- sorted_ids, block_expert: the block plan (routing.py): BLOCK_M rows of one expert per block, -1 rows padding;
- gate_up weights [E, 2I, H] in one format (FORMAT constexpr):
  NVFP4 (0): packed uint8 [E, 2I, H/2] (low nibble first), scales e4m3 bits [E, 2I, H/16], global scales float32
  [E, S] over S equal row segments (ModelOpt keeps gate and up apart: S = 2); INT8 (1): int8 [E, 2I, H] and
  float32 row scales [E, 2I] (the `s2_ptr` operand is unused);
  rows 0..I-1 are the gate, I..2I-1 the up projection;
- h            [max_blocks * BLOCK_M, I] compute dtype, in the plan's padded row order (padding rows untouched).
A program takes one block (one expert) and BLOCK_N columns of I, gathers its BLOCK_M token rows of x, and walks H
in BLOCK_K steps dequantizing the gate and up tiles in registers (as the reference rounds them: (code * scale) *
scale_2 in float32, then the compute dtype); gate and up accumulate in float32 and are rounded to the compute dtype
before the activation, as the reference's two matmuls are, then the product is rounded once more.
"""

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import dot_acc, e2m1_value, e4m3_value, gelu_tanh, store_rounded, to_compute
from .routing import moe_blocks  # noqa: F401  (re-exported for callers)


@triton.jit
def weight_tile(w_ptr, s_ptr, s2_ptr, e, rows, k0, H, NROWS, SEG, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Dequantized float32 tile [BLOCK_N, BLOCK_K] of expert e's rows `rows` at inputs k0..k0+BLOCK_K (rows of an
    [E, NROWS, H] stack; SEG rows share one global scale)."""
    rmask = rows[:, None] < NROWS
    if FORMAT == 0:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        m = rmask & (kb[None, :] < H // 2)
        base = e.to(tl.int64) * NROWS + rows[:, None]
        packed = tl.load(w_ptr + base * (H // 2) + kb[None, :], mask=m, other=0).to(tl.int32)
        scale = e4m3_value(tl.load(s_ptr + base * (H // 16) + kb[None, :] // 8, mask=m, other=0).to(tl.int32))
        s2 = tl.load(s2_ptr + e * (NROWS // SEG) + rows // SEG, mask=rows < NROWS, other=0.0)
        lo = (e2m1_value(packed & 15) * scale) * s2[:, None]
        hi = (e2m1_value(packed >> 4) * scale) * s2[:, None]
        return tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        m = rmask & (rk[None, :] < H)
        base = e.to(tl.int64) * NROWS + rows[:, None]
        q = tl.load(w_ptr + base * H + rk[None, :], mask=m, other=0).to(tl.float32)
        scale = tl.load(s_ptr + e.to(tl.int64) * NROWS + rows, mask=rows < NROWS, other=0.0)
        return q * scale[:, None]


@triton.jit
def moe_gate_up_kernel(x_ptr, ids_ptr, block_expert_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, H, I, E, TOPK, SEG,
                       FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       IEEE: tl.constexpr, EMULATE: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + slots)
    live = ids >= 0
    tok = tl.where(live, ids // TOPK, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of I
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + tok[:, None].to(tl.int64) * H + rk[None, :], mask=live[:, None] & (rk[None, :] < H),
                    other=0.0)
        g = weight_tile(w_ptr, s_ptr, s2_ptr, e, cols, k0, H, 2 * I, SEG, FORMAT, BLOCK_K, BLOCK_N)
        u = weight_tile(w_ptr, s_ptr, s2_ptr, e, cols + I, k0, H, 2 * I, SEG, FORMAT, BLOCK_K, BLOCK_N)
        acc_g = dot_acc(acc_g, x, tl.trans(to_compute(g, x.dtype, EMULATE)), IEEE, EMULATE)
        acc_u = dot_acc(acc_u, x, tl.trans(to_compute(u, x.dtype, EMULATE)), IEEE, EMULATE)
    # the reference rounds both matmul outputs and the activation to the compute dtype
    gate = to_compute(acc_g, h_ptr.dtype.element_ty, EMULATE).to(tl.float32)
    up = to_compute(acc_u, h_ptr.dtype.element_ty, EMULATE).to(tl.float32)
    act = to_compute(gelu_tanh(gate), h_ptr.dtype.element_ty, EMULATE).to(tl.float32)
    store_rounded(h_ptr + slots[:, None].to(tl.int64) * I + cols[None, :], act * up,
                  live[:, None] & (cols[None, :] < I), EMULATE)


def moe_gate_up(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, fmt: str,
                weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, topk: int,
                block_m: int) -> torch.Tensor:
    """-> h [len(sorted_ids), I] (see the module docstring)."""
    T, H = x.shape
    E, two_i = weight.shape[0], weight.shape[1]
    I = two_i // 2
    h = torch.zeros(sorted_ids.numel(), I, dtype=x.dtype, device=x.device)
    nvfp4 = fmt == "nvfp4"
    if nvfp4:
        segments = scale_2.shape[1]
        scale, s2 = scale.view(torch.uint8), scale_2.float().contiguous()
        seg_rows = two_i // segments
    else:
        s2, seg_rows = scale, 1  # unused
    BLOCK_N = 32 if I % 64 else 64
    BLOCK_K = 64 if H % 64 == 0 else 32
    grid = (block_expert.numel(), triton.cdiv(I, BLOCK_N))
    moe_gate_up_kernel[grid](x.contiguous(), sorted_ids, block_expert, weight, scale, s2, h, H, I, E, topk,
                             seg_rows, 0 if nvfp4 else 1, block_m, BLOCK_N, BLOCK_K, x.dtype == torch.float32,
                             interpreting())
    return h
