"""y = x @ W^T with W in dgemma's INT8 (one float32 scale per output row), dequantized in registers.

Shapes: x [M, K] float32 / bfloat16 / float16 (rows contiguous); weight int8 [N, K]; weight_scale float32 [N];
y [M, N] in x's dtype. Each weight becomes (q * scale) in float32, rounded to x's dtype as the reference does, and
the tile product accumulates in float32 (IEEE for float32 inputs). M, N, K arbitrary (masked). An 8-bit activation
path (W8A8: int8 x int8 on the integer tensor cores, per-token activation scales) is not implemented: at batch 1
the step is bound by reading weights, which W8A16 already reads at 8 bits.
"""

import torch
import triton
import triton.language as tl

from . import arch, interpreting, m_bucket, shared_b_operand, tuning
from .common import dot_acc, store_rounded, to_compute


@triton.jit
def int8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                        EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit: M x K passes 2^31 on long prompts
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        q = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0)
        w = to_compute(q.to(tl.float32) * scale[:, None], x.dtype, EMULATE)
        acc = dot_acc(acc, x, tl.trans(w), IEEE, EMULATE)
    store_rounded(y_ptr + rm[:, None] * N + rn[None, :], acc, (rm[:, None] < M) & (rn[None, :] < N), EMULATE)


def candidates(M: int, K: int, device: torch.device) -> list[dict]:
    """Launch settings to try, best first by the static report (make kernel-report); see nvfp4_linear.candidates."""
    block_k = 64 if K % 64 == 0 else 32
    if M <= 16:
        return [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)]
    if shared_b_operand(arch(device)):
        return [dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=block_k, num_warps=8),
                dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)]
    return [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4),
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4)]


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    scale = weight_scale.float().contiguous()

    def launch(cfg: dict) -> None:
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
        int8_linear_kernel[grid](x2, weight, scale, y, M, N, K, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"],
                                 x.dtype == torch.float32, interpreting(), num_warps=cfg["num_warps"])

    cfg = tuning.choose("int8_linear", (m_bucket(M), N, K, str(x.dtype)), candidates(M, K, x.device), launch,
                        x.device)
    launch(cfg)
    return y.reshape(*lead, N)
