"""RMSNorm with what surrounds it in a decoder layer, in one kernel: y = S * (R + N(A + A2)), RoPE optional.

The model's norms (dgemma_cli/model.py RMSNorm) cost nine torch ops each on a GPU (a float32 copy, square, mean,
add, power, two multiplies, the weight's float32 copy, the cast back), and the adds, RoPE and layer scale around
them more; a denoise step has 11 norms a layer. This kernel normalises rows of the last dimension, several a
program where they are short (a token's heads of 256: 8 rows, so the per-program work is not mostly overhead):

    a = A (+ A2, rounded to the output dtype: the torch path adds them first)
    n = a * (mean(a^2) + eps)^-1/2 [* weight], in float32, rounded to the output dtype
    n = rope(n) = n * cos + rotate_half(n) * sin       (optional; each product and the sum rounded as torch does)
    y = R + n (rounded), then y * S (rounded)          (optional residual R and 0-dim scale S)

and three fusions of a layer's neighbouring norms: A and A2 each normed by norms of their own before the add (the
post-feed-forward norms of the dense MLP's and the experts' outputs, then the layer's norm of their sum); a
second output, the same norm of A with another weight (the two pre-feed-forward norms of the residual); and the
result y normed again with two weights of its own (THEN_PAIR: the post-attention residual update followed by the
two pre-feed-forward norms of it, in one launch).

Every rounding the torch path makes to the output dtype is made here at the same place, so the results differ from
it only by float32 summation order in the mean (and 1/sqrt against pow(-0.5)): tests/test_norm_kernel.py compares
them under Triton's interpreter. x of any float dtype, rows contiguous in the last dimension (D <= 16384).

RoPE: x is [B, T, heads, D] (rows b, t, h in that order), cos and sin [B or 1, T, 1, D]; rotate_half(n) is
cat(-n[D/2:], n[:D/2]), made in registers from the row's two halves (D a power of two: the heads are 256 and 512).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import pair_order
from .nvfp4_act import e2m1_code, e4m3_bits, round_e4m3


@triton.jit
def _round(x, dt: tl.constexpr, EMULATE: tl.constexpr):
    """float32 x rounded to dt's precision (to nearest, ties to even), kept in float32: the GPU's conversions; under
    Triton's interpreter (EMULATE), which truncates bfloat16 conversions, bfloat16 is rounded by hand on the bits
    (the same results for finite values)."""
    if EMULATE and dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _normed(a, w_ptr, cols, D, eps):
    """a [R, BLOCK] float32 -> a * (mean(a^2) + eps)^-1/2 * weight, float32 (a norm of its own, before the add)."""
    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    return a * rstd[:, None] * w[None, :]


@triton.jit
def _quantize_rows(n, row, row_ok, cols, D, q_ptr, qs_ptr, qg_ptr, gs_ptr, QUANT: tl.constexpr,
                   STATIC: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    """The rows n [R, BLOCK] (float32 holding the output dtype's values; columns from D on zero) quantized for the
    linears that read them, as their own quantizers would (same expressions, same codes): QUANT 1 INT8 / 2 FP8 per
    token (moe_w8a8.quantize_rows_kernel: codes [ROWS, D], float32 scales [ROWS]); 3 NVFP4
    (nvfp4_act.quantize_act_kernel: codes [ROWS, D/2], e4m3 scale bits [ROWS, D/16], global scales [ROWS], the
    calibrated one at gs_ptr where STATIC)."""
    if QUANT == 3:
        if STATIC:
            g = tl.load(gs_ptr) + tl.zeros([R], dtype=tl.float32)
        else:
            g = tl.maximum(tl.max(tl.abs(n), axis=1) / 2688.0, 1.1754943508222875e-38)
        tl.store(qg_ptr + row, g, mask=row_ok)
        x = tl.reshape(n, [R, BLOCK // 16, 16])
        scale = round_e4m3(tl.max(tl.abs(x), axis=2) / 6.0 / g[:, None])  # [R, BLOCK/16]
        denom = scale * g[:, None]
        codes = e2m1_code(x / tl.where(denom > 0, denom, 1.0)[:, :, None])
        lo, hi = tl.split(tl.reshape(codes, [R, BLOCK // 2, 2]))
        byte = lo | (hi << 4)
        half = tl.arange(0, BLOCK // 2)
        tl.store(q_ptr + row[:, None] * (D // 2) + half[None, :], byte.to(tl.uint8),
                 mask=row_ok[:, None] & (half < D // 2)[None, :])
        blk = tl.arange(0, BLOCK // 16)
        tl.store(qs_ptr + row[:, None] * (D // 16) + blk[None, :], e4m3_bits(scale).to(tl.uint8),
                 mask=row_ok[:, None] & (blk < D // 16)[None, :])
    else:
        QMAX: tl.constexpr = 448.0 if QUANT == 2 else 127.0
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(n), axis=1), QMAX), 1.1754943508222875e-38)
        tl.store(qs_ptr + row, scale, mask=row_ok)
        v = tl.minimum(tl.maximum(tl.math.div_rn(n, scale[:, None]), -QMAX), QMAX)
        if QUANT == 2:  # e4m3 bits: magnitude rounded to nearest even, the sign bit of v
            sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
            code = (e4m3_bits(round_e4m3(tl.abs(v))) | sign).to(tl.uint8)
        else:  # |v| <= 127: adding and removing 1.5 * 2^23 rounds to the integer, half to even
            code = ((v + 12582912.0) - 12582912.0).to(tl.int8)
        tl.store(q_ptr + row[:, None] * D + cols[None, :], code, mask=row_ok[:, None] & (cols < D)[None, :])


@triton.jit
def rms_norm_kernel(a_ptr, a2_ptr, w_ptr, r_ptr, s_ptr, cos_ptr, sin_ptr, y_ptr, wa_ptr, wa2_ptr, w2_ptr, y2_ptr,
                    b_ptr, wb_ptr, yb_ptr, wp_ptr, wp2_ptr, yp_ptr, yp2_ptr, ROWS, D, eps, heads, T, cos_bstride,
                    ysb, yst, ysh, PA, ROWS_B, heads_b, ybsb, ybst, ybsh,
                    HAS_A2: tl.constexpr, HAS_W: tl.constexpr, HAS_R: tl.constexpr, HAS_S: tl.constexpr,
                    ROPE: tl.constexpr, NORM_A: tl.constexpr, NORM_A2: tl.constexpr, HAS_Y2: tl.constexpr,
                    STRIDED: tl.constexpr, TWO: tl.constexpr, PAIR_Y2: tl.constexpr, R: tl.constexpr,
                    BLOCK: tl.constexpr, EMULATE: tl.constexpr, THEN_PAIR: tl.constexpr = False,
                    c_ptr=None, yc_ptr=None, PB=0, ROWS_C=0, heads_c=1, ycsb=0, ycst=0, ycsh=0,
                    THREE: tl.constexpr = False, q_ptr=None, qs_ptr=None, qg_ptr=None, gs_ptr=None,
                    QUANT: tl.constexpr = 0, STATIC: tl.constexpr = False):
    pid = tl.program_id(0)
    third = pid < 0  # THREE: programs from PB on norm a third tensor (C: v), without weight or RoPE
    if THREE:
        third = pid >= PB
        pid = tl.where(third, pid - (PB - PA), pid)  # C's programs follow B's, which follow A's
        ROWS_B = tl.where(third, ROWS_C, ROWS_B)
        heads_b = tl.where(third, heads_c, heads_b)
        b_ptr = tl.where(third, c_ptr, b_ptr)
        yb_ptr = tl.where(third, yc_ptr, yb_ptr)
        ybsb = tl.where(third, ycsb, ybsb)
        ybst = tl.where(third, ycst, ybst)
        ybsh = tl.where(third, ycsh, ybsh)
    if TWO:  # programs from PA on norm a second tensor (B: k after q) with its own weight, rows and output
        second = pid >= PA
        pid = tl.where(second, pid - PA, pid)
        a_ptr = tl.where(second, b_ptr, a_ptr)
        w_ptr = tl.where(second, wb_ptr, w_ptr)
        y_ptr = tl.where(second, yb_ptr, y_ptr)
        ROWS = tl.where(second, ROWS_B, ROWS)
        heads = tl.where(second, heads_b, heads)
        ysb = tl.where(second, ybsb, ysb)
        yst = tl.where(second, ybst, yst)
        ysh = tl.where(second, ybsh, ysh)
    row = pid.to(tl.int64) * R + tl.arange(0, R)  # R rows a program (a token's heads, for RoPE)
    cols = tl.arange(0, BLOCK)
    mask = (row < ROWS)[:, None] & (cols < D)[None, :]
    at = row[:, None] * D + cols[None, :]
    t = (row // heads) % T  # rows are (b, t, head) in that order
    b = row // (heads * T)
    if STRIDED:  # y is a strided view (a KV cache's slots)
        y_at = (b * ysb + t * yst + (row % heads) * ysh)[:, None] + cols[None, :]
    else:
        y_at = at
    dt: tl.constexpr = y_ptr.dtype.element_ty
    a = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
    if NORM_A:  # a normed by a norm of its own first (rounded, as that norm's output is)
        a = _round(_normed(a, wa_ptr, cols, D, eps), dt, EMULATE)
    if HAS_A2:
        a2 = tl.load(a2_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if NORM_A2:
            a2 = _round(_normed(a2, wa2_ptr, cols, D, eps), dt, EMULATE)
        a = _round(a + a2, dt, EMULATE)
    rstd = 1.0 / tl.sqrt(tl.sum(a * a, axis=1) / D + eps)
    n0 = a * rstd[:, None]
    n = n0
    if HAS_W:
        w_mask = cols < D
        if THREE:  # the third tensor has no weight: it reads as ones (n0 * 1, exactly)
            w_mask = tl.where(third, cols < 0, w_mask)
        w = tl.load(w_ptr + cols, mask=w_mask, other=1.0).to(tl.float32)
        n = n0 * w[None, :]
    if HAS_Y2:  # a second norm of the same input, with its own weight (the same rstd, as torch computes it)
        w2 = tl.load(w2_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        if PAIR_Y2:  # columns in the NVFP4 decode's pair order (what the NVFP4 experts read)
            y2_at = row[:, None] * D + pair_order(cols)[None, :]
        else:
            y2_at = at
        tl.store(y2_ptr + y2_at, _round(n0 * w2[None, :], dt, EMULATE).to(dt), mask=mask)
    n = _round(n, dt, EMULATE)
    if ROPE:  # rotate_half(n) from the row's own halves in registers (D == BLOCK: a power of two)
        halves = tl.permute(tl.reshape(n, [R, 2, BLOCK // 2]), (0, 2, 1))
        lo, hi = tl.split(halves)
        rot = tl.reshape(tl.permute(tl.join(-hi, lo), (0, 2, 1)), [R, BLOCK])
        cat = (b * cos_bstride + t * D)[:, None] + cols[None, :]
        c = tl.load(cos_ptr + cat, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + cat, mask=mask, other=0.0).to(tl.float32)
        roped = _round(_round(n * c, dt, EMULATE) + _round(rot * s, dt, EMULATE), dt, EMULATE)
        if THREE:  # the third tensor (v) is not rotated
            n = tl.where(third, n, roped)
        else:
            n = roped
    if HAS_R:
        n = _round(tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32) + n, dt, EMULATE)
    if HAS_S:
        n = _round(n * tl.load(s_ptr).to(tl.float32), dt, EMULATE)
    tl.store(y_ptr + y_at, n.to(dt), mask=mask)
    if QUANT != 0 and not THEN_PAIR:  # y quantized for the linears that read it (q, k and v)
        _quantize_rows(n, row, row < ROWS, cols, D, q_ptr, qs_ptr, qg_ptr, gs_ptr, QUANT, STATIC, R, BLOCK)
    if THEN_PAIR:  # the next norms of y, as they read it (rounded): two weights, the second's columns in pair order
        n0 = n * (1.0 / tl.sqrt(tl.sum(n * n, axis=1) / D + eps))[:, None]
        wp = tl.load(wp_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        pre = _round(n0 * wp[None, :], dt, EMULATE)
        tl.store(yp_ptr + at, pre.to(dt), mask=mask)
        if QUANT != 0:  # the first of them quantized for the linears that read it (the dense MLP's gate and up)
            _quantize_rows(tl.where(mask, pre, 0.0), row, row < ROWS, cols, D, q_ptr, qs_ptr, qg_ptr, gs_ptr, QUANT,
                           STATIC, R, BLOCK)
        wp2 = tl.load(wp2_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        if PAIR_Y2:
            yp2_at = row[:, None] * D + pair_order(cols)[None, :]
        else:
            yp2_at = at
        tl.store(yp2_ptr + yp2_at, _round(n0 * wp2[None, :], dt, EMULATE).to(dt), mask=mask)


def rms_norm(a: torch.Tensor, weight: torch.Tensor | None, eps: float, a2: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, scale: torch.Tensor | None = None,
             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, a_weight: torch.Tensor | None = None,
             a2_weight: torch.Tensor | None = None, weight2: torch.Tensor | None = None,
             out: torch.Tensor | None = None, pair_order_y2: bool = False,
             then_pair: tuple[torch.Tensor, torch.Tensor] | None = None, quantize: str | None = None,
             input_scale: torch.Tensor | None = None):
    """S * (residual + rope(norm(a + a2) * weight)) in a's dtype and shape (see the module docstring).

    then_pair (weights w, w2; no RoPE, no weight2): the next two norms of the result y as well, norm(y) * w and
    norm(y) * w2 (a layer's pre-feed-forward norms after its post-attention residual update), the second in the
    NVFP4 decode's pair order with pair_order_y2: returns (y, norm(y) * w, norm(y) * w2).

    quantize ("int8", "fp8": per token, as moe_w8a8.quantize_rows; "nvfp4": as nvfp4_act.quantize_act, with the
    calibrated `input_scale` where given, per token otherwise; a plain norm of rows, or with then_pair): y, or with
    then_pair norm(y) * w, also quantized for the linears that read it, from the same launch; the quantization
    (those quantizers' outputs: codes and scales, and NVFP4's global scales) is returned last.

    a_weight / a2_weight: a and a2 are first normed each by a norm of their own with that weight (the same eps),
    rounded, then added. weight2: also the same norm of a with this other weight; returns (y, y2) then, y2's columns
    in the NVFP4 decode's pair order with pair_order_y2 (moe_gate_up.pair_ordered: what the NVFP4 experts read).
    out: where y goes, a's shape, any strides with the last dimension contiguous (a view of a KV cache's slots, for
    a [B, T, heads, D]); returned."""
    D = a.shape[-1]
    a = a.contiguous()
    y = _output(a, out)
    y2 = torch.empty_like(a) if weight2 is not None else None
    rows = a.numel() // D
    if rows == 0:
        return y if y2 is None else (y, y2)
    rope = cos is not None
    if weight2 is not None and (rope or residual is not None or scale is not None or a2 is not None):
        raise ValueError("a second output is the plain norm of a: no a2, residual, scale or RoPE with it")
    if a2_weight is not None and a2 is None:
        raise ValueError("a2_weight without a2")
    if then_pair is not None and (rope or weight2 is not None or out is not None or a.dim() > 3):
        raise ValueError("then_pair norms a plain residual update's result: no RoPE, weight2 or out with it")
    if pair_order_y2 and ((weight2 is None and then_pair is None) or D % 8):
        raise ValueError("the pair order is for a second output of a width divisible by 8")
    heads = T = 1
    cos_bstride = 0
    if a.dim() == 4:  # rows are (b, t, head)
        _, T, heads, _ = a.shape
    if rope:
        if a.dim() != 4 or D < 2 or D & (D - 1):
            raise ValueError(f"RoPE needs x [B, T, heads, D] with D a power of two (got {tuple(a.shape)})")
        cos, sin = cos.contiguous(), sin.contiguous()
        cos_bstride = 0 if cos.shape[0] == 1 else T * D
    g = a  # a stand-in pointer for the operands a launch does not have (never read)
    strided = not y.is_contiguous()
    block, per, warps = _launch_shape(D, strided)
    if (then_pair is not None or quantize is not None) and block * per >= 4096:
        warps = 16  # three outputs, or a quantizer's: with 8 warps 4 B spilled on sm_90 under Triton 3.6
    pair = (then_pair[0], then_pair[1], torch.empty_like(a), torch.empty_like(a)) if then_pair is not None \
        else (g, g, g, g)
    quant, quantized = _quantized_outputs(a, quantize, input_scale, rope or weight2 is not None or strided)
    rms_norm_kernel[(triton.cdiv(rows, per),)](
        a, a2.contiguous() if a2 is not None else g, weight if weight is not None else g,
        residual.contiguous() if residual is not None else g, scale if scale is not None else g,
        cos if rope else g, sin if rope else g, y, a_weight if a_weight is not None else g,
        a2_weight if a2_weight is not None else g, weight2 if weight2 is not None else g, y2 if y2 is not None else g,
        g, g, g, *pair, rows, D, float(eps), heads, T, cos_bstride, *_row_strides(y, T, heads, D), 0, 0, 1, 0, 0, 0,
        a2 is not None, weight is not None, residual is not None, scale is not None, rope, a_weight is not None,
        a2_weight is not None, weight2 is not None, strided, False, pair_order_y2, per, block, interpreting(),
        then_pair is not None, g, g, 0, 0, 1, 0, 0, 0, False, *quant, num_warps=warps)
    out = (y, pair[2], pair[3]) if then_pair is not None else (y,) if y2 is None else (y, y2)
    if quantized is not None:
        out += (quantized,)
    return out[0] if len(out) == 1 else out


QUANT = {"int8": 1, "fp8": 2, "nvfp4": 3}


def _quantized_outputs(a: torch.Tensor, quantize: str | None, input_scale: torch.Tensor | None, refused: bool):
    """The kernel's quantization arguments (q, scales, global scales, calibrated scale, QUANT, STATIC) and what the
    caller gets: (codes, scales) for 8 bits as quantize_rows leaves them ([M, 1] scales: w8a8.quantize_tokens'
    shape), (codes, scale bits, global scales) for NVFP4; stand-ins and None without `quantize`."""
    if quantize is None:
        return (a, a, a, a, 0, False), None
    D = a.shape[-1]
    M = a.numel() // D
    if quantize not in QUANT or refused or (quantize == "nvfp4" and D % 16):
        raise ValueError(f"cannot quantize this norm's output as {quantize!r}")
    if quantize == "nvfp4":
        q = torch.empty(M, D // 2, dtype=torch.uint8, device=a.device)
        s = torch.empty(M, D // 16, dtype=torch.uint8, device=a.device)
        g = torch.empty(M, dtype=torch.float32, device=a.device)
        static = input_scale is not None
        return (q, s, g, input_scale.float().reshape(1) if static else g, 3, static), (q, s, g)
    q = torch.empty(M, D, dtype=torch.uint8 if quantize == "fp8" else torch.int8, device=a.device)
    s = torch.empty(M, dtype=torch.float32, device=a.device)
    codes = q.view(torch.float8_e4m3fn) if quantize == "fp8" else q
    return (q, s, a, a, QUANT[quantize], False), (codes, s[:, None])


def rms_norm_rope_pair(a: torch.Tensor, weight: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, out_b: torch.Tensor | None = None,
                       c: torch.Tensor | None = None, out_c: torch.Tensor | None = None) -> tuple:
    """(rope(norm(a) * weight), rope(norm(b) * weight_b)) in one launch: a layer's q [B, T, Hq, D] and k [B, T, Hk,
    D] (the same positions, cos and sin, D a power of two); out_b: where b's result goes (a KV cache's slots, any
    strides), returned. c: a third tensor of b's shape normed without weight or RoPE in the same launch (v), into
    out_c where given: returns (a's, b's, c's) then."""
    D = a.shape[-1]
    if a.dim() != 4 or b.dim() != 4 or b.shape[:2] != a.shape[:2] or b.shape[-1] != D or D < 2 or D & (D - 1):
        raise ValueError(f"two [B, T, heads, D] tensors with the same B, T and D a power of two are needed (got "
                         f"{tuple(a.shape)} and {tuple(b.shape)})")
    if c is not None and c.shape != b.shape:
        raise ValueError(f"the third tensor takes b's shape {tuple(b.shape)} (got {tuple(c.shape)})")
    a, b = a.contiguous(), b.contiguous()
    y, yb = torch.empty_like(a), _output(b, out_b)
    yc = _output(c.contiguous(), out_c) if c is not None else None
    _, T, heads, _ = a.shape
    heads_b = b.shape[2]
    rows, rows_b = a.numel() // D, b.numel() // D
    if rows == 0:
        return (y, yb) if c is None else (y, yb, yc)
    cos, sin = cos.contiguous(), sin.contiguous()
    cos_bstride = 0 if cos.shape[0] == 1 else T * D
    strided = not yb.is_contiguous() or (yc is not None and not yc.is_contiguous())
    block, per, warps = _launch_shape(D, strided)
    pa = triton.cdiv(rows, per)
    pb = pa + triton.cdiv(rows_b, per)
    g = a
    third = (c.contiguous(), yc, pb, rows_b, heads_b, *_row_strides(yc, T, heads_b, D)) if c is not None \
        else (g, g, pb, 0, 1, 0, 0, 0)
    rms_norm_kernel[(pb + (triton.cdiv(rows_b, per) if c is not None else 0),)](
        a, g, weight, g, g, cos, sin, y, g, g, g, g, b, weight_b, yb, g, g, g, g, rows, D, float(eps), heads, T,
        cos_bstride,
        *_row_strides(y, T, heads, D), pa, rows_b, heads_b, *_row_strides(yb, T, heads_b, D),
        False, True, False, False, True, False, False, False, strided, True, False, per, block, interpreting(),
        False, *third, c is not None, num_warps=warps)
    return (y, yb) if c is None else (y, yb, yc)


def _output(a: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where a's norm goes: `out` (a's shape and dtype, any strides with the last dimension contiguous, at most 4-D:
    rows are (b, t, head)), else a new tensor like a."""
    if out is None:
        return torch.empty_like(a)
    if out.shape != a.shape or out.dtype != a.dtype or out.stride(-1) != 1 or a.dim() > 4:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} cannot take the norm of {tuple(a.shape)} {a.dtype}")
    return out


def _launch_shape(D: int, strided: bool) -> tuple[int, int, int]:
    """(BLOCK, rows a program, warps) for rows of D. Rows a program: 2,048 elements where rows are short (a token's
    heads of 256: 8 rows, 16 elements a thread on 4 warps; 8 warps issued a third more), one row of the hidden size
    (8 warps). A strided output takes 8 warps: two addresses an element (4 spilled on sm_120)."""
    block = triton.next_power_of_2(D)
    per = min(16, max(1, 2048 // block))
    return block, per, 8 if strided or block * per > 2048 else 4


def _row_strides(y: torch.Tensor, T: int, heads: int, D: int) -> tuple[int, int, int]:
    """(b, t, head) strides of y's rows, in elements: a contiguous y's, or a 4-D view's own."""
    if y.dim() == 4:
        return y.stride(0), y.stride(1), y.stride(2)
    return T * heads * D, heads * D, D
