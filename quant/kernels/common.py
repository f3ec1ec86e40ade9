"""Triton helpers shared by the kernels (device functions, not kernels; and the check and the activation reorder
their wrappers share):

NVFP4 decoding, bit-parallel. A 32-bit word holds 8 E2M1 codes of one row, nibble i = element k0 + i (ModelOpt
packs element 2j in the low nibble of byte j, so a little-endian word is exactly this). Codes i and i + 4 sit 16 bits
apart, so one shift and two masks turn them into a bfloat16 pair: magnitude bits (e1 e0 m) go to bits 6..8 of each
half (the low exponent bits and the top mantissa bit), the sign to bit 15. Read as bfloat16 that is a * 2^-126 for
every code, zero and the subnormal 0.5 included (exponent field e, bias 127, against E2M1's bias 1). Multiplying by
the block scale s * 2^64 (decoded from its e4m3 bits, once per 16 elements) gives a * s * 2^-62: a normal bfloat16
holding a * s exactly (at most 5 significant bits, 2^-72 <= |a s 2^-62| <= 2^-50.6), so the tensor cores see exact
products, and the kernel's epilogue multiplies the float32 accumulator by 2^62 * scale_2 (per output row). This is
the order production NVFP4 kernels use (the global scale in the epilogue); it differs from the reference's
round((a * s) * scale_2) per weight only by rounding, and is the more exact of the two.

Under Triton's interpreter bfloat16 arithmetic is not IEEE (products come out wrong, subnormals flush), so EMULATE
does the one bfloat16 multiply in float32, where the same exact product results. On a GPU the bfloat16 multiply
takes the subnormal 2^-127 (the code 0.5) as it is; were a GPU to flush it, every 0.5 would decode as 0, which the
first-use probe (probe.py) would see and answer with the torch path.
"""

import torch
import triton
import triton.language as tl

# a * s * 2^-62 in the tensor cores -> a * s: the epilogue multiplies by this (exactly, a power of two)
UNSHIFT = tl.constexpr(4.611686018427388e18)  # 2^62


@triton.jit
def e4m3_shifted(bits):
    """e4m3 scale bits (int32, 0..127: scales are positive) -> float32 s * 2^64, exact for normal and subnormal s.
    Placed at bits 20.. of a float32, the e4m3 exponent and mantissa read as s * 2^-120 (subnormals included)."""
    f = ((bits & 0x7F) << 20).to(tl.float32, bitcast=True)
    return f * 4.951760157141521e27 * 4.951760157141521e27  # * 2^92 * 2^92


@triton.jit
def e2m1_pair(w, q: tl.constexpr):
    """int32 words of 8 codes -> int32 bit patterns of bfloat16 pairs (element q low half, element q + 4 high half),
    each a * 2^-126."""
    if q == 0:
        r = ((w << 6) & 0x01C001C0) | ((w << 12) & -2147450880)  # -2147450880 = 0x80008000
    elif q == 1:
        r = ((w << 2) & 0x01C001C0) | ((w << 8) & -2147450880)
    elif q == 2:
        r = ((w >> 2) & 0x01C001C0) | ((w << 4) & -2147450880)
    else:
        r = ((w >> 6) & 0x01C001C0) | (w & -2147450880)
    return r


