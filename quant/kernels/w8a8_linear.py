"""y = x @ W^T with 8-bit activations and weights (W8A8, compressed-tensors' FP8 / INT8 with per-token activations)
for the dense linears, where torch's `_scaled_mm` / `_int_mm` would run one matmul a linear.

Operands: x's codes [M, K] (int8, or e4m3 bits as uint8) and per-row scales float32 [M], as
moe_w8a8.quantize_rows leaves them (the same codes as quant/w8a8.quantize_tokens); the weight's codes [N, K] and
per-output-channel scales float32 [N] (compressed-tensors' channel layout); y [M, N] in the compute dtype. A
program computes BLOCK_M x BLOCK_N, walking K in BLOCK_K steps (moe_w8a8.dot8: FP8 products summed in float32,
INT8 in int32, exactly); the epilogue multiplies by the row's and the column's scales, in that order, and rounds
once, as the torch path does (w8a8.matmul_hw) up to the order of the float32 sum.

What a kernel of our own gives that torch's matmul cannot: the linears of one input in one launch (SEGMENTS: q, k
and v, their column tiles one after another) and the dense MLP's gate and up with gelu_tanh(gate) * up in the
epilogue (GATED: two accumulators, each product and the activation rounded as the torch ops round them). Under
Triton's interpreter tl.dot multiplies e4m3 by widening to float16 (exact) and int8 in int32, so the same code runs
there (tests/test_shared_quantization.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import arch, interpreting, m_bucket, shared_b_operand, tuning
from .common import gelu_tanh, segment_of, store_rounded, to_compute
from .moe_w8a8 import codes_tile, dot8


@triton.jit
def w8a8_linear_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, wu_ptr, wsu_ptr, M, N, K, FP8: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                       GATED: tl.constexpr, EMULATE: tl.constexpr,
                       w1_ptr, s1_ptr, y1_ptr, N1, w2_ptr, s2b_ptr, y2_ptr, N2, SEGMENTS: tl.constexpr):
    pid_n = tl.program_id(0)  # fastest: consecutive programs share the x rows
    pid_m = tl.program_id(1)
    if SEGMENTS > 1:  # the column tiles of 2 or 3 linears of the same x, one after another: this tile's linear
        w_ptr, ws_ptr, _, y_ptr, N, pid_n = segment_of(pid_n, BLOCK_N, w_ptr, ws_ptr, ws_ptr, y_ptr, N,
                                                       w1_ptr, s1_ptr, s1_ptr, y1_ptr, N1,
                                                       w2_ptr, s2b_ptr, s2b_ptr, y2_ptr, N2, SEGMENTS)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok, col_ok = rm < M, rn < N
    acc_type = tl.float32 if FP8 else tl.int32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)  # GATED: the up projection's (unused otherwise)
    for k0 in range(0, K, BLOCK_K):
        x = codes_tile(xq_ptr, rm, row_ok, k0, K, BLOCK_K, EVEN, FP8)
        acc = dot8(acc, x, codes_tile(w_ptr, rn, col_ok, k0, K, BLOCK_K, EVEN, FP8), BLOCK_K, FP8)
        if GATED:
            acc_u = dot8(acc_u, x, codes_tile(wu_ptr, rn, col_ok, k0, K, BLOCK_K, EVEN, FP8), BLOCK_K, FP8)
    xs = tl.load(xs_ptr + rm, mask=row_ok, other=0.0)[:, None]
    y = acc.to(tl.float32) * xs * tl.load(ws_ptr + rn, mask=col_ok, other=0.0)[None, :]
    if GATED:  # gelu_tanh(gate) * up, each product and the activation rounded as the torch ops round them
        dtype = y_ptr.dtype.element_ty
        up = acc_u.to(tl.float32) * xs * tl.load(wsu_ptr + rn, mask=col_ok, other=0.0)[None, :]
        gate = to_compute(y, dtype, EMULATE).to(tl.float32)
        y = to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32) * to_compute(up, dtype, EMULATE).to(tl.float32)
    store_rounded(y_ptr + rm[:, None] * N + rn[None, :], y, row_ok[:, None] & col_ok[None, :], EMULATE)


def candidates(M: int, device: torch.device, gated: bool = False) -> list[dict]:
    """Launch settings, best first: 128 x 128 tiles 128 deep with 8 warps where the tensor cores read shared
    memory (sm_90, sm_100); 64-row tiles with 4 warps on mma.sync GPUs; 16 rows for a handful. Gated: two
    accumulators, half the columns."""
    if M <= 16:
        out = [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4)]
    elif shared_b_operand(arch(device)):
        out = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8),
               dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4)]
        if M <= 512:  # a canvas or two: 64-row tiles, so that a 2,816-wide output still fills the GPU's SMs
            out.reverse()
    else:
        out = [dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4),
               dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8)]
        if M <= 512:  # a canvas or two: 64 columns too, so that a 2,816-wide output fills the GPU's SMs
            out.insert(0, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4))
    return [dict(c, BLOCK_N=c["BLOCK_N"] // 2) for c in out] if gated else out


def w8a8_linear(x: torch.Tensor, quantized: tuple[torch.Tensor, torch.Tensor], weight: torch.Tensor,
                weight_scale: torch.Tensor, up: tuple[torch.Tensor, torch.Tensor] | None = None,
                more: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor | list:
    """x [..., K] (its dtype is the output's) quantized as `quantized` = (codes [M, K] int8 or float8_e4m3fn,
    scales float32 [M] or [M, 1]); weight [N, K] int8 or float8_e4m3fn, weight_scale float32 [N] or [N, 1] ->
    [..., N]. up: a second linear's (weight, weight_scale) of the same shape: gelu_tanh(gate) * up, one launch.
    more: one or two further linears of x in the same launch: the list of the outputs."""
    N, K = weight.shape
    lead = x.shape[:-1]
    xq, xs = quantized
    M = xq.shape[0]
    fp8 = weight.dtype == torch.float8_e4m3fn
    if len(more) > 2 or more and up is not None or any(m[0].shape[1] != K for m in more) or (
            up is not None and up[0].shape != weight.shape):
        raise ValueError("w8a8_linear: up to two more linears of the same input width, or one up of the gate's shape")

    def codes(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8) if fp8 else t.contiguous()

    def scales(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).float().contiguous()

    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    wq, ws = codes(weight), scales(weight_scale)
    wu, wsu = (codes(up[0]), scales(up[1])) if up is not None else (wq, ws)  # stand-ins, never read
    segs = [(codes(w), scales(s), torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device), w.shape[0])
            for w, s in more]
    seg_args = [a for seg in (segs + [(wq, ws, y, 0)] * 2)[:2] for a in seg]  # stand-ins: never read
    widths = [N] + [seg[3] for seg in segs]
    xq, xs = codes(xq), scales(xs)

    def launch(cfg: dict) -> None:
        bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
        grid = (sum(triton.cdiv(n, bn) for n in widths), triton.cdiv(M, cfg["BLOCK_M"]))
        w8a8_linear_kernel[grid](xq, xs, wq, ws, y, wu, wsu, M, N, K, fp8, cfg["BLOCK_M"], bn, bk,
                                 K % bk == 0, up is not None, interpreting(), *seg_args, len(widths),
                                 num_warps=cfg["num_warps"])

    key = (m_bucket(M), sum(widths), K, str(x.dtype), "fp8" if fp8 else "int8") + (("gated",) if up else ())
    cfg = tuning.choose("w8a8_linear", key, candidates(M, x.device, up is not None), launch, x.device)
    launch(cfg)
    if more:
        return [out.reshape(*lead, out.shape[-1]) for out in [y] + [seg[2] for seg in segs]]
    return y.reshape(*lead, N)
