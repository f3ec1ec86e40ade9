"""A matmul's weight tile read from GGUF blocks where they lie, word by word: the fast decode for the block types the
published files are made of (every type dgemma reads: quant/ggml.py), for the kernels that multiply by a GGUF matrix
(the routed experts, moe_gate_up / moe_down FORMAT gguf; the dense linears, ggml_linear.py).

`ggml_tile` gives rows `rows` of a [R, K] ggml matrix at inputs k0..k0+BLOCK_K as float32 [BLOCK_K, BLOCK_N]
(transposed: the dot's right operand) in the tile's own order: the order in which the block's packed words yield
their weights, not K order. `tile_order` says which input each of its rows holds, so the caller loads its
activations at k0 + tile_order and the dot is the same sum (the routed experts' NVFP4 path does the same with its
pair order). Reading the blocks in K order means a byte gather per weight
(ggml_decode.decode_tile: 22 to 106 thread-instructions a weight in the MoE kernels, BENCHMARKS.md); in the tile's
order each packed 16- or 32-bit word is loaded once and gives 2 to 8 weights by shifts and masks, and each
sub-block's scale is made once per word a thread holds, not per weight.

The arithmetic is quant/ggml.py's, in its float32 order: in Triton's interpreter each weight equals the torch
decode bit for bit (on a GPU a fused multiply-add may round the K types' d sc q - dmin m differently in the last
bit, as ggml_decode's). Tiles: BLOCK_K a multiple of the block for the 32-weight types (a tile past K reads no byte:
its blocks are masked to 0), 128 or 256 for the 256-weight types (half or all of a super-block; K is whole
super-blocks).

Layouts (ggml-common.h, little-endian; quant/ggml.py says the same):
- Q8_0, 34 bytes: f16 d, int8 q[32]. Each 16-bit word holds q[2j], q[2j + 1]: K order.
- Q5_0, 22 bytes: f16 d, qh[4], qs[16]; Q5_1, 24 bytes: f16 d, f16 m, qh[4], qs[16]. The 16-bit word j of qs holds
  weights 2j, 2j + 1 (low nibbles) and 2j + 16, 2j + 17 (high nibbles); bit i of qh is weight i's fifth bit.
- Q4_K, 144 bytes: f16 d, f16 dmin, 12 scale bytes, qs[128]. The 32-bit word w of chunk c (32 bytes) holds weights
  64c + 4w + b (byte b's low nibble) and 64c + 32 + 4w + b (its high nibble), sub-blocks 2c and 2c + 1.
- Q3_K, 110 bytes (2-byte aligned): hmask[32], qs[64], 12 scale bytes, f16 d. In half h, weight r = 32 s + j takes
  bits 2s of qs byte 32 h + j and bit 4h + s of hmask byte j (16-bit words here): K order; its scale is sub-block
  8h + r // 16.
- IQ4_NL, 18 bytes: f16 d, qs[16] as Q5_0's; the 4-bit codes index a grid of 16 int8 values (`_iq4`).
- IQ4_XS, 136 bytes: f16 d, u16 scales_h, scales_l[4], qs[128]; sub-block sb's 16 qs bytes as IQ4_NL's, its six-bit
  scale from scales_l[sb / 2]'s nibble and scales_h's bits 2 sb.
- Q5_K, 176 bytes: Q4_K's d, dmin and scale bytes, qh[32] (bit sb of byte j: sub-block sb's weight j's fifth bit),
  then Q4_K's qs[128].
- Q6_K, 210 bytes: ql[128], qh[64], int8 scales[16], f16 d. In half h, weight r = 32 quarter + 4w + b takes its low
  four bits from ql's word 16h + 8 (quarter % 2) + w, byte b, nibble quarter // 2, and its high two from qh's word
  8h + w, byte b, bits 2 quarter; its scale is sub-block 8h + r // 16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .ggml_decode import decode_tile

# KINDS indices (ggml_decode.KINDS, quant/ggml.BLOCK_KINDS) of the 256-weight types: their tiles are 128 or 256 inputs
SUPER_BLOCK_KINDS = (4, 5, 6, 7, 8)


@triton.jit
def _words(p, mask, BITS: tl.constexpr):
    """The little-endian 16- or 32-bit words at byte pointers p (uint8), as int32 (16-bit ones zero-extended)."""
    if BITS == 16:
        return tl.load(p.to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32) & 0xFFFF
    return tl.load(p.to(tl.pointer_type(tl.int32)), mask=mask, other=0)


@triton.jit
def _words_all(p, BITS: tl.constexpr):
    """`_words` where every word lies inside the matrix (no mask)."""
    if BITS == 16:
        return tl.load(p.to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF
    return tl.load(p.to(tl.pointer_type(tl.int32)))


@triton.jit
def _half(p, mask):
    """The f16 at byte pointers p (2-byte aligned) as float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _half_all(p):
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _q5_index():
    """Q5_0 / Q5_1 / IQ4_NL tile order as [1, 8, 2, 2, 1] (block, qs word j, half, byte, row): the input within the block,
    16 half + 2 j + byte."""
    j = tl.arange(0, 8)[None, :, None, None, None]
    half = tl.arange(0, 2)[None, None, :, None, None]
    byte = tl.arange(0, 2)[None, None, None, :, None]
    return 16 * half + 2 * j + byte


