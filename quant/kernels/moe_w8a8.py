"""Routed experts in W8A8 (compressed-tensors' FP8 / INT8 with dynamic per-token activations): 8-bit activations times
8-bit weights on the tensor cores, INT8 (int8 x int8 -> int32, sm_80+) or FP8 (e4m3 x e4m3 -> float32, sm_89+).

The same plan as moe_gate_up.py / moe_down.py (routing.py's blocks of BLOCK_M rows of one expert, one block per
program, the down outputs stored at their assignment's row, moe_down.moe_sum_kernel's slot-order sum), with every
activation quantized per row exactly as quant/w8a8.quantize_tokens does it, so that this path computes what
quant.modules.experts_emulated does in float32 PyTorch, up to where the sums are rounded:
1. `quantize_rows_kernel`: x [T, H] -> codes [T, H] and scales float32 [T], once per token (every expert a token
   visits multiplies the same codes). scale = max(amax|row| / QMAX, float32 tiny), v = clamp(x / scale, -QMAX, QMAX);
   INT8 codes int8 round(v) (half to even), FP8 codes the e4m3 bits (uint8) of v rounded to the nearest e4m3 value
   (ties to even). Divisions are IEEE (div_rn), as torch divides.
2. `moe_gate_up_w8a8_kernel`: per block of one expert and BLOCK_N columns of I, gate = (sum_k xq wq_gate) * xs * ws
   and up likewise, the sums in int32 (INT8: exact) or float32 (FP8: exact products, float32 sums), the two scales
   applied in the epilogue in that order; h = gelu_tanh(gate) * up in float32, stored [P, I] in the plan's padded row
   order. float32, not the compute dtype: the emulation quantizes the float32 product, and so does the next step.
3. `quantize_rows_kernel` again on h [P, I] (the plan's padding rows, id -1, skipped): hq [P, I], hs [P].
4. `moe_down_w8a8_kernel`: per block and BLOCK_N columns of H, ys[t*K + k] = (sum_i hq wq_down) * hs * ws, float32
   [T*K, H] (the emulation keeps each expert's output in float32 until the weighted sum).
5. moe_down.moe_sum_kernel: y[t] = sum_k w[t, k] ys[t*K + k] in float32 in slot order, rounded once to x's dtype.
Weights as compressed-tensors stores them, stacked: w [E, N, K] int8 or float8_e4m3fn (read as its bits: uint8),
one float32 scale per output channel, ws [E, N] (the [E, N, 1] buffer: the same memory).

Under Triton's interpreter tl.dot runs int8 x int8 in int32 (numpy) and e4m3 x e4m3 by widening both to float16
(exact) and summing in float32, so no separate emulation branch is needed; the FP8 codes are computed with integer
and float32 arithmetic (nvfp4_act.round_e4m3, e4m3_bits), not with a float32 -> e4m3 cast, whose rounding the
interpreter does not implement to nearest-even. `reference_gate_up` / `reference_down` are the PyTorch emulation of
these exact steps that the tests compare with (tests/test_moe_w8a8.py).
"""

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import block_rows, gelu_tanh, row_absmax
from .nvfp4_act import e4m3_bits, round_e4m3

QMAX = {"int8": 127.0, "fp8": 448.0}
MIN_ARCH = {"int8": 80, "fp8": 89}  # INT8 tensor cores from Ampere, FP8 from Ada


