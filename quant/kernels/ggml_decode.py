"""GGUF blocks (llama.cpp's ggml quantizations, quant/ggml.py) to weights in one pass: a [R, K] matrix of ggml blocks
(uint8 [R, K / elements * bytes], rows of blocks as a GGUF file lays them out) to [R, K] in the compute dtype.

Each program decodes a [BLOCK_R, BLOCK_K] tile element by element: an element's block, its offset in the block, and
the few bytes that make it (the block's f16 scales, its sub-block's packed scale, its quantized bits), read where the
blocks lie; the arithmetic is quant/ggml.py's in the same float32 order, so in the interpreter the result equals the
torch decode bit for bit (on a GPU a fused multiply-add may round the last bit of Q5_1's d q + m and the K types'
d sc q - dmin m differently: the probe's tolerance). One kernel for every type: KIND (constexpr) is its index in
KINDS. It replaces the torch decode's dozen passes over a matrix (the packed GGUF linears, quant/ggml_modules.py);
`decode_tile` is also what the routed experts' kernels call to read GGUF blocks in their own tiles
(moe_gate_up.weight_tile, FORMAT 2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ggml
from . import interpreting
from .common import store_rounded

KINDS = ggml.BLOCK_KINDS  # KIND (constexpr) is the index here: Q8_0, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, Q3_K, IQ4_XS


@triton.jit
def _u8(p):
    return tl.load(p).to(tl.int32)


@triton.jit
def _f16(p):
    """The little-endian half at p (two bytes) as float32."""
    bits = (tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 8)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _i8(p):
    return tl.load(p).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _iq4(q):
    """IQ4_NL's and IQ4_XS's grid: the 16 values of ggml.IQ4_VALUES, by 4-bit code."""
    v = tl.where(q == 0, -127, tl.where(q == 1, -104, tl.where(q == 2, -83, tl.where(q == 3, -65, -49))))
    v = tl.where(q == 5, -35, tl.where(q == 6, -22, tl.where(q == 7, -10, tl.where(q == 8, 1, v))))
    v = tl.where(q == 9, 13, tl.where(q == 10, 25, tl.where(q == 11, 38, tl.where(q == 12, 53, v))))
    v = tl.where(q == 13, 69, tl.where(q == 14, 89, tl.where(q == 15, 113, v)))
    return v.to(tl.float32)


@triton.jit
def _k_scale(s, sb, MIN: tl.constexpr):
    """Q4_K / Q5_K: sub-block sb's six-bit scale (MIN False) or min from the 12 scale bytes at s (ggml._k_scales)."""
    lo = sb < 4
    j = tl.where(lo, sb, sb - 4)
    first = _u8(s + (4 if MIN else 0) + j)
    packed = _u8(s + 8 + j)
    high = (packed >> 4) if MIN else (packed & 15)
    return tl.where(lo, first & 63, high | ((first >> 2) & 48)).to(tl.float32)


