"""Routed experts, second half: y[t] = sum_k w[t, k] * (h[t*K + k] W_down[e]^T), in two kernels.

Operands: h [P, I] compute dtype in the block plan's padded row order (moe_gate_up.py; NVFP4: each group of 8
columns in the decode's pair order, as its weights decode); sorted_ids, block_expert
(routing.py); down weights [E, H, I] in one format (FORMAT: 0 NVFP4 packed [E, H, I/2] read as int32 words, e4m3
scales [E, H, I/16], global scales [E, S]; 1 INT8 [E, H, I] with row scales [E, H]); top_k_weights float32 [T*K]
(the router's weights, by assignment).
1. `moe_down_kernel`: a program takes one block and BLOCK_N columns of H, multiplies the block's rows by the
   expert's decoded tile (float32 accumulation; NVFP4's global scale in the epilogue), rounds to the compute dtype
   as the reference's matmul output is, and stores each row at its assignment's row of ys [T*K, H] (compute dtype):
   the scatter back to token order is fused into the store. LORA (adapters, moe_lora.py): the epilogue adds the
   block's rows' t B_e^T (t = h A_e^T, made by moe_lora_shrink) before the rounding.
2. `moe_sum_kernel`: out[t] = sum over k = 0..K-1, in slot order, of w[t, k] * ys[t*K + k] in float32, as the
   reference sums, rounded once to the compute dtype.
No atomics: the same input gives the same bits on every run. The buffer between the two is in the compute dtype
(half the bytes of a float32 one), and it holds exactly the values the reference rounds there.
"""

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import block_rows, dot_acc, store_rounded
from .ggml_decode import KINDS
from .moe_gate_up import FORMATS, gguf_block_k, half_factor, input_order, lora_operands, weight_tile
from .moe_lora import LoRAFactors, lora_epilogue


@triton.jit
def moe_down_kernel(h_ptr, ids_ptr, block_expert_ptr, w_ptr, s_ptr, s2_ptr, ys_ptr, t_ptr, lb_ptr, H, I, E,
                    FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
                    LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, KIND: tl.constexpr = 0):
    pid_n = tl.program_id(0)  # fastest: the programs of one block share its h rows (L2)
    pid_b = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of H
    dtype = ys_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    order = input_order(FORMAT, KIND, BLOCK_K)
    for k0 in range(0, I, BLOCK_K):
        rk = k0 + order
        if EVEN:
            h = tl.load(h_ptr + slots[:, None].to(tl.int64) * I + rk[None, :], mask=live[:, None], other=0.0)
        else:
            h = tl.load(h_ptr + slots[:, None].to(tl.int64) * I + rk[None, :],
                        mask=live[:, None] & (rk[None, :] < I), other=0.0)
        w = weight_tile(w_ptr, s_ptr, e, cols, k0, I, H, FORMAT, BLOCK_K, BLOCK_N, dtype, EVEN, EMULATE, KIND)
        acc = dot_acc(acc, h, tl.trans(w), IEEE, EMULATE)
    acc = acc * half_factor(s2_ptr, e, False, 1, FORMAT, dtype)  # one global scale per expert
    if LORA:  # the adapters' t B_e^T (moe_lora.py)
        acc = lora_epilogue(acc, t_ptr, lb_ptr, slots, live, e, cols, H, BLOCK_R, IEEE, EMULATE)
    row = tl.where(live, ids, 0)
    store_rounded(ys_ptr + row[:, None].to(tl.int64) * H + cols[None, :], acc,
                  live[:, None] & (cols[None, :] < H), EMULATE)


@triton.jit
def moe_sum_kernel(ys_ptr, tw_ptr, y_ptr, H, TOPK: tl.constexpr, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(TOPK):  # slot order, as the reference sums
        w = tl.load(tw_ptr + t * TOPK + k)
        acc += tl.load(ys_ptr + (t * TOPK + k) * H + cols, mask=m, other=0.0).to(tl.float32) * w
    store_rounded(y_ptr + t * H + cols, acc, m, EMULATE)


def moe_down(h: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, fmt: str, weight: torch.Tensor,
             scale: torch.Tensor, scale_2: torch.Tensor | None, top_k_weights: torch.Tensor, tokens: int,
             topk: int, cfg: dict, lora: LoRAFactors | None = None,
             token_slots: torch.Tensor | None = None, kind: str | None = None) -> torch.Tensor:
    """-> [tokens, H] in h's dtype: each token's K weighted expert outputs summed in slot order (float32). lora,
    token_slots: adapters' low-rank terms on the down projection (moe_gate_up's). fmt "gguf": weight is the file's
    blocks [E, H, row bytes] of block type `kind`, scale and scale_2 None."""
    E, H = weight.shape[0], weight.shape[1]
    I = h.shape[1]
    ys = torch.empty(tokens * topk, H, dtype=h.dtype, device=h.device)  # every row is written: one per assignment
    nvfp4 = fmt == "nvfp4"
    if nvfp4:
        if scale_2.shape[1] != 1:  # the epilogue takes one global scale per expert
            raise ValueError(f"NVFP4 down stacks have one global scale per expert (got {scale_2.shape[1]})")
        weight, scale, s2 = weight.contiguous().view(torch.int32), scale.view(torch.uint8), scale_2.float().contiguous()
    else:
        scale = weight if scale is None else scale  # GGUF: the scales are in the blocks
        s2 = scale  # unused
    if fmt == "gguf":
        cfg = dict(cfg, DN_K=gguf_block_k(cfg["DN_K"], kind))
    grid = (triton.cdiv(H, cfg["DN_N"]), block_expert.numel())
    t, lb, rank = lora_operands(lora, h, sorted_ids, block_expert, token_slots, topk, cfg["BLOCK_M"], False, nvfp4,
                                (E, H, I))
    moe_down_kernel[grid](h, sorted_ids, block_expert, weight.contiguous(), scale, s2, ys, t, lb, H, I, E,
                          FORMATS[fmt], cfg["BLOCK_M"], cfg["DN_N"], cfg["DN_K"],
                          H % cfg["DN_N"] == 0 and I % cfg["DN_K"] == 0, h.dtype == torch.float32,
                          interpreting(), lora is not None, rank, KINDS.index(kind) if kind else 0,
                          num_warps=cfg["DN_W"])
    y = torch.empty(tokens, H, dtype=h.dtype, device=h.device)
    block = min(1024, triton.next_power_of_2(H))
    moe_sum_kernel[(tokens, triton.cdiv(H, block))](ys, top_k_weights.float().contiguous(), y, H, topk, block,
                                                    interpreting())
    return y
