"""y = x @ W^T with W a GGUF matrix held as its blocks (quant/ggml.py), read where they lie in the kernel's own tiles:
the dense linears of a GGUF model (attention, the dense MLP, self-conditioning), with no decoded copy of W made.

Shapes: x [M, K] float32 / bfloat16 / float16 (rows contiguous); weight uint8 [N, row bytes] (rows of blocks of type
`kind`, as the file lays them out); y [M, N] in x's dtype. A program takes BLOCK_M rows of x and BLOCK_N outputs and
walks K in BLOCK_K steps: each step's weight tile comes from ggml_tile.ggml_tile (the blocks' packed words decoded in
registers, in the tile's own order) and x's tile is loaded in that order (ggml_tile.tile_order), so the product is
x W^T's. Each weight is rounded to the compute dtype as the reference (decode, then the matmul) rounds it; the sums
are float32 (IEEE for float32 inputs).
"""

import torch
import triton
import triton.language as tl

from .. import ggml
from . import arch, interpreting, m_bucket, shared_b_operand, tuning
from .common import dot_acc, gelu_tanh, store_rounded, to_compute
from .ggml_decode import KINDS
from .ggml_tile import SUPER_BLOCK_KINDS, ggml_tile, tile_order


@triton.jit
def ggml_linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, KIND: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
                       GATED: tl.constexpr = False, wu_ptr=None, row_bytes_up=0, KIND_UP: tl.constexpr = 0):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit: M x K passes 2^31 on long prompts
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.where(rn < N, rn, 0).to(tl.int64)  # outputs past N read row 0 (their sums are not stored)
    order = tile_order(BLOCK_K, KIND)
    order_up = tile_order(BLOCK_K, KIND_UP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + order
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_t = to_compute(ggml_tile(w_ptr, rows, k0, K, row_bytes, KIND, BLOCK_N, BLOCK_K), x.dtype, EMULATE)
        acc = dot_acc(acc, x, w_t, IEEE, EMULATE)
        if GATED:  # the up projection's tile: its own type, its activations in its tile's order
            if KIND_UP != KIND:
                ru = k0 + order_up
                x = tl.load(x_ptr + rm[:, None] * K + ru[None, :], mask=(rm[:, None] < M) & (ru[None, :] < K),
                            other=0.0)
            u_t = to_compute(ggml_tile(wu_ptr, rows, k0, K, row_bytes_up, KIND_UP, BLOCK_N, BLOCK_K), x.dtype,
                             EMULATE)
            acc_u = dot_acc(acc_u, x, u_t, IEEE, EMULATE)
    out = y_ptr + rm[:, None] * N + rn[None, :]
    live = (rm[:, None] < M) & (rn[None, :] < N)
    if GATED:  # the reference rounds both products and the activation to the compute dtype
        dtype = y_ptr.dtype.element_ty
        gate = to_compute(acc, dtype, EMULATE).to(tl.float32)
        up = to_compute(acc_u, dtype, EMULATE).to(tl.float32)
        store_rounded(out, to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32) * up, live, EMULATE)
    else:
        store_rounded(out, acc, live, EMULATE)


def block_k(kind: str, K: int) -> int:
    """The K step for `kind`: half a super-block for the 256-weight types (ggml_tile's tiles are 128 or 256), else
    64 inputs (two blocks) where K is whole 64s, else one block."""
    if KINDS.index(kind) in SUPER_BLOCK_KINDS:
        return 128
    return 64 if K % 64 == 0 else 32


def candidates(M: int, K: int, kind: str, device: torch.device) -> list[dict]:
    """Launch settings to try, best first (int8_linear's tiles: the decode, not the product, sets the step)."""
    bk = block_k(kind, K)
    if M <= 16:
        return [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, num_warps=4)]
    if shared_b_operand(arch(device)):
        return [dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=bk, num_warps=8),
                dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, num_warps=4)]
    return [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=bk, num_warps=4),
            dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=bk, num_warps=4)]


def ggml_linear(x: torch.Tensor, weight: torch.Tensor, kind: str, in_features: int,
                up: tuple[torch.Tensor, str] | None = None) -> torch.Tensor:
    """x [..., K] @ W^T, W [N, K] held as `kind` blocks (weight uint8 [N, row bytes]) -> [..., N] in x's dtype.
    up: (its weight, its kind), the dense MLP's up projection of the same shape: then gelu_tanh(x W^T) * (x U^T)
    in one launch (GATED), rounded as the reference's three ops round."""
    N, K = weight.shape[0], in_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    weight = weight.contiguous()
    row_bytes = ggml.row_bytes(kind, K)
    w_up, kind_up = (up[0].contiguous(), up[1]) if up is not None else (weight, kind)
    # a super-block type's tiles are 128 or 256 inputs: the pair's K step suits both
    step_kind = kind if KINDS.index(kind) in SUPER_BLOCK_KINDS else kind_up

    def launch(cfg: dict) -> None:
        grid = (triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
        ggml_linear_kernel[grid](x2, weight, y, M, N, K, row_bytes, KINDS.index(kind), cfg["BLOCK_M"],
                                 cfg["BLOCK_N"], cfg["BLOCK_K"], x.dtype == torch.float32, interpreting(),
                                 up is not None, w_up, ggml.row_bytes(kind_up, K), KINDS.index(kind_up),
                                 num_warps=cfg["num_warps"])

    key = (m_bucket(M), N, K, kind, kind_up if up is not None else None, str(x.dtype))
    cfg = tuning.choose("ggml_linear", key, candidates(M, K, step_kind, x.device), launch, x.device)
    launch(cfg)
    return y.reshape(*lead, N)