@triton.jit
def decode_tile(w_ptr, rows, ks, row_bytes, KIND: tl.constexpr):
    """Weights [len(rows), len(ks)] float32 of a ggml matrix at w_ptr (uint8, `row_bytes` a row): rows `rows` (int64),
    columns `ks`. The caller masks what lies past the matrix (those elements read row 0, column 0's bytes)."""
    row = w_ptr + rows[:, None] * row_bytes
    if KIND == 0:  # Q8_0: f16 d, int8 q[32]
        b = row + (ks[None, :] // 32) * 34
        w = _f16(b) * _i8(b + 2 + ks[None, :] % 32)
    elif KIND <= 3:  # Q5_0, Q5_1, IQ4_NL: 32 weights; qs[16] (j low nibble, j + 16 high)
        i = ks[None, :] % 32
        nb = 22 if KIND == 1 else (24 if KIND == 2 else 18)
        b = row + (ks[None, :] // 32) * nb
        qs = 6 if KIND == 1 else (8 if KIND == 2 else 2)
        nib = (_u8(b + qs + i % 16) >> (4 * (i // 16))) & 15
        if KIND == 3:
            w = _f16(b) * _iq4(nib)
        else:
            qh = (_u8(b + qs - 4 + i // 8) >> (i % 8)) & 1
            q = (nib | (qh << 4)).to(tl.float32)
            if KIND == 1:
                w = _f16(b) * (q - 16.0)
            else:
                w = _f16(b) * q + _f16(b + 2)
    elif KIND <= 5:  # Q4_K, Q5_K: 256 weights, eight sub-blocks of 32
        i = ks[None, :] % 256
        sb, pos = i // 32, i % 32
        b = row + (ks[None, :] // 256) * (144 if KIND == 4 else 176)
        qs = 16 if KIND == 4 else 48
        q = (_u8(b + qs + (sb // 2) * 32 + pos) >> (4 * (sb % 2))) & 15
        if KIND == 5:
            q = q | (((_u8(b + 16 + pos) >> sb) & 1) << 4)
        sc = _k_scale(b + 4, sb, False)
        mn = _k_scale(b + 4, sb, True)
        w = (_f16(b) * sc) * q.to(tl.float32) - _f16(b + 2) * mn
    elif KIND == 6:  # Q6_K: ql[128], qh[64], int8 scales[16], f16 d; 16 sub-blocks of 16
        i = ks[None, :] % 256
        b = row + (ks[None, :] // 256) * 210
        h, r = i // 128, i % 128
        low = (_u8(b + h * 64 + r % 64) >> (4 * (r // 64))) & 15
        high = (_u8(b + 128 + h * 32 + r % 32) >> (2 * (r // 32))) & 3
        q = ((low | (high << 4)) - 32).to(tl.float32)
        w = (_f16(b + 208) * _i8(b + 192 + i // 16)) * q
    elif KIND == 7:  # Q3_K: hmask[32], qs[64], 12 scale bytes, f16 d; 16 sub-blocks of 16
        i = ks[None, :] % 256
        b = row + (ks[None, :] // 256) * 110
        sub = i // 16
        low = (_u8(b + 96 + sub % 8) >> (4 * (sub // 8))) & 15
        high = (_u8(b + 104 + sub % 4) >> (2 * (sub // 4))) & 3
        sc = ((low | (high << 4)) - 32).to(tl.float32)
        h, r = i // 128, i % 128
        ql = (_u8(b + 32 + h * 32 + r % 32) >> (2 * (r // 32))) & 3
        hbit = (_u8(b + i % 32) >> (i // 32)) & 1
        q = (ql - ((hbit ^ 1) << 2)).to(tl.float32)
        w = (_f16(b + 108) * sc) * q
    else:  # IQ4_XS: f16 d, u16 scales_h, scales_l[4], qs[128]; eight sub-blocks of 32
        i = ks[None, :] % 256
        sb, t = i // 32, i % 32
        b = row + (ks[None, :] // 256) * 136
        high = ((_u8(b + 2) | (_u8(b + 3) << 8)) >> (2 * sb)) & 3
        low = (_u8(b + 4 + sb // 2) >> (4 * (sb % 2))) & 15
        sc = ((low | (high << 4)) - 32).to(tl.float32)
        q = (_u8(b + 8 + sb * 16 + t % 16) >> (4 * (t // 16))) & 15
        w = (_f16(b) * sc) * _iq4(q)
    return w


@triton.jit
def row_bytes_of(K, KIND: tl.constexpr):
    """Bytes of a row of K weights of KINDS[KIND]."""
    if KIND == 0:
        return K // 32 * 34
    elif KIND == 1:
        return K // 32 * 22
    elif KIND == 2:
        return K // 32 * 24
    elif KIND == 3:
        return K // 32 * 18
    elif KIND == 4:
        return K // 256 * 144
    elif KIND == 5:
        return K // 256 * 176
    elif KIND == 6:
        return K // 256 * 210
    elif KIND == 7:
        return K // 256 * 110
    else:
        return K // 256 * 136


@triton.jit
def ggml_decode_kernel(w_ptr, out_ptr, R, K, row_bytes, KIND: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    live = (rows[:, None] < R) & (ks[None, :] < K)
    safe_rows = tl.where(rows < R, rows, 0).to(tl.int64)
    safe_ks = tl.where(ks < K, ks, 0)
    w = decode_tile(w_ptr, safe_rows, safe_ks, row_bytes, KIND)
    store_rounded(out_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], w, live, EMULATE)  # to nearest, as torch


def ggml_decode(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """quant/ggml.py `decode` in one kernel: raw uint8 (rows of blocks, contiguous) -> `shape` in `dtype`."""
    K = shape[-1]
    R = raw.numel() // ggml.row_bytes(kind, K)
    out = torch.empty(R, K, dtype=dtype, device=raw.device)
    BLOCK_R, BLOCK_K = 16, 256
    grid = (triton.cdiv(R, BLOCK_R), triton.cdiv(K, BLOCK_K))
    ggml_decode_kernel[grid](raw.contiguous(), out, R, K, ggml.row_bytes(kind, K), KINDS.index(kind),
                             BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, EMULATE=interpreting())
    return out.reshape(shape)
