"""LoRA adapters' terms on a linear projection, two ways:

1. `lora_add_`: the term added to a projection's output in one kernel, y += scale * mask * (x @ A^T) @ B^T, after
   a base matmul that takes no epilogue term (16-bit, INT8, W8A8: whatever computed y).
2. `lora_shrink`: the rank product t = x @ A^T alone, for a GEMM that adds t @ B^T in its epilogue (the NVFP4
   kernels, nvfp4_linear.py and nvfp4_w4a4.py): the adapters' factors stacked along the rank (`LinearFactors`,
   scales folded into B), each row's columns of other adapters zeroed (the server's slots), rounded to x's dtype.
   One CTA per BLOCK_M rows walks K in BLOCK_K steps: [BLOCK_M, BLOCK_K] x [BLOCK_K, R] tile products, float32
   accumulation.

The rest of this docstring is `lora_add_`'s.

Shapes: x [M, K] (rows contiguous), A [R, K], B [N, R] in x's dtype, y [M, N] contiguous in x's dtype, updated in
place; mask float32 [M] or none (the server's rows that chose this adapter: 1, the others 0). R at most 128.

One CTA owns BLOCK_M rows and a stretch of N_PER columns: it computes its rows' rank-R product t = x @ A^T once
(for k0 in range(0, K, BLOCK_K): a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_R] tile product, float32 accumulation),
scales it, rounds it to x's dtype as the torch path rounds its first matmul, then walks its columns (for n0 in its
stretch, step BLOCK_N: t times a [BLOCK_R, BLOCK_N] tile of B^T, added to y's tile in float32 and stored rounded).
The torch path is six ops over x, t and y (the factors cast, two matmuls, the scale, the add); here x is read once
per column stretch, y once, and t never leaves the CTA. Splitting N into stretches (SPLIT CTAs per row block) gives
the GPU enough CTAs at a canvas of 256 rows; each stretch recomputes its rows' t (R x K per row, small against the
N x R of its columns when the stretch is wide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import dot_acc, store_rounded, to_compute

MAX_RANK = 128


@triton.jit
def lora_kernel(x_ptr, a_ptr, b_ptr, y_ptr, mask_ptr, M, N, K, R, N_PER, scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                HAS_MASK: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        a = tl.load(a_ptr + rr[:, None] * K + rk[None, :], mask=(rr[:, None] < R) & (rk[None, :] < K), other=0.0)
        t = dot_acc(t, x, tl.trans(a), IEEE, EMULATE)
    t = t * scale
    if HAS_MASK:
        t = t * tl.load(mask_ptr + rm, mask=rm < M, other=0.0)[:, None]
    t = to_compute(t, x_ptr.dtype.element_ty, EMULATE)
    n_start = pid_s * N_PER
    n_end = tl.minimum(n_start + N_PER, N)
    for n0 in range(n_start, n_end, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        b = tl.load(b_ptr + rn[:, None] * R + rr[None, :], mask=(rn[:, None] < n_end) & (rr[None, :] < R),
                    other=0.0)
        acc = tl.load(y_ptr + rm[:, None] * N + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < n_end),
                      other=0.0).to(tl.float32)
        acc = dot_acc(acc, t, tl.trans(b), IEEE, EMULATE)
        store_rounded(y_ptr + rm[:, None] * N + rn[None, :], acc, (rm[:, None] < M) & (rn[None, :] < n_end),
                      EMULATE)


def settings(M: int, N: int, K: int, R: int) -> dict:
    """Launch settings: 32-row blocks (a canvas of 256 gives 8), the columns split so that there are at least ~64
    CTAs, whole BLOCK_N tiles per stretch."""
    block_m, block_n = (16 if M <= 16 else 32), 64
    rows = triton.cdiv(M, block_m)
    split = max(1, min(triton.cdiv(N, 4 * block_n), triton.cdiv(64, rows)))
    n_per = triton.cdiv(triton.cdiv(N, split), block_n) * block_n
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64 if K % 64 == 0 else 32,
                BLOCK_R=max(16, triton.next_power_of_2(R)), N_PER=n_per, SPLIT=triton.cdiv(N, n_per), num_warps=4)


def lora_add_(y: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] += scale * mask * (x [..., K] @ A^T) @ B^T, in place; returns y. A [R, K], B [N, R] in x's dtype;
    mask float32 with one value per row of x (or None)."""
    R, K = A.shape
    N = B.shape[0]
    if R > MAX_RANK or B.shape[1] != R or x.shape[-1] != K or y.shape[-1] != N or not y.is_contiguous():
        raise ValueError(f"lora_add_: x [..., {x.shape[-1]}], A {tuple(A.shape)}, B {tuple(B.shape)}, "
                         f"y [..., {y.shape[-1]}] (contiguous) do not fit (rank at most {MAX_RANK})")
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if M == 0:
        return y
    cfg = settings(M, N, K, R)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]), cfg["SPLIT"])
    m = mask.contiguous() if mask is not None else x2  # a stand-in pointer, never read without HAS_MASK
    lora_kernel[grid](x2, A.contiguous(), B.contiguous(), y, m, M, N, K, R, cfg["N_PER"], float(scale),
                      cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["BLOCK_R"], mask is not None,
                      x.dtype == torch.float32, interpreting(), num_warps=cfg["num_warps"])
    return y


