"""Routed experts in W4A4: NVFP4 activations x NVFP4 weights on the block-scaled FP4 tensor cores (sm_100, sm_120).

The same two stages as moe_gate_up.py / moe_down.py (the block plan of routing.py, one block of one expert per
program, the down outputs stored at their assignment's row and summed in slot order by moe_down.moe_sum_kernel), with
the activations in NVFP4 as nvfp4_act.quantize_act leaves them: with one static global scale per stage where the
checkpoint has calibrated `input_scale`s (the largest over the layer's experts, gate and up: x is quantized once per
token for all its experts, as serving engines do with ModelOpt's checkpoints), otherwise per-row scales:
- gate-up: xq uint8 [T, H/2], xs e4m3 bits [T, H/16], xg float32 [T] (x quantized once per token, shared by its
  experts); weights uint8 [E, 2I, H/2], e4m3 bits [E, 2I, H/16], global scales float32 [E, S]; out h [P, I] in the
  compute dtype, as moe_gate_up_kernel rounds it (gate and up rounded, gelu_tanh(gate) rounded, times up);
- down: h quantized per row (hq [P, I/2], hs [P, I/16], hg [P]); weights [E, H, I/2], [E, H, I/16], [E, S];
  ys [T*K, H] in the compute dtype.
Each K step is one `tl.dot_scaled` (e2m1 x e2m1, one e4m3 scale per 16 inputs each side: products of exact a * s),
float32 accumulation, and the epilogue multiplies by the row's activation global scale and the weight's global
scale. EMULATE (the interpreter, whose dot_scaled reads e4m3 scales as e8m0): both tiles decoded to float32 a * s
(common.nvfp4_tile, exact) and an IEEE float32 dot. `reference` is the PyTorch emulation the tests compare with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import (UNSHIFT, block_rows, gate_up_rows, gelu_tanh, global_segments, load_nvfp4_tile, segment_scale,
                     split_gate_up, store_rounded, to_compute)
from .moe_lora import ExpertAdapters, lora_epilogue


@triton.jit
def fp4_product(acc, aq_ptr, as_ptr, a_rows, a_live, NA, w_ptr, ws_ptr, w_rows, NW, k0, K,
                BLOCK_A: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """acc [BLOCK_A, BLOCK_N] + (a rows `a_rows` of an NVFP4 activation) x (weight rows `w_rows`)^T over inputs
    k0..k0+BLOCK_K, both as exact a * s products (global scales left to the caller). Rows are absolute row numbers
    (int64) of [*, K/2] code arrays with [*, K/16] scale bytes; rows not live (a_live False) or >= NW read as 0."""
    if EMULATE:
        rows = tl.where(a_live, a_rows, NA)  # a row past the end: masked to zero
        a = load_nvfp4_tile(aq_ptr.to(tl.pointer_type(tl.int32)), as_ptr, rows, k0, K, NA, BLOCK_A, BLOCK_K, True,
                            True, True).to(tl.float32) * UNSHIFT
        w = load_nvfp4_tile(w_ptr.to(tl.pointer_type(tl.int32)), ws_ptr, w_rows, k0, K, NW, BLOCK_N, BLOCK_K, True,
                            True, True).to(tl.float32) * UNSHIFT
        return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        aq = tl.load(aq_ptr + a_rows[:, None] * (K // 2) + kb[None, :], mask=a_live[:, None], other=0)
        asc = tl.load(as_ptr + a_rows[:, None] * (K // 16) + ks[None, :], mask=a_live[:, None], other=0)
        wq = tl.load(w_ptr + w_rows[None, :] * (K // 2) + kb[:, None], mask=w_rows[None, :] < NW, other=0)
        wsc = tl.load(ws_ptr + w_rows[:, None] * (K // 16) + ks[None, :], mask=w_rows[:, None] < NW, other=0)
        return tl.dot_scaled(aq, asc.to(tl.float8e4nv, bitcast=True), "e2m1",
                             wq, wsc.to(tl.float8e4nv, bitcast=True), "e2m1", acc)


@triton.jit
def moe_gate_up_w4a4_kernel(xq_ptr, xs_ptr, xg_ptr, ids_ptr, block_expert_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, t_ptr,
                            lb_ptr, T, H, I, E, TOPK, NSEG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, LORA: tl.constexpr = False,
                            BLOCK_R: tl.constexpr = 16, IEEE: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    tok = tl.where(live, ids // TOPK, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of I
    # gate rows cols and up rows I + cols as one weight tile: one FP4 product per K step, as wide as both (one
    # accumulator, the activation tile read once)
    rows = e.to(tl.int64) * 2 * I + gate_up_rows(pid_n, I, BLOCK_N)
    end = (e.to(tl.int64) + 1) * 2 * I
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc = fp4_product(acc, xq_ptr, xs_ptr, tok, live, T, w_ptr, s_ptr, rows, end, k0, H, BLOCK_M, 2 * BLOCK_N,
                          BLOCK_K, EMULATE)
    acc_g, acc_u = split_gate_up(acc, BLOCK_M, BLOCK_N)
    xg = tl.load(xg_ptr + tok, mask=live, other=0.0)[:, None]
    dtype = h_ptr.dtype.element_ty
    s2_g = segment_scale(s2_ptr, e, False, NSEG)
    s2_u = segment_scale(s2_ptr, e, True, NSEG)
    acc_g = acc_g * xg * s2_g
    acc_u = acc_u * xg * s2_u
    if LORA:  # the adapters' t B_e^T (moe_lora.py, t from the 16-bit x) for the gate and up rows
        acc_g = lora_epilogue(acc_g, t_ptr, lb_ptr, slots, live, e, cols, 2 * I, BLOCK_R, IEEE, EMULATE)
        acc_u = lora_epilogue(acc_u, t_ptr, lb_ptr, slots, live, e, I + cols, 2 * I, BLOCK_R, IEEE, EMULATE)
    gate = to_compute(acc_g, dtype, EMULATE).to(tl.float32)
    up = to_compute(acc_u, dtype, EMULATE).to(tl.float32)
    act = to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32)
    store_rounded(h_ptr + slots[:, None].to(tl.int64) * I + cols[None, :], act * up,
                  live[:, None] & (cols[None, :] < I), EMULATE)


@triton.jit
def moe_down_w4a4_kernel(hq_ptr, hs_ptr, hg_ptr, ids_ptr, block_expert_ptr, w_ptr, s_ptr, s2_ptr, ys_ptr, t_ptr,
                         lb_ptr, P, H, I, E, SEG, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EMULATE: tl.constexpr, LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
                         IEEE: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_b = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    slots = slots.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc = fp4_product(acc, hq_ptr, hs_ptr, slots, live, P, w_ptr, s_ptr, e.to(tl.int64) * H + cols,
                          (e.to(tl.int64) + 1) * H, k0, I, BLOCK_M, BLOCK_N, BLOCK_K, EMULATE)
    hg = tl.load(hg_ptr + slots, mask=live, other=0.0)[:, None]
    s2 = tl.load(s2_ptr + e * (H // SEG) + cols // SEG, mask=cols < H, other=0.0)
    acc = acc * hg * s2[None, :]
    if LORA:  # the adapters' t B_e^T (t from the 16-bit h)
        acc = lora_epilogue(acc, t_ptr, lb_ptr, slots, live, e, cols, H, BLOCK_R, IEEE, EMULATE)
    row = tl.where(live, ids, 0)
    store_rounded(ys_ptr + row[:, None].to(tl.int64) * H + cols[None, :], acc, live[:, None] & (cols[None, :] < H),
                  EMULATE)


def block_w4a4(rows_per_expert: float, H: int, I: int, device: torch.device) -> tuple[int, int]:
    """(rows per block, warps). sm_100's FP4 MMA (tcgen05) takes 128 rows: fewer and Triton falls back to 16-bit
    MMAs there, so 128 rows and 8 warps (4 spill); sm_120's (mma.sync with block scales) takes the mma.sync rows of
    moe_gate_up.candidates (make kernel-report)."""
    from . import arch
    from .moe_gate_up import candidates

    if 100 <= arch(device) < 120:
        return 128, 8
    return candidates(rows_per_expert, H, I, device)[0]["BLOCK_M"], 4


def moe_w4a4(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, gate_up, down,
             top_k_weights: torch.Tensor, tokens: int, topk: int, block_m: int, warps: int = 4,
             x_scale: torch.Tensor | None = None, h_scale: torch.Tensor | None = None,
             lora: ExpertAdapters | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] through both W4A4 stages and the slot-order sum; gate_up / down are quant.modules'
    NVFP4Stack (their weight, weight_scale, weight_scale_2 buffers). x_scale, h_scale: static global scales (float32,
    one element) for the activations of each stage, or None for per-row scales. lora: adapters' terms, their rank
    products taken from the 16-bit x and h (moe_lora.moe_lora_shrink), added in the epilogues."""
    from .moe_gate_up import lora_operands
    from .moe_down import moe_sum_kernel
    from .nvfp4_act import quantize_act

    T, H = x.shape
    E, two_i = gate_up.weight.shape[0], gate_up.weight.shape[1]
    I = two_i // 2
    if H % 64 or I % 64:
        raise ValueError(f"W4A4 experts need hidden and expert widths that are multiples of 64 (got {H}, {I})")
    segments = global_segments(gate_up.weight_scale_2)
    emulate = interpreting()
    xq, xs, xg = quantize_act(x, global_scale=x_scale)
    P = sorted_ids.numel()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)  # padding rows stay unwritten and unread
    block_n, block_k = 64, 128 if H % 128 == 0 else 64
    gu_lora, dn_lora, slots = lora if lora is not None else (None, None, None)
    ieee = x.dtype == torch.float32
    t, lb, rank = lora_operands(gu_lora, x.contiguous(), sorted_ids, block_expert, slots, topk, block_m, True, False,
                                (E, two_i, H))
    moe_gate_up_w4a4_kernel[(triton.cdiv(I, block_n), block_expert.numel())](
        xq, xs, xg, sorted_ids, block_expert, gate_up.weight, gate_up.weight_scale.view(torch.uint8),
        gate_up.weight_scale_2.float().contiguous(), h, t, lb, T, H, I, E, topk, segments, block_m, block_n, block_k,
        emulate, gu_lora is not None, rank, ieee, num_warps=warps)
    hq, hs, hg = quantize_act(h, sorted_ids, h_scale)  # the plan's padding rows are never read
    ys = torch.empty(tokens * topk, H, dtype=x.dtype, device=x.device)
    t, lb, rank = lora_operands(dn_lora, h, sorted_ids, block_expert, slots, topk, block_m, False, False, (E, H, I))
    moe_down_w4a4_kernel[(triton.cdiv(H, 128), block_expert.numel())](
        hq, hs, hg, sorted_ids, block_expert, down.weight, down.weight_scale.view(torch.uint8),
        down.weight_scale_2.float().contiguous(), ys, t, lb, P, H, I, E, H // down.weight_scale_2.shape[1], block_m,
        128, 64, emulate, dn_lora is not None, rank, ieee, num_warps=warps)
    y = torch.empty(tokens, H, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(H))
    moe_sum_kernel[(tokens, triton.cdiv(H, block))](ys, top_k_weights.float().contiguous(), y, H, topk, block,
                                                    emulate)
    return y


