"""Triton helpers shared by the kernels (device functions, not kernels): number decoding and the activation.

Scales and codes are decoded with integer arithmetic rather than float8 casts, so the same code runs compiled and
in Triton's interpreter (whose float8 support differs), and every decoded value is exact in float32.
"""

import triton
import triton.language as tl


@triton.jit
def e2m1_value(code):
    """4-bit E2M1 codes (int32, 0..15; bit 3 the sign) -> float32: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives."""
    idx = code & 7
    e = idx >> 1
    m = (idx & 1).to(tl.float32)
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * pow2)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e4m3_value(bits):
    """float8_e4m3fn bit patterns (int32, 0..255) -> float32 (scales are positive; sign kept anyway)."""
    exp = (bits >> 3) & 15
    man = (bits & 7).to(tl.float32)
    # 2^(exp - 7) built from its float32 bit pattern; exp 0 is subnormal: man / 8 * 2^-6
    pow2 = ((tl.maximum(exp, 1) + 120) << 23).to(tl.float32, bitcast=True)
    mag = tl.where(exp == 0, man * 0.001953125, (1.0 + man * 0.125) * pow2)
    return tl.where((bits & 128) != 0, -mag, mag)


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
    """acc + x @ w_t with float32 accumulation (w_t already [K, N] in the compute dtype, or float32 if EMULATE)."""
    if EMULATE:
        return acc + tl.dot(x.to(tl.float32), w_t, input_precision="ieee")
    if IEEE:
        return acc + tl.dot(x, w_t, input_precision="ieee")
    return acc + tl.dot(x, w_t)


@triton.jit
def store_rounded(ptr, value, mask, EMULATE: tl.constexpr):
    """Store float32 `value` into ptr's dtype with round-to-nearest, also under the interpreter."""
    if EMULATE:
        if ptr.dtype.element_ty == tl.bfloat16:
            value = round_bf16(value)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)