@triton.jit
def scaled_pair(r, scale2, EMULATE: tl.constexpr):
    """A decoded pair (bfloat16 a * 2^-126 in each half of r [BN, W] int32) times the scale (scale2 [BN, W] int32:
    the bfloat16 bits of s * 2^64 in both halves) -> [BN, W, 2] bfloat16 a * s * 2^-62 (low half, high half), exact.
    On a GPU one packed bfloat16x2 multiply-add per pair (-0 added, so every product keeps its sign), written as PTX:
    a multiply of two 16-bit values each, as Triton would write it, leaves ptxas to repack the halves and costs a
    register move per pair. The code for 0.5 is a bfloat16 subnormal here (2^-127), which the packed bfloat16 units
    take as it is; the interpreter flushes bfloat16 subnormals, runs no PTX and its bfloat16 products are wrong, so
    EMULATE reads each half as a float32 (2^-127 is exact there too) and multiplies in float32."""
    if EMULATE:
        s = (scale2 & -65536).to(tl.float32, bitcast=True)
        lo = ((r & 0xFFFF) << 16).to(tl.float32, bitcast=True) * s
        hi = (r & -65536).to(tl.float32, bitcast=True) * s
        return tl.join(lo, hi).to(tl.bfloat16)
    p = tl.inline_asm_elementwise("{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
                                  "=r,r,r", [r, scale2], dtype=tl.int32, is_pure=True, pack=1)
    return tl.join(p.to(tl.int16), (p >> 16).to(tl.int16)).to(tl.bfloat16, bitcast=True)


@triton.jit
def nvfp4_tile(w, sbits, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_ORDER: tl.constexpr,
               EMULATE: tl.constexpr):
    """Packed words [BLOCK_N, BLOCK_K/8] int32 and their scale bits [BLOCK_N, BLOCK_K/16] int32 -> the tile
    [BLOCK_N, BLOCK_K] bfloat16 of a * s * 2^-62. K_ORDER: columns in K order (a byte permute per pair, so the
    pairs a word yields become K-adjacent); otherwise in the decode's own order, each group of 8 inputs as
    k0 k4 k1 k5 k2 k6 k3 k7 (`pair_order`), for a caller whose other operand is laid out the same way."""
    s = e4m3_shifted(sbits).to(tl.int32, bitcast=True)  # a float32 with 3 significant bits: exact as a bfloat16
    s = s | (s >> 16)  # its bfloat16 bits in both halves
    s = tl.join(s, s).reshape(BLOCK_N, BLOCK_K // 8)  # one scale per word (16 elements = 2 words)
    p0 = scaled_pair(e2m1_pair(w, 0), s, EMULATE)  # [BN, BK/8, 2 (half)]: elements (q, q + 4) of each word
    p1 = scaled_pair(e2m1_pair(w, 1), s, EMULATE)
    p2 = scaled_pair(e2m1_pair(w, 2), s, EMULATE)
    p3 = scaled_pair(e2m1_pair(w, 3), s, EMULATE)
    v = tl.join(tl.join(p0, p2), tl.join(p1, p3))  # [BN, BK/8, 2 (half), 2 (q bit 1), 2 (q bit 0)]
    if K_ORDER:  # already element 4*half + 2*q1 + q0
        return v.reshape(BLOCK_N, BLOCK_K)
    else:  # position 2q + half = 4*q1 + 2*q0 + half
        return tl.permute(v, (0, 1, 3, 4, 2)).reshape(BLOCK_N, BLOCK_K)


@triton.jit
def pair_order(cols):
    """Where K-ordered column c sits in the decode's own order (nvfp4_tile without K_ORDER): within each group of
    8, c = 4 * half + q goes to 2 * q + half."""
    return (cols & -8) | ((cols & 3) << 1) | ((cols >> 2) & 1)


@triton.jit
def load_nvfp4_tile(w_ptr, s_ptr, rows, k0, K, NROWS, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    K_ORDER: tl.constexpr, MASKED: tl.constexpr, EMULATE: tl.constexpr):
    """Rows `rows` (int64 [BLOCK_N], absolute row numbers of an int32 word array [*, K/8] and its scale bytes
    [*, K/16]) at inputs k0..k0 + BLOCK_K -> [BLOCK_N, BLOCK_K] bfloat16 a * s * 2^-62 (nvfp4_tile). MASKED: rows
    >= NROWS and inputs past K read as zero; without it the caller guarantees a whole tile (no compare per load)."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    w_at = w_ptr + rows[:, None] * (K // 8) + kw[None, :]
    s_at = s_ptr + rows[:, None] * (K // 16) + ks[None, :]
    if MASKED:
        live = rows[:, None] < NROWS
        w = tl.load(w_at, mask=live & (kw[None, :] < K // 8), other=0)
        sb = tl.load(s_at, mask=live & (ks[None, :] < K // 16), other=0).to(tl.int32)
    else:
        w = tl.load(w_at)
        sb = tl.load(s_at).to(tl.int32)
    return nvfp4_tile(w, sb, BLOCK_N, BLOCK_K, K_ORDER, EMULATE)


@triton.jit
def nvfp4_operand(tile, dtype: tl.constexpr):
    """The decoded tile as the dot's operand in the compute dtype, and the factor the accumulator then needs (before
    scale_2). bfloat16 / float32 take a * s * 2^-62 as it is; float16 cannot hold it (its range ends at 2^-24), so
    there it becomes a * s (exact: 2^-10 <= |a s| <= 2688) at the cost of two more instructions per element."""
    if dtype == tl.float16:
        return (tile.to(tl.float32) * UNSHIFT).to(tl.float16), 1.0
    else:  # (an else, so the compiler never sees both returns)
        return tile, UNSHIFT


@triton.jit
def gate_up_rows(pid_n, I, BLOCK_N: tl.constexpr):
    """[2 * BLOCK_N] rows of one expert's [2I, K] gate-up weights for column block pid_n of I: the gate rows, then
    the up rows I further, so one tile (and one product per K step, as wide as both) covers both projections; the
    accumulator comes apart with `split_gate_up`."""
    both = tl.arange(0, 2 * BLOCK_N)
    return pid_n * BLOCK_N + both % BLOCK_N + (both // BLOCK_N) * I


@triton.jit
def split_gate_up(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_M, 2 * BLOCK_N] accumulator of a `gate_up_rows` tile -> (gate, up), each [BLOCK_M, BLOCK_N]."""
    return tl.split(tl.permute(acc.reshape(BLOCK_M, 2, BLOCK_N), (0, 2, 1)))