def supported(kind: str, device: torch.device) -> bool:
    """Whether `device` has `kind`'s 8-bit tensor cores (kernels.arch: 0 on the CPU and under the interpreter)."""
    from . import arch

    return arch(device) >= MIN_ARCH[kind]


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, ids_ptr, K, QMAX: tl.constexpr, FP8: tl.constexpr,
                         BLOCK_K: tl.constexpr, SKIP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if SKIP:  # the MoE plan's padding rows (id -1): nobody reads their codes
        if tl.load(ids_ptr + row) < 0:
            return
    base = x_ptr + row * K
    scale = tl.maximum(tl.math.div_rn(row_absmax(base, K, BLOCK_K), QMAX), 1.1754943508222875e-38)  # at least tiny
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(base + cols, mask=cols < K, other=0.0).to(tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if FP8:  # e4m3 bits: magnitude rounded to nearest even, the sign bit of v (-0.0 stays -0, as torch's cast)
            sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
            code = (e4m3_bits(round_e4m3(tl.abs(v))) | sign).to(tl.uint8)
        else:  # |v| <= 127: adding and removing 1.5 * 2^23 rounds to the integer, half to even
            code = ((v + 12582912.0) - 12582912.0).to(tl.int8)
        tl.store(q_ptr + row * K + cols, code, mask=cols < K)


@triton.jit
def codes_tile(ptr, rows, live, k0, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, FP8: tl.constexpr):
    """[len(rows), BLOCK_K] codes of rows `rows` (int64 row numbers of a [*, K] array) at inputs k0..k0+BLOCK_K, as
    the dot's operand (int8, or the e4m3 bits read as float8e4nv); rows not `live`, and inputs past K unless EVEN,
    read as zero."""
    rk = k0 + tl.arange(0, BLOCK_K)
    at = ptr + rows[:, None] * K + rk[None, :]
    if EVEN:
        q = tl.load(at, mask=live[:, None], other=0)
    else:
        q = tl.load(at, mask=live[:, None] & (rk[None, :] < K), other=0)
    if FP8:
        return q.to(tl.float8e4nv, bitcast=True)
    else:
        return q


@triton.jit
def dot8(acc, a, w, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """acc + a @ w^T: FP8 into float32 (on sm_90 each BLOCK_K step's partial sum is added to acc in full float32,
    max_num_imprecise_acc), INT8 into int32."""
    if FP8:
        return tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)
    else:
        return tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)


@triton.jit
def moe_gate_up_w8a8_kernel(xq_ptr, xs_ptr, ids_ptr, block_expert_ptr, w_ptr, ws_ptr, h_ptr, H, I, E, TOPK,
                            FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN: tl.constexpr):
    pid_n = tl.program_id(0)  # fastest: the programs of one block share its gathered x rows (L2)
    pid_b = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    tok = tl.where(live, ids // TOPK, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of I
    col_ok = cols < I
    gate_rows = e.to(tl.int64) * 2 * I + cols  # rows of the [E * 2I, H] weights; up rows are I further
    if FP8:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, H, BLOCK_K):
        x = codes_tile(xq_ptr, tok, live, k0, H, BLOCK_K, EVEN, FP8)
        g = codes_tile(w_ptr, gate_rows, col_ok, k0, H, BLOCK_K, EVEN, FP8)
        u = codes_tile(w_ptr, gate_rows + I, col_ok, k0, H, BLOCK_K, EVEN, FP8)
        acc_g = dot8(acc_g, x, g, BLOCK_K, FP8)
        acc_u = dot8(acc_u, x, u, BLOCK_K, FP8)
    xs = tl.load(xs_ptr + tok, mask=live, other=0.0)[:, None]
    gate = acc_g.to(tl.float32) * xs * tl.load(ws_ptr + gate_rows, mask=col_ok, other=0.0)[None, :]
    up = acc_u.to(tl.float32) * xs * tl.load(ws_ptr + gate_rows + I, mask=col_ok, other=0.0)[None, :]
    tl.store(h_ptr + slots[:, None].to(tl.int64) * I + cols[None, :], gelu_tanh(gate) * up,
             mask=live[:, None] & col_ok[None, :])