@triton.jit
def _iq4(q):
    """IQ4_NL's and IQ4_XS's grid (ggml.IQ4_VALUES) at 4-bit codes q (int32): the 16 int8 values packed four to a
    word, a word chosen by q's two high bits, its byte by the two low ones, sign-extended: float32."""
    w = tl.where(q < 8, tl.where(q < 4, -1079142271, -152379953), tl.where(q < 12, 639175937, 1901675829))
    return ((w << (24 - 8 * (q & 3))) >> 24).to(tl.float32)


@triton.jit
def _iq4xs_index(SB: tl.constexpr):
    """IQ4_XS tile order as [SB, 4, 4, 2, 1] (sub-block, qs word, byte, nibble, row): the input within the tile,
    32 sb + 16 nibble + 4 word + byte."""
    sb = tl.arange(0, SB)[:, None, None, None, None]
    u = tl.arange(0, 4)[None, :, None, None, None]
    byte = tl.arange(0, 4)[None, None, :, None, None]
    half = tl.arange(0, 2)[None, None, None, :, None]
    return 32 * sb + 16 * half + 4 * u + byte


@triton.jit
def _q4k_index(C: tl.constexpr):
    """Q4_K tile order as [C, 8, 4, 2, 1] (chunk, word, byte, half, row): the input within the tile,
    64 c + 32 half + 4 w + byte."""
    c = tl.arange(0, C)[:, None, None, None, None]
    w = tl.arange(0, 8)[None, :, None, None, None]
    byte = tl.arange(0, 4)[None, None, :, None, None]
    half = tl.arange(0, 2)[None, None, None, :, None]
    return 64 * c + 32 * half + 4 * w + byte


@triton.jit
def _q6k_index(H2: tl.constexpr):
    """Q6_K tile order as [H2, 2, 8, 4, 2, 1] (half, quarter % 2, word, byte, quarter // 2, row): the input within
    the tile, 128 h + 32 quarter + 4 w + byte."""
    h = tl.arange(0, H2)[:, None, None, None, None, None]
    par = tl.arange(0, 2)[None, :, None, None, None, None]
    w = tl.arange(0, 8)[None, None, :, None, None, None]
    byte = tl.arange(0, 4)[None, None, None, :, None, None]
    hi = tl.arange(0, 2)[None, None, None, None, :, None]
    return 128 * h + 32 * (2 * hi + par) + 4 * w + byte