@triton.jit
def segment_scale(s2_ptr, e, UP: tl.constexpr, NSEG: tl.constexpr):
    """Expert e's NVFP4 global scale (float32) for its gate rows (UP False) or up rows: s2[e, :NSEG] holds NSEG = 2
    (gate and up each their own, as ModelOpt stores them) or 1 (one for all the rows). One scalar per program, so an
    epilogue keeps no per-column index alive across the K loop."""
    return tl.load(s2_ptr + e * NSEG + (NSEG - 1 if UP else 0))


def global_segments(scale_2) -> int:
    """The number of global scales per expert of a [E, S] weight_scale_2 stack, which the epilogues read as one for
    the gate rows and one for the up rows (`segment_scale`): 1 or 2, anything else refused."""
    segments = scale_2.shape[1]
    if segments not in (1, 2):
        raise ValueError(f"NVFP4 gate-up stacks have one or two global scales per expert (got {segments})")
    return segments


@triton.jit
def block_rows(ids_ptr, pid_b, BLOCK_M: tl.constexpr):
    """The rows of block pid_b of the MoE block plan (routing.py): (slots [BLOCK_M], assignment ids t*K + k,
    live: False on the plan's padding rows, whose id is -1)."""
    slots = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + slots)
    return slots, ids, ids >= 0