@triton.jit
def moe_down_w8a8_kernel(hq_ptr, hs_ptr, ids_ptr, block_expert_ptr, w_ptr, ws_ptr, ys_ptr, H, I, E,
                         FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN: tl.constexpr):
    pid_n = tl.program_id(0)  # fastest: the programs of one block share its h rows (L2)
    pid_b = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    slots = slots.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of H
    col_ok = cols < H
    w_rows = e.to(tl.int64) * H + cols
    if FP8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, I, BLOCK_K):
        h = codes_tile(hq_ptr, slots, live, k0, I, BLOCK_K, EVEN, FP8)
        w = codes_tile(w_ptr, w_rows, col_ok, k0, I, BLOCK_K, EVEN, FP8)
        acc = dot8(acc, h, w, BLOCK_K, FP8)
    hs = tl.load(hs_ptr + slots, mask=live, other=0.0)[:, None]
    y = acc.to(tl.float32) * hs * tl.load(ws_ptr + w_rows, mask=col_ok, other=0.0)[None, :]
    row = tl.where(live, ids, 0)
    tl.store(ys_ptr + row[:, None].to(tl.int64) * H + cols[None, :], y, mask=live[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------- wrappers


def quantize_rows(x: torch.Tensor, kind: str, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K]: int8, or e4m3 bits as uint8; scales float32 [M]), as w8a8.quantize_tokens. With
    `ids` [M] int32, rows whose id is negative are skipped (their outputs left uninitialised)."""
    M, K = x.shape
    fp8 = kind == "fp8"
    q = torch.empty(M, K, dtype=torch.uint8 if fp8 else torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    block = min(1024, triton.next_power_of_2(max(16, K)))
    quantize_rows_kernel[(M,)](x.contiguous(), q, s, ids if ids is not None else s, K, QMAX[kind], fp8, block,
                               ids is not None)
    return q, s


def candidates(rows_per_expert: float, H: int, I: int, device: torch.device) -> list[dict]:
    """Launch settings, best first: moe_gate_up.candidates' rows per block, tiles and warps (the same trade-offs:
    one block per expert where the tensor cores read the weights from shared memory, 16 or 32 rows elsewhere), with
    the inner tiles at least 32 deep, the depth of one 8-bit MMA, and 8 warps for a 128-row down block: on sm_90 the
    FP8 product keeps a second float32 accumulator (max_num_imprecise_acc), and 128 x 128 of each spill with 4."""
    from .moe_gate_up import candidates as base

    return [dict(c, GU_K=max(32, c["GU_K"]), DN_K=max(32, c["DN_K"]), DN_W=8 if c["BLOCK_M"] >= 128 else c["DN_W"])
            for c in base(rows_per_expert, H, I, device)]


def weight_operands(stack) -> tuple[torch.Tensor, torch.Tensor]:
    """A W8A8Stack's weight [E, N, K] as the kernels read it (FP8: its bits, uint8) and its scales [E, N] float32."""
    E, N, _ = stack.shape
    w = stack.weight.view(torch.uint8) if stack.weight.dtype == torch.float8_e4m3fn else stack.weight
    return w, stack.weight_scale.reshape(E, N).float().contiguous()


def gate_up_w8a8(xq: torch.Tensor, xs: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, gate_up,
                 topk: int, cfg: dict) -> torch.Tensor:
    """Quantized x (quantize_rows) -> h float32 [len(sorted_ids), I], gelu_tanh(gate) * up (padding rows unwritten)."""
    E, two_i, H = gate_up.shape
    I = two_i // 2
    w, ws = weight_operands(gate_up)
    h = torch.empty(sorted_ids.numel(), I, dtype=torch.float32, device=xq.device)
    grid = (triton.cdiv(I, cfg["GU_N"]), block_expert.numel())
    moe_gate_up_w8a8_kernel[grid](xq, xs, sorted_ids, block_expert, w, ws, h, H, I, E, topk, gate_up.format == "fp8",
                                  cfg["BLOCK_M"], cfg["GU_N"], cfg["GU_K"],
                                  I % cfg["GU_N"] == 0 and H % cfg["GU_K"] == 0, num_warps=cfg["GU_W"])
    return h


