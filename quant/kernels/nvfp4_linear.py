"""y = x @ W^T with W in NVFP4, dequantized in registers (never materialised in memory).

Shapes and packing (ModelOpt's layout, see quant/nvfp4.py):
- x            [M, K] float32 / bfloat16 / float16, rows contiguous;
- weight       uint8 [N, K/2]: element 2i of a row in the low nibble of byte i, 2i+1 in the high nibble;
- weight_scale uint8 view of float8_e4m3fn [N, K/16]: one scale per 16 inputs;
- row_scale_2  float32 [N]: each row's global scale (weight_scale_2 expanded);
- y            [M, N] in x's dtype.
Each weight is dequantized exactly as the reference does it, (e2m1 * scale) * scale_2 in float32, rounded to x's
dtype, then multiplied on the tensor cores with float32 accumulation (IEEE float32 for float32 inputs). K must be a
multiple of 16; M and N are arbitrary (masked). A program computes a BLOCK_M x BLOCK_N tile and walks K in
BLOCK_K steps: packed bytes [BLOCK_N, BLOCK_K/2] are split into low and high nibbles and interleaved back into K
order with tl.join. On Blackwell a native FP4 path (tl.dot_scaled) would skip the dequantization; it is not used
here (the interpreter decodes its e4m3 scales as e8m0, so it could not be tested on the CPU).
"""

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import dot_acc, e2m1_value, e4m3_value, store_rounded, to_compute


@triton.jit
def nvfp4_linear_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                        EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit: M x K passes 2^31 on long prompts
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    row_s2 = tl.load(s2_ptr + rn, mask=rn < N, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        kb = k0 // 2 + half  # byte index within the row
        wmask = (rn[:, None] < N) & (kb[None, :] < K // 2)
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + kb[None, :], mask=wmask, other=0).to(tl.int32)
        scale_bits = tl.load(s_ptr + rn[:, None] * (K // 16) + kb[None, :] // 8, mask=wmask, other=0).to(tl.int32)
        scale = e4m3_value(scale_bits)
        lo = (e2m1_value(packed & 15) * scale) * row_s2[:, None]
        hi = (e2m1_value(packed >> 4) * scale) * row_s2[:, None]
        w = to_compute(tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K), x.dtype, EMULATE)  # 2i: low nibble
        acc = dot_acc(acc, x, tl.trans(w), IEEE, EMULATE)
    store_rounded(y_ptr + rm[:, None] * N + rn[None, :], acc, (rm[:, None] < M) & (rn[None, :] < N), EMULATE)


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 row_scale_2: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] (see the module docstring for the operands)."""
    N, half = weight.shape
    K = 2 * half
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BLOCK_M = 16 if M <= 16 else 64
    BLOCK_N, BLOCK_K = 64, 64 if K % 64 == 0 else 32
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    nvfp4_linear_kernel[grid](x2, weight, weight_scale.view(torch.uint8), row_scale_2.float().contiguous(), y,
                              M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, x.dtype == torch.float32, interpreting())
    return y.reshape(*lead, N)