@triton.jit
def tile_order(BLOCK_K: tl.constexpr, KIND: tl.constexpr):
    """[BLOCK_K] int32: the input (offset from k0) each row of `ggml_tile` holds."""
    if KIND == 1 or KIND == 2 or KIND == 3:
        NB: tl.constexpr = BLOCK_K // 32
        return tl.reshape(_q5_index() + 32 * tl.arange(0, NB)[:, None, None, None, None], (BLOCK_K,))
    elif KIND == 8:
        return tl.reshape(_iq4xs_index(BLOCK_K // 32), (BLOCK_K,))
    elif KIND == 4 or KIND == 5:
        return tl.reshape(_q4k_index(BLOCK_K // 64), (BLOCK_K,))
    elif KIND == 6:
        return tl.reshape(_q6k_index(BLOCK_K // 128), (BLOCK_K,))
    else:  # Q8_0's words hold K-adjacent pairs; the other types are read in K order
        return tl.arange(0, BLOCK_K)


@triton.jit
def ggml_tile(w_ptr, rows, k0, K, row_bytes, KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows `rows` ([BLOCK_N] int64, inside the matrix) of the ggml matrix at w_ptr (uint8, `row_bytes` a row, K
    inputs) at inputs k0 + tile_order(BLOCK_K, KIND), transposed: float32 [BLOCK_K, BLOCK_N] (the dot's right
    operand). k0 a multiple of BLOCK_K; inputs past K are 0.

    The row is the last dimension of every intermediate: Triton lays the lanes of a warp along it, so a thread holds
    all of a row's weights in the tile and makes each sub-block's scale once, not once per weight (with the row
    first, a thread held one weight of each of 128 rows and rebuilt a scale for each)."""
    row = w_ptr + rows[None, :] * row_bytes  # [1, BLOCK_N]
    if KIND == 0:  # Q8_0: [NB, 16, 2, BLOCK_N]
        NB: tl.constexpr = BLOCK_K // 32
        nb = k0 // 32 + tl.arange(0, NB)
        live = (nb < K // 32)[:, None]
        blk = row + nb[:, None] * 34  # [NB, BLOCK_N]
        d = _half(blk, live)[:, None, None, :]
        v = _words(blk[:, None, :] + 2 + 2 * tl.arange(0, 16)[None, :, None], live[:, None, :], 16)
        s = tl.arange(0, 2)[None, None, :, None]
        q = ((v[:, :, None, :] << (24 - 8 * s)) >> 24).to(tl.float32)  # q[2j + s], sign-extended
        return tl.reshape(q * d, (BLOCK_K, BLOCK_N))
    elif KIND == 1 or KIND == 2 or KIND == 3:  # Q5_0, Q5_1, IQ4_NL: [NB, 8, 2, 2, BLOCK_N]
        NB: tl.constexpr = BLOCK_K // 32
        nb = k0 // 32 + tl.arange(0, NB)
        live = (nb < K // 32)[:, None]
        blk = row + nb[:, None] * (22 if KIND == 1 else (24 if KIND == 2 else 18))
        d = _half(blk, live)[:, None, None, None, :]
        qs_at = blk + (6 if KIND == 1 else (8 if KIND == 2 else 2))
        v = _words(qs_at[:, None, :] + 2 * tl.arange(0, 8)[None, :, None], live[:, None, :], 16)
        half = tl.arange(0, 2)[None, None, :, None, None]
        byte = tl.arange(0, 2)[None, None, None, :, None]
        nib = (v[:, :, None, None, :] >> (8 * byte + 4 * half)) & 15
        if KIND == 3:
            w = d * _iq4(nib)
        else:
            qh_at = blk + (2 if KIND == 1 else 4)
            qh = _words(qh_at, live, 16) | (_words(qh_at + 2, live, 16) << 16)  # [NB, BLOCK_N]
            fifth = ((qh[:, None, None, None, :] >> _q5_index()) & 1) << 4
            q = (nib | fifth).to(tl.float32)
            if KIND == 1:
                w = d * (q - 16.0)
            else:
                w = d * q + _half(blk + 2, live)[:, None, None, None, :]
        return tl.reshape(w, (BLOCK_K, BLOCK_N))
    elif KIND == 4 or KIND == 5:  # Q4_K, Q5_K: [C, 8, 4, 2, BLOCK_N]
        C: tl.constexpr = BLOCK_K // 64
        blk = row + (k0 // 256) * (144 if KIND == 4 else 176)  # [1, BLOCK_N]
        c = (k0 % 256) // 64 + tl.arange(0, C)  # the tile's chunks of the super-block
        w = tl.arange(0, 8)[None, :, None]
        v = _words_all(blk[:, None, :] + (16 if KIND == 4 else 48) + 32 * c[:, None, None] + 4 * w, 32)
        byte = tl.arange(0, 4)[None, None, :, None, None]
        half = tl.arange(0, 2)[None, None, None, :, None]
        # sub-block 2c + half: its weights' low four bits, and their scale and min (ggml._k_scales), from the three
        # words of scale bytes
        sb = 2 * c[:, None, None, None, None] + half  # [C, 1, 1, 2, 1]
        q = (v[:, :, None, None, :] >> (8 * byte + 4 * half)) & 15
        if KIND == 5:  # the fifth bit: bit sb of qh byte 4w + byte (qh, 32 bytes, after the scales)
            qh = _words_all(blk[:, None, :] + 16 + 4 * w, 32)[:, :, None, None, :]  # [1, 8, 1, 1, BLOCK_N]
            q = q | (((qh >> (8 * byte + sb)) & 1) << 4)
        q = q.to(tl.float32)
        s0 = _words_all(blk + 4, 32)[:, None, None, None, :]
        s1 = _words_all(blk + 8, 32)[:, None, None, None, :]
        s2 = _words_all(blk + 12, 32)[:, None, None, None, :]
        j = 8 * (sb % 4)
        b0, b1, b2 = (s0 >> j) & 255, (s1 >> j) & 255, (s2 >> j) & 255
        lo = sb < 4
        sc = tl.where(lo, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4)).to(tl.float32)
        mn = tl.where(lo, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4)).to(tl.float32)
        d = _half_all(blk)[:, None, None, None, :]
        dmin = _half_all(blk + 2)[:, None, None, None, :]
        return tl.reshape((d * sc) * q - dmin * mn, (BLOCK_K, BLOCK_N))
    elif KIND == 6:  # Q6_K: [H2, 2, 8, 4, 2, BLOCK_N]
        H2: tl.constexpr = BLOCK_K // 128
        blk = row + (k0 // 256) * 210
        b6 = blk[:, None, None, None, None, :]
        h = (k0 % 256) // 128 + tl.arange(0, H2)[:, None, None, None, None, None]
        par = tl.arange(0, 2)[None, :, None, None, None, None]
        w = tl.arange(0, 8)[None, None, :, None, None, None]
        byte = tl.arange(0, 4)[None, None, None, :, None, None]
        hi = tl.arange(0, 2)[None, None, None, None, :, None]
        ql = _words_all(b6 + 64 * h + 32 * par + 4 * w, 32)  # [H2, 2, 8, 1, 1, BLOCK_N]
        qh = _words_all(b6 + 128 + 32 * h + 4 * w, 32)  # [H2, 1, 8, 1, 1, BLOCK_N]
        quarter = 2 * hi + par
        low = (ql >> (8 * byte + 4 * hi)) & 15
        high = (qh >> (8 * byte + 2 * quarter)) & 3
        q = ((low | (high << 4)) - 32).to(tl.float32)
        sc = tl.load(b6 + 192 + 8 * h + 2 * quarter + w // 4).to(tl.int8, bitcast=True).to(tl.float32)
        d = _half_all(blk + 208)[:, None, None, None, None, :]
        return tl.reshape((d * sc) * q, (BLOCK_K, BLOCK_N))
    elif KIND == 7:  # Q3_K (110-byte blocks: 16-bit words): [H2, 4, 2, 8, 2, BLOCK_N], in K order
        H2: tl.constexpr = BLOCK_K // 128
        blk = row + (k0 // 256) * 110
        b6 = blk[:, None, None, None, None, :]
        h = (k0 % 256) // 128 + tl.arange(0, H2)[:, None, None, None, None, None]
        shift = tl.arange(0, 4)[None, :, None, None, None, None]  # which 2 bits of a qs byte: weights 32 apart
        hi = tl.arange(0, 2)[None, None, :, None, None, None]
        lo = tl.arange(0, 8)[None, None, None, :, None, None]
        byte = tl.arange(0, 2)[None, None, None, None, :, None]
        hw = 8 * hi + lo  # the 16-bit word of the half's 32 qs bytes (and of hmask's 32)
        qs = _words_all(b6 + 32 + 32 * h + 2 * hw, 16)  # [H2, 1, 2, 8, 1, BLOCK_N]
        hm = _words_all(b6 + 2 * hw, 16)  # [1, 1, 2, 8, 1, BLOCK_N]
        ql = (qs >> (8 * byte + 2 * shift)) & 3
        high_bit = (hm >> (8 * byte + 4 * h + shift)) & 1
        q = (ql | (high_bit << 2)).to(tl.float32) - 4.0  # the high bit clear subtracts 4
        sub = 8 * h + 2 * shift + hi  # [H2, 4, 2, 1, 1, 1]: the sixteen-weight sub-block
        low = (tl.load(b6 + 96 + sub % 8).to(tl.int32) >> (4 * (sub // 8))) & 15
        high = (tl.load(b6 + 104 + sub % 4).to(tl.int32) >> (2 * (sub // 4))) & 3
        sc = ((low | (high << 4)) - 32).to(tl.float32)
        d = _half_all(blk + 108)[:, None, None, None, None, :]
        return tl.reshape((d * sc) * q, (BLOCK_K, BLOCK_N))
    elif KIND == 8:  # IQ4_XS: [SB, 4, 4, 2, BLOCK_N]
        SB: tl.constexpr = BLOCK_K // 32
        blk = row + (k0 // 256) * 136
        sb = (k0 % 256) // 32 + tl.arange(0, SB)[:, None, None, None, None]  # the tile's sub-blocks of 32
        u = tl.arange(0, 4)[None, :, None, None, None]
        byte = tl.arange(0, 4)[None, None, :, None, None]
        half = tl.arange(0, 2)[None, None, None, :, None]
        b5 = blk[:, None, None, None, :]
        v = _words_all(b5 + 8 + 16 * sb + 4 * u, 32)  # [SB, 4, 1, 1, BLOCK_N]
        nib = (v >> (8 * byte + 4 * half)) & 15
        low = (tl.load(b5 + 4 + sb // 2).to(tl.int32) >> (4 * (sb % 2))) & 15  # [SB, 1, 1, 1, BLOCK_N]
        high = (_words_all(b5 + 2, 16) >> (2 * sb)) & 3
        sc = ((low | (high << 4)) - 32).to(tl.float32)
        d = _half_all(blk)[:, None, None, None, :]
        return tl.reshape((d * sc) * _iq4(nib), (BLOCK_K, BLOCK_N))
    else:  # the other types: an element's bytes gathered where they lie, in K order (tile_order: arange)
        ks = k0 + tl.arange(0, BLOCK_K)
        w = decode_tile(w_ptr, rows, tl.where(ks < K, ks, 0), row_bytes, KIND)
        return tl.trans(tl.where(ks[None, :] < K, w, 0.0))