def down_w8a8(hq: torch.Tensor, hs: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, down,
              tokens: int, topk: int, cfg: dict) -> torch.Tensor:
    """Quantized h (quantize_rows with the plan's ids) -> ys float32 [tokens * topk, H], one row per assignment."""
    E, H, I = down.shape
    w, ws = weight_operands(down)
    ys = torch.empty(tokens * topk, H, dtype=torch.float32, device=hq.device)  # every row written: one per assignment
    grid = (triton.cdiv(H, cfg["DN_N"]), block_expert.numel())
    moe_down_w8a8_kernel[grid](hq, hs, sorted_ids, block_expert, w, ws, ys, H, I, E, down.format == "fp8",
                               cfg["BLOCK_M"], cfg["DN_N"], cfg["DN_K"],
                               H % cfg["DN_N"] == 0 and I % cfg["DN_K"] == 0, num_warps=cfg["DN_W"])
    return ys


def moe_w8a8(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, gate_up, down,
             top_k_weights: torch.Tensor, tokens: int, topk: int, cfg: dict) -> torch.Tensor:
    """x [T, H] -> [T, H] in x's dtype through the five steps of the module docstring; gate_up / down are
    quant.modules' W8A8Stack (weight, weight_scale), both of one kind; cfg from `candidates`."""
    from .moe_down import moe_sum_kernel

    kind = gate_up.format
    H = x.shape[1]
    xq, xs = quantize_rows(x, kind)
    h = gate_up_w8a8(xq, xs, sorted_ids, block_expert, gate_up, topk, cfg)
    hq, hs = quantize_rows(h, kind, sorted_ids)
    ys = down_w8a8(hq, hs, sorted_ids, block_expert, down, tokens, topk, cfg)
    y = torch.empty(tokens, H, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(H))
    moe_sum_kernel[(tokens, triton.cdiv(H, block))](ys, top_k_weights.float().contiguous(), y, H, topk, block,
                                                    interpreting())
    return y


# ----------------------------------------------------------------------------- the PyTorch emulation


def _codes_product(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """codes [R, K] x weight codes [N, K] -> float32 [R, N]: the sums taken exactly (float64: every product and
    partial sum of 8-bit codes is exact there at these widths) and rounded once, as the kernels' int32 sum converts
    to float32 (FP8: the kernels' float32 sums differ from this by their summation-order rounding)."""
    return (q.double() @ w.double().T).float()


def reference_gate_up(x: torch.Tensor, gate_up, top_k_index: torch.Tensor) -> torch.Tensor:
    """-> h float32 [T, K, I]: per token x quantized (w8a8.quantize_tokens), for each of its experts the exact code
    products scaled by the row's and the channel's scale in that order, gelu_tanh(gate) * up in float32 with the
    kernel's formula (common.gelu_tanh)."""
    from .. import w8a8

    kind = gate_up.format
    T, K = top_k_index.shape
    I = gate_up.shape[1] // 2
    xq, xs = w8a8.quantize_tokens(x, kind)  # [T, H], [T, 1]
    h = torch.empty(T, K, I)
    for t in range(T):
        for k in range(K):
            e = int(top_k_index[t, k])
            gu = _codes_product(xq[t:t + 1], gate_up.weight[e]) * xs[t] * gate_up.weight_scale[e].float().T
            gate, up = gu[0, :I], gu[0, I:]
            z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (1.0 + (1.0 - 2.0 / (torch.exp(2.0 * z) + 1.0)))
            h[t, k] = act * up
    return h


def reference_down(h: torch.Tensor, down, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """h float32 [T, K, I] -> (ys float32 [T, K, H], y [T, H] in dtype): each row of h quantized
    (w8a8.quantize_tokens), the exact code products scaled by the row's and the channel's scale, the float32
    weighted sum over the slots in slot order."""
    from .. import w8a8

    T, K = top_k_index.shape
    hq, hs = w8a8.quantize_tokens(h, down.format)  # [T, K, I], [T, K, 1]
    ys = torch.empty(T, K, down.shape[1])
    for t in range(T):
        for k in range(K):
            e = int(top_k_index[t, k])
            ys[t, k] = (_codes_product(hq[t, k][None], down.weight[e]) * hs[t, k] * down.weight_scale[e].float().T)[0]
    y = ys[:, 0] * top_k_weights[:, 0].float()[:, None]
    for k in range(1, K):
        y = y + ys[:, k] * top_k_weights[:, k].float()[:, None]
    return ys, y.to(dtype)
