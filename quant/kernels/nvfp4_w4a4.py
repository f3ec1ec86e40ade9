"""y = x @ W^T with both operands in NVFP4 (W4A4): FP4 x FP4 on the block-scaled tensor cores of sm_100 and sm_120.

Operands: the activation as nvfp4_act.quantize_act leaves it (codes uint8 [M, K/2], e4m3 scale bits [M, K/16], a
float32 global scale per row [M]); the weight in ModelOpt's layout (uint8 [N, K/2], e4m3 scale bits [N, K/16], row
global scales float32 [N]); y [M, N] in the compute dtype. A program computes BLOCK_M x BLOCK_N and walks K in
BLOCK_K steps with `tl.dot_scaled` (e2m1 x e2m1, one e4m3 scale per 16 inputs on each side): products of exact
a_x s_x and a_w s_w, float32 accumulation; the epilogue multiplies by g_x[row] * g_w[col] and rounds once. So the
reference is plain float arithmetic on the two dequantized operands without their global scales (the emulation in
`reference`), up to the order of the float32 sum.

GATED (the dense MLP's first half): a second weight (up) of the same shape multiplied by the same activation codes,
its tile stacked under the gate's into one operand twice as wide (one product a step, one accumulator split in the
epilogue, as the MoE gate-up kernels do); the epilogue rounds gate and up to the compute dtype, then
gelu_tanh(gate) (rounded) * up, rounded once more: the three ops' values (gate(x), gelu, up(x), their product) in
one launch. Linears that read the same input (q, k and v; gate and up) take one quantization of it (`quantized`:
quant.modules.project), or the norm's that made it (quant/kernels/rmsnorm.py `quantize`).

EMULATE (Triton's interpreter): `dot_scaled` there reads e4m3 scales as e8m0, so both tiles are decoded to float32
a * s (common.nvfp4_tile, exact) and multiplied with an IEEE float32 dot: the same products, the same sum order
as the emulation's float32 matmul up to blocking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import (UNSHIFT, gelu_tanh, load_nvfp4_tile, lora_expand, segment_of, split_gate_up, store_rounded,
                     to_compute)
from .lora import LinearAdapters, lora_shrink


@triton.jit
def _w4a4_step(acc, xq_ptr, xs_ptr, w_ptr, ws_ptr, rm, rn, k0, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """acc + the [BLOCK_M, BLOCK_K] activation tile times the [BLOCK_N, BLOCK_K] weight tile at k0, both e2m1 with
    e4m3 block scales."""
    if EMULATE:
        # a * s * 2^-62 exactly in bfloat16, times 2^62 exactly in float32: a * s
        xt = load_nvfp4_tile(xq_ptr.to(tl.pointer_type(tl.int32)), xs_ptr, rm, k0, K, M, BLOCK_M, BLOCK_K,
                             True, True, True).to(tl.float32) * UNSHIFT
        wt = load_nvfp4_tile(w_ptr.to(tl.pointer_type(tl.int32)), ws_ptr, rn, k0, K, N, BLOCK_N, BLOCK_K,
                             True, True, True).to(tl.float32) * UNSHIFT
        return tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    xq = tl.load(xq_ptr + rm[:, None] * (K // 2) + kb[None, :], mask=rm[:, None] < M, other=0)
    xs = tl.load(xs_ptr + rm[:, None] * (K // 16) + ks[None, :], mask=rm[:, None] < M, other=0)
    wq = tl.load(w_ptr + rn[None, :] * (K // 2) + kb[:, None], mask=rn[None, :] < N, other=0)  # [BK/2, BN]
    ws = tl.load(ws_ptr + rn[:, None] * (K // 16) + ks[None, :], mask=rn[:, None] < N, other=0)
    return tl.dot_scaled(xq, xs.to(tl.float8e4nv, bitcast=True), "e2m1",
                         wq, ws.to(tl.float8e4nv, bitcast=True), "e2m1", acc)


@triton.jit
def _w4a4_pair_step(acc, xq_ptr, xs_ptr, w_ptr, ws_ptr, wu_ptr, wsu_ptr, rm, rn, col, k0, M, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """acc [BLOCK_M, 2 * BLOCK_N] + the activation tile times the gate's tile and the up projection's as one
    operand of 2 * BLOCK_N rows (the gate's, then the up projection's, as the MoE gate-up kernels hold them): one
    block-scaled product a step for both; col [2 * BLOCK_N]: the tile's columns rn, twice. EMULATE: the two decoded
    tiles stacked the same way, one float32 product."""
    if EMULATE:
        xt = load_nvfp4_tile(xq_ptr.to(tl.pointer_type(tl.int32)), xs_ptr, rm, k0, K, M, BLOCK_M, BLOCK_K,
                             True, True, True).to(tl.float32) * UNSHIFT
        wt = tl.join(load_nvfp4_tile(w_ptr.to(tl.pointer_type(tl.int32)), ws_ptr, rn, k0, K, N, BLOCK_N, BLOCK_K,
                                     True, True, True).to(tl.float32),
                     load_nvfp4_tile(wu_ptr.to(tl.pointer_type(tl.int32)), wsu_ptr, rn, k0, K, N, BLOCK_N, BLOCK_K,
                                     True, True, True).to(tl.float32))  # [BN, BK, 2]
        wt = tl.reshape(tl.permute(wt, (2, 0, 1)), [2 * BLOCK_N, BLOCK_K]) * UNSHIFT
        return tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    xq = tl.load(xq_ptr + rm[:, None] * (K // 2) + kb[None, :], mask=rm[:, None] < M, other=0)
    xs = tl.load(xs_ptr + rm[:, None] * (K // 16) + ks[None, :], mask=rm[:, None] < M, other=0)
    up = tl.arange(0, 2 * BLOCK_N) >= BLOCK_N
    w_rows = tl.where(up, wu_ptr, w_ptr) + col * (K // 2)  # [2BN] row starts, gate rows then up rows
    s_rows = tl.where(up, wsu_ptr, ws_ptr) + col * (K // 16)
    wq = tl.load(w_rows[None, :] + kb[:, None], mask=col[None, :] < N, other=0)  # [BK/2, 2BN]
    ws = tl.load(s_rows[:, None] + ks[None, :], mask=col[:, None] < N, other=0)  # [2BN, BK/16]
    return tl.dot_scaled(xq, xs.to(tl.float8e4nv, bitcast=True), "e2m1",
                         wq, ws.to(tl.float8e4nv, bitcast=True), "e2m1", acc)


@triton.jit
def nvfp4_w4a4_kernel(xq_ptr, xs_ptr, xg_ptr, w_ptr, ws_ptr, wg_ptr, y_ptr, t_ptr, lb_ptr, wu_ptr, wsu_ptr, wgu_ptr,
                      M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EMULATE: tl.constexpr, LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
                      IEEE: tl.constexpr = False, GATED: tl.constexpr = False,
                      w1_ptr=None, s1_ptr=None, s21_ptr=None, y1_ptr=None, N1=0,
                      w2_ptr=None, s2b_ptr=None, s22_ptr=None, y2_ptr=None, N2=0, SEGMENTS: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if SEGMENTS > 1:  # the column tiles of 2 or 3 linears of the same x, one after another: this tile's linear
        w_ptr, ws_ptr, wg_ptr, y_ptr, N, pid_n = segment_of(
            pid_n, BLOCK_N, w_ptr, ws_ptr, wg_ptr, y_ptr, N, w1_ptr, s1_ptr, s21_ptr, y1_ptr, N1,
            w2_ptr, s2b_ptr, s22_ptr, y2_ptr, N2, SEGMENTS)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    if GATED:  # gate and up as one product a step (Triton 3.6 cannot build two in one loop for sm_100)
        both = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        col = (pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N) % BLOCK_N).to(tl.int64)
        for k0 in range(0, K, BLOCK_K):
            both = _w4a4_pair_step(both, xq_ptr, xs_ptr, w_ptr, ws_ptr, wu_ptr, wsu_ptr, rm, rn, col, k0, M, N, K,
                                   BLOCK_M, BLOCK_N, BLOCK_K, EMULATE)
        acc, acc_u = split_gate_up(both, BLOCK_M, BLOCK_N)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = acc  # unused
        for k0 in range(0, K, BLOCK_K):
            acc = _w4a4_step(acc, xq_ptr, xs_ptr, w_ptr, ws_ptr, rm, rn, k0, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                             EMULATE)
    xg = tl.load(xg_ptr + rm, mask=rm < M, other=0.0)
    wg = tl.load(wg_ptr + rn, mask=rn < N, other=0.0)
    out = acc * xg[:, None] * wg[None, :]
    if LORA:  # adapters: their rank product of the 16-bit activations (lora.lora_shrink's) times B's rows
        out = lora_expand(out, t_ptr, lb_ptr, rm, rm < M, rn, rn < N, BLOCK_R, IEEE, EMULATE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if GATED:  # gelu_tanh(gate) * up, each product and the activation rounded as the three torch ops round them
        dtype = y_ptr.dtype.element_ty
        wgu = tl.load(wgu_ptr + rn, mask=rn < N, other=0.0)
        up = to_compute(acc_u * xg[:, None] * wgu[None, :], dtype, EMULATE).to(tl.float32)
        gate = to_compute(out, dtype, EMULATE).to(tl.float32)
        out = to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32) * up
        store_rounded(y_ptr + rm[:, None] * N + rn[None, :], out, mask, EMULATE)
    else:
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def supported(device: torch.device) -> bool:
    """Where W4A4 runs: the FP4 tensor cores of sm_100 (B200) and sm_120 (RTX 50). Elsewhere, and under the
    interpreter (whose tests call nvfp4_w4a4 directly), NVFP4 weights meet 16-bit activations (nvfp4_linear)."""
    from . import arch

    return arch(device) in (100, 103, 120, 121)


def nvfp4_w4a4(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, row_scale_2: torch.Tensor,
               input_scale: torch.Tensor | None = None, lora: LinearAdapters | None = None,
               quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               up: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               more: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor | list:
    """x [..., K] -> [..., N]: x quantized to NVFP4 (nvfp4_act: with the checkpoint's static `input_scale`, or per
    token without one), then the FP4 x FP4 product. lora: adapters' terms, their rank products taken from the 16-bit
    x (lora.lora_shrink) and their expansions added in the epilogue. quantized: x's quantization already made
    (quantize_act's codes, scales and row scales for x's rows; input_scale is then not used). up: (weight,
    weight_scale, row_scale_2) of a second NVFP4 matrix of the same shape: gelu_tanh(x W^T) * (x W_up^T), the gated
    MLP's first half, in one launch (no adapters). more: one or two further linears of x (q, k and v) in the same
    launch, their column tiles after this one's: the list of the outputs (no up or adapters with them)."""
    from .nvfp4_act import quantize_act

    N, half = weight.shape
    K = 2 * half
    if K % 32:
        raise ValueError(f"W4A4 needs the input dim to be a multiple of 32 (got {K})")
    if up is not None and (up[0].shape != weight.shape or lora is not None):
        raise ValueError("nvfp4_w4a4: the gated product takes an up weight of the gate's shape and no adapters")
    if len(more) > 2 or more and (up is not None or lora is not None or any(m[0].shape[1] != half for m in more)):
        raise ValueError("nvfp4_w4a4: up to two more linears of the same input width, without up or adapters")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    xq, xs, xg = quantized if quantized is not None else quantize_act(x2, global_scale=input_scale)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # 128 x 128 tiles, 8 warps: the block-scaled FP4 MMA on both targets without spills (make kernel-report); 64
    # rows would fall back to 16-bit MMAs on sm_100. Gated: gate and up in one product, so half the columns each;
    # a canvas or two (M <= 512): 64 columns, so that a 2,816-wide output fills more of the GPU's SMs
    block_k = 128 if K % 128 == 0 else 64 if K % 64 == 0 else 32
    block_n = 64 if up is not None or M <= 512 else 128
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, 128))
    t, lb, rank = (lora_shrink(x2.contiguous(), lora), lora.factors.B.contiguous(), lora.factors.A.shape[0]) \
        if lora is not None else (y, y, 16)  # stand-ins, never read
    w_scale, w_row = weight_scale.view(torch.uint8), row_scale_2.float().contiguous()
    wu, wsu, wgu = (up[0].contiguous(), up[1].view(torch.uint8), up[2].float().contiguous()) if up is not None \
        else (weight, w_scale, w_row)  # stand-ins, never read
    segs = [(m[0].contiguous(), m[1].view(torch.uint8), m[2].float().contiguous(),
             torch.empty(M, m[0].shape[0], dtype=x.dtype, device=x.device), m[0].shape[0]) for m in more]
    seg_args = [a for seg in (segs + [(weight, w_scale, w_row, y, 0)] * 2)[:2] for a in seg]  # stand-ins: unread
    grid = (sum(triton.cdiv(n, block_n) for n in [N] + [seg[4] for seg in segs]), grid[1])
    nvfp4_w4a4_kernel[grid](xq, xs, xg, weight.contiguous(), w_scale, w_row, y, t, lb, wu, wsu, wgu, M, N, K, 128,
                            block_n, block_k, interpreting(), lora is not None, rank, x.dtype == torch.float32,
                            up is not None, *seg_args, SEGMENTS=1 + len(segs), num_warps=8)
    if more:
        return [out.reshape(*lead, out.shape[-1]) for out in [y] + [seg[3] for seg in segs]]
    return y.reshape(*lead, N)


def reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, row_scale_2: torch.Tensor,
              input_scale: torch.Tensor | None = None, lora: LinearAdapters | None = None) -> torch.Tensor:
    """The PyTorch emulation: x quantized as nvfp4_act's reference does (input_scale or per token), both operands
    dequantized without their global scales (a * s, exact in float32), a float32 matmul, then g_x[row] * g_w[col]
    (plus the adapters' term: the 16-bit x's rank product, masked per batch row and rounded, times B), rounded
    once."""
    from .. import nvfp4
    from .nvfp4_act import quantize_act_reference

    N, half = weight.shape
    x2 = x.reshape(-1, 2 * half)
    xq, xs, xg = quantize_act_reference(x2, input_scale)
    xa = nvfp4.dequantize_packed(xq, xs.view(torch.float8_e4m3fn), torch.ones(x2.shape[0]), torch.float32)
    wa = nvfp4.dequantize_packed(weight, weight_scale, torch.ones(N), torch.float32)
    y = (xa @ wa.T) * xg[:, None] * row_scale_2.float()[None, :]
    if lora is not None:
        f = lora.factors
        t = x2.float() @ f.A.float().T  # [M, R]
        if lora.row_slots is not None:
            rows = lora.row_slots.repeat_interleave(x2.shape[0] // lora.row_slots.numel())
            t = t * (rows[:, None] == f.slot[None, :]).float()
        y = y + t.to(x.dtype).float() @ f.B.float().T
    return y.to(x.dtype).reshape(*x.shape[:-1], N)