@triton.jit
def segment_of(pid_n, BLOCK_N: tl.constexpr, w_ptr, s_ptr, s2_ptr, y_ptr, N, w1_ptr, s1_ptr, s21_ptr, y1_ptr, N1,
               w2_ptr, s2b_ptr, s22_ptr, y2_ptr, N2, SEGMENTS: tl.constexpr):
    """Several linears of one input in one launch (q, k and v): the grid's column tiles are the first linear's, then
    the second's, then the third's. -> the operands (weight, scales, row scales, output, width) of the linear that
    column tile `pid_n` belongs to, and the tile's number within it."""
    tiles = tl.cdiv(N, BLOCK_N)
    if pid_n >= tiles:
        pid_n = pid_n - tiles
        w_ptr, s_ptr, s2_ptr, y_ptr, N = w1_ptr, s1_ptr, s21_ptr, y1_ptr, N1
        if SEGMENTS > 2:
            tiles = tl.cdiv(N1, BLOCK_N)
            if pid_n >= tiles:
                pid_n = pid_n - tiles
                w_ptr, s_ptr, s2_ptr, y_ptr, N = w2_ptr, s2b_ptr, s22_ptr, y2_ptr, N2
    return w_ptr, s_ptr, s2_ptr, y_ptr, N, pid_n


@triton.jit
def gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), float32; tanh(z) = 1 - 2 / (exp(2z) + 1)."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
    return 0.5 * x * (1.0 + t)


@triton.jit
def round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still in float32. Used instead of a cast under the
    interpreter, whose float32 -> bfloat16 conversion does not round to nearest (NaN is not expected here)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def to_compute(w, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """Round float32 weights to the compute dtype. EMULATE (the interpreter): keep them in float32 holding exactly
    the rounded values, and let the caller multiply in IEEE float32, which gives the same products."""
    if EMULATE:
        if dtype == tl.bfloat16:
            return round_bf16(w)
        return w.to(dtype).to(tl.float32)
    return w.to(dtype)


@triton.jit
def dot_acc(acc, x, w_t, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """acc + x @ w_t with float32 accumulation (w_t [K, N]; float32 operands under EMULATE or IEEE)."""
    if EMULATE:
        return acc + tl.dot(x.to(tl.float32), w_t.to(tl.float32), input_precision="ieee")
    if IEEE:
        return acc + tl.dot(x, w_t.to(tl.float32), input_precision="ieee")
    return tl.dot(x, w_t.to(x.dtype), acc)


@triton.jit
def lora_expand(acc, t_ptr, b_ptr, t_rows, t_live, b_rows, b_live, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                EMULATE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32 + t[t_rows] @ B[b_rows]^T: adapters' expansion in a kernel's epilogue. t and B
    are [*, BLOCK_R] in the compute dtype (t: rank products, kernels/lora.py lora_shrink or moe_lora.py
    moe_lora_shrink; B: stacked factors); rows not live read as zero."""
    rr = tl.arange(0, BLOCK_R)
    t = tl.load(t_ptr + t_rows[:, None].to(tl.int64) * BLOCK_R + rr[None, :], mask=t_live[:, None], other=0.0)
    b = tl.load(b_ptr + b_rows[:, None].to(tl.int64) * BLOCK_R + rr[None, :], mask=b_live[:, None], other=0.0)
    return dot_acc(acc, t, tl.trans(b), IEEE, EMULATE)


@triton.jit
def store_rounded(ptr, value, mask, EMULATE: tl.constexpr):
    """Store float32 `value` into ptr's dtype with round-to-nearest, also under the interpreter."""
    if EMULATE:
        if ptr.dtype.element_ty == tl.bfloat16:
            value = round_bf16(value)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def row_absmax(base, K, BLOCK_K: tl.constexpr):
    """max |x| over one row of K elements at `base` (any float dtype), in float32: the first sweep of the per-row
    activation quantizers."""
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(base + cols, mask=cols < K, other=0.0).to(tl.float32)))
    return tl.max(amax, axis=0)


def pair_ordered(x: torch.Tensor) -> torch.Tensor:
    """[T, H] -> the same rows with each group of 8 columns in the NVFP4 decode's order k0 k4 k1 k5 k2 k6 k3 k7
    (`pair_order`; a torch function the MoE wrappers share), so the gate-up kernel's x tiles line up with its
    decoded weights without a permute per weight. One small pass over the activations, against a read of every
    expert's weights."""
    T, H = x.shape
    return x.reshape(T, H // 8, 2, 4).transpose(-1, -2).reshape(T, H)