def reference(x: torch.Tensor, gate_up, down, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
              x_scale: torch.Tensor | None = None, h_scale: torch.Tensor | None = None,
              lora: ExpertAdapters | None = None) -> torch.Tensor:
    """The PyTorch emulation of moe_w4a4: per token x quantized (nvfp4_act's reference), exact a * s operands, float32
    products scaled by the two global scales and rounded to the compute dtype where the kernels round, h quantized
    per assignment, the down product, the float32 slot-order sum. lora: each product plus the adapters' term (the
    16-bit input's rank product with the expert's A, masked to the token's adapter and rounded, times B) before its
    rounding."""
    import torch.nn.functional as F

    from .. import nvfp4
    from .nvfp4_act import quantize_act_reference

    def fp4_rows(a: torch.Tensor, scale) -> tuple[torch.Tensor, torch.Tensor]:  # -> (a * s float32 [R, K], g [R])
        q, s, g = quantize_act_reference(a, scale)
        return nvfp4.dequantize_packed(q, s.view(torch.float8_e4m3fn), torch.ones(a.shape[0]), torch.float32), g

    def weights(stack, e: int) -> tuple[torch.Tensor, torch.Tensor]:  # -> (a * s [N, K], global scale per row [N])
        N = stack.weight.shape[1]
        w = nvfp4.dequantize_packed(stack.weight[e], stack.weight_scale[e], torch.ones(N), torch.float32)
        return w, stack.weight_scale_2[e].float().repeat_interleave(N // stack.weight_scale_2.shape[1])

    dtype = x.dtype
    T, K = top_k_index.shape
    I = gate_up.weight.shape[1] // 2
    def term(a: torch.Tensor, factors, e: int, t: int) -> torch.Tensor | float:  # the adapters' [N] float32, or 0
        if factors is None:
            return 0.0
        r = a.float() @ factors.A[e].float().T
        if lora.token_slots is not None:
            r = r * (factors.slot == lora.token_slots[t]).float()
        return r.to(dtype).float() @ factors.B[e].float().T

    gu_lora, dn_lora = (lora.gate_up, lora.down) if lora is not None else (None, None)
    xa, xg = fp4_rows(x, x_scale)
    ys = torch.empty(T, K, x.shape[1], dtype=dtype)
    for t in range(T):
        for k in range(K):
            e = int(top_k_index[t, k])
            w, s2 = weights(gate_up, e)
            gu = (xa[t] @ w.T) * xg[t] * s2 + term(x[t], gu_lora, e, t)  # [2I] float32
            gate, up = gu[:I].to(dtype).float(), gu[I:].to(dtype).float()
            h = (F.gelu(gate, approximate="tanh").to(dtype).float() * up).to(dtype)
            ha, hg = fp4_rows(h[None], h_scale)
            w, s2 = weights(down, e)
            ys[t, k] = ((ha[0] @ w.T) * hg[0] * s2 + term(h, dn_lora, e, t)).to(dtype)
    return (ys.float() * top_k_weights.float()[..., None]).sum(dim=1).to(dtype)
