"""Routed experts, second half: out[t*K + k] = w[t, k] * (h W_down[e]^T) for every assignment, in place.

Operands: h [P, I] compute dtype in the block plan's padded row order (moe_gate_up.py); sorted_ids, block_expert
(routing.py); down weights [E, H, I] in one format (FORMAT: 0 NVFP4 packed [E, H, I/2] with e4m3 scales
[E, H, I/16] and global scales [E, S]; 1 INT8 [E, H, I] with row scales [E, H]); top_k_weights float32 [T*K]
(the router's weights, by assignment); out float32 [T*K, H]. A program takes one block and BLOCK_N columns of H,
computes the block's rows times the expert's dequantized tile (float32 accumulation, output rounded to the
compute dtype as the reference's matmul is), scales each row by its routing weight in float32, and stores it at
its assignment's row: the scatter back to token order is fused into the store. The caller sums each token's K
rows in slot order, as the reference does, so the result does not depend on which block ran first (no atomics:
the same input gives the same bits on every run).
"""

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import dot_acc, round_bf16, to_compute
from .moe_gate_up import weight_tile


@triton.jit
def moe_down_kernel(h_ptr, ids_ptr, block_expert_ptr, w_ptr, s_ptr, s2_ptr, tw_ptr, y_ptr, H, I, E, TOPK, SEG,
                    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    IEEE: tl.constexpr, EMULATE: tl.constexpr, BF16: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + slots)
    live = ids >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        h = tl.load(h_ptr + slots[:, None].to(tl.int64) * I + rk[None, :], mask=live[:, None] & (rk[None, :] < I),
                    other=0.0)
        w = weight_tile(w_ptr, s_ptr, s2_ptr, e, cols, k0, I, H, SEG, FORMAT, BLOCK_K, BLOCK_N)
        acc = dot_acc(acc, h, tl.trans(to_compute(w, h.dtype, EMULATE)), IEEE, EMULATE)
    if BF16:  # the reference's matmul output is in the compute dtype
        if EMULATE:
            acc = round_bf16(acc)
        else:
            acc = acc.to(tl.bfloat16).to(tl.float32)
    row = tl.where(live, ids, 0)
    weight = tl.load(tw_ptr + row, mask=live, other=0.0)
    tl.store(y_ptr + row[:, None].to(tl.int64) * H + cols[None, :], acc * weight[:, None],
             mask=live[:, None] & (cols[None, :] < H))


def moe_down(h: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, fmt: str, weight: torch.Tensor,
             scale: torch.Tensor, scale_2: torch.Tensor | None, top_k_weights: torch.Tensor, tokens: int,
             topk: int, block_m: int) -> torch.Tensor:
    """-> float32 [tokens, H]: each token's K weighted expert outputs summed in slot order."""
    E, H = weight.shape[0], weight.shape[1]
    I = h.shape[1]
    y = torch.empty(tokens * topk, H, dtype=torch.float32, device=h.device)  # every row is written: one per assignment
    nvfp4 = fmt == "nvfp4"
    if nvfp4:
        scale, s2, seg_rows = scale.view(torch.uint8), scale_2.float().contiguous(), H // scale_2.shape[1]
    else:
        s2, seg_rows = scale, 1
    BLOCK_N = 64 if H % 64 == 0 else 32
    BLOCK_K = 64 if I % 64 == 0 else 32
    grid = (block_expert.numel(), triton.cdiv(H, BLOCK_N))
    moe_down_kernel[grid](h, sorted_ids, block_expert, weight, scale, s2, top_k_weights.float().contiguous(), y, H, I,
                          E, topk, seg_rows, 0 if nvfp4 else 1, block_m, BLOCK_N, BLOCK_K, h.dtype == torch.float32,
                          interpreting(), h.dtype == torch.bfloat16)
    return y.view(tokens, topk, H).sum(dim=1)