@dataclass(eq=False)
class LinearFactors:
    """Adapters' terms on one linear [N, K], stacked along the rank (lora.LoRALinear makes them once): A [R, K] and
    B [N, R] (each adapter's scale folded in) in the compute dtype, R a power of two of at least 16 (zero rows pad
    it); slot int32 [R], the adapter slot of each rank column (-1 on the padding)."""

    A: torch.Tensor
    B: torch.Tensor
    slot: torch.Tensor


class LinearAdapters(NamedTuple):
    """What a linear kernel adds for adapters: the stacked factors and each batch row's adapter slot (int32 [B], x's
    rows being B x T; None: every adapter on every row)."""

    factors: LinearFactors
    row_slots: torch.Tensor | None = None


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, lcol_ptr, rs_ptr, t_ptr, M, K, T, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
                       EMULATE: tl.constexpr):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
            a = tl.load(a_ptr + rr[:, None] * K + rk[None, :])
        else:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            a = tl.load(a_ptr + rr[:, None] * K + rk[None, :], mask=rk[None, :] < K, other=0.0)
        t = dot_acc(t, x, tl.trans(a), IEEE, EMULATE)
    if SLOTS:  # each row takes its own adapter's columns only (0: none)
        ts = tl.load(rs_ptr + rm // T, mask=rm < M, other=-2)
        t = tl.where(ts[:, None] == tl.load(lcol_ptr + rr)[None, :], t, 0.0)
    store_rounded(t_ptr + rm[:, None] * BLOCK_R + rr[None, :], t, rm[:, None] < M, EMULATE)


def lora_shrink(x: torch.Tensor, adapters: LinearAdapters) -> torch.Tensor:
    """x [M, K] (rows contiguous) -> t [M, R] in x's dtype: each row's x A^T, masked to its batch row's adapter."""
    f = adapters.factors
    R, K = f.A.shape
    M = x.shape[0]
    if x.shape[1] != K or R < 16 or R & (R - 1) or f.A.dtype != x.dtype or f.B.dtype != x.dtype:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} {x.dtype}, A {tuple(f.A.shape)} {f.A.dtype} do not fit "
                         "(rank a power of two, at least 16)")
    t = torch.empty(M, R, dtype=x.dtype, device=x.device)
    rs = adapters.row_slots
    if rs is not None and M % rs.numel():
        raise ValueError(f"lora_shrink: {M} rows are not {rs.numel()} batch rows of equal length")
    block_k = 128 if K % 128 == 0 else 64 if K % 64 == 0 else 32
    block_m = 16 if M <= 256 else 32  # a canvas of 256 rows: 16 CTAs, each reading A (R x K) from L2
    lora_shrink_kernel[(triton.cdiv(M, block_m),)](
        x, f.A, f.slot, f.slot if rs is None else rs, t, M, K, max(1, M // (1 if rs is None else rs.numel())),
        rs is not None, block_m, block_k, R, K % block_k == 0, x.dtype == torch.float32, interpreting(),
        num_warps=4)
    return t
