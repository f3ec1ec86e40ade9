"""Activations to NVFP4 on the fly, for W4A4 (FP4 x FP4 tensor cores on sm_100 and sm_120): x [M, K] ->
codes uint8 [M, K/2] (ModelOpt's packing, element 2i in the low nibble), block scales as e4m3 bits uint8 [M, K/16],
and one float32 global scale per row [M].

The global scale of a row is the checkpoint's calibrated one where it has one (ModelOpt's `input_scale`: amax / (6 *
448) of the inputs calibration saw, a static scale, the same for every row), otherwise amax|x_row| / (6 * 448) (a
per-token scale). Each row is quantized exactly as quant/nvfp4.quantize quantizes a matrix with that global scale:
block scale = amax(block) / 6 / g rounded to e4m3 (to nearest, ties to even, at most 448), element = x / (scale *
g) rounded to the nearest E2M1 value (ties to the even code, at most 6). So the PyTorch emulation is
nvfp4.quantize row by row, and the two agree code for code (tests/test_kernels.py). With a static scale a block
whose amax / 6 / g passes 448 saturates (scale 448, codes at most 6), as the calibrated scale's users accept. One
program per row: a sweep for the row's amax (per-token scales only), then one that quantizes BLOCK_K inputs at a
time.
"""

import torch
import triton
import triton.language as tl

from .common import row_absmax


@triton.jit
def round_e4m3(s):
    """Positive float32 [.., B] -> the nearest e4m3 value (ties to even), saturating at 448, still float32.
    Normals keep 3 mantissa bits (round the float32 bit pattern at bit 20); below 2^-6 e4m3 is subnormal with a
    fixed step of 2^-9 (round by adding and removing 2^14, whose float32 step is exactly that)."""
    s = tl.minimum(s, 448.0)
    bits = s.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (s + 16384.0) - 16384.0
    return tl.where(s < 0.015625, sub, tl.minimum(normal, 448.0))


@triton.jit
def e4m3_bits(v):
    """An exact, non-negative e4m3 value in float32 -> its 8-bit pattern (int32)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 120  # e4m3 exponent field (bias 7) of a normal value
    normal = (exp << 3) | ((bits >> 20) & 7)
    sub = (v * 512.0).to(tl.int32)  # subnormal: mantissa = v / 2^-9
    return tl.where(v < 0.015625, sub, normal)


@triton.jit
def e2m1_code(v):
    """float32 (already divided by its scales) -> E2M1 code 0..15: nearest magnitude, ties to the even code,
    saturating at 6; bit 3 the sign (none for zero)."""
    a = tl.abs(v)
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return idx | tl.where((v < 0) & (idx > 0), 8, 0)


@triton.jit
def quantize_act_kernel(x_ptr, q_ptr, s_ptr, g_ptr, ids_ptr, gs_ptr, K, BLOCK_K: tl.constexpr, SKIP: tl.constexpr,
                        STATIC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if SKIP:  # rows whose id is negative (the MoE block plan's padding) are left unwritten: no one reads them
        if tl.load(ids_ptr + row) < 0:
            return
    base = x_ptr + row * K
    if STATIC:  # the checkpoint's calibrated scale
        g = tl.load(gs_ptr)
    else:
        g = tl.maximum(row_absmax(base, K, BLOCK_K) / 2688.0, 1.1754943508222875e-38)  # amax / (6 * 448), >= tiny
    tl.store(g_ptr + row, g)
    for k0 in range(0, K, BLOCK_K):
        blk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(base + cols, mask=cols < K, other=0.0).to(tl.float32).reshape(BLOCK_K // 16, 16)
        scale = round_e4m3(tl.max(tl.abs(x), axis=1) / 6.0 / g)  # [BLOCK_K/16]
        denom = scale * g
        codes = e2m1_code(x / tl.where(denom > 0, denom, 1.0)[:, None])  # [BLOCK_K/16, 16]; a zero block: x = 0
        lo, hi = tl.split(codes.reshape(BLOCK_K // 16, 8, 2))
        byte = (lo | (hi << 4)).reshape(BLOCK_K // 2)
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        tl.store(q_ptr + row * (K // 2) + half, byte.to(tl.uint8), mask=half < K // 2)
        tl.store(s_ptr + row * (K // 16) + blk, e4m3_bits(scale).to(tl.uint8), mask=blk < K // 16)


def quantize_act(x: torch.Tensor, ids: torch.Tensor | None = None, global_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 16) -> (codes uint8 [M, K/2], scale bits uint8 [M, K/16], global float32 [M]).
    With `ids` [M] int32, rows whose id is negative are skipped (their outputs left uninitialised). global_scale: a
    calibrated static scale (float32, one element, on x's device) for every row; None: per-row scales."""
    M, K = x.shape
    q = torch.empty(M, K // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, K // 16, dtype=torch.uint8, device=x.device)
    g = torch.empty(M, dtype=torch.float32, device=x.device)
    block = 256 if K >= 256 else triton.next_power_of_2(max(16, K))
    static = global_scale is not None
    quantize_act_kernel[(M,)](x.contiguous(), q, s, g, ids if ids is not None else g,
                              global_scale.float().reshape(1) if static else g, K, block, ids is not None, static)
    return q, s, g


def quantize_act_reference(x: torch.Tensor, global_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch emulation: quant/nvfp4.quantize row by row with the row's own global scale, or `global_scale`."""
    from .. import nvfp4

    rows = [nvfp4.quantize(r[None].float(), scale_2=global_scale) for r in x]
    return (torch.cat([q.weight for q in rows]), torch.cat([q.weight_scale.view(torch.uint8) for q in rows]),
            torch.stack([q.weight_scale_2 for q in rows]))

