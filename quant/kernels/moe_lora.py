"""Adapters' LoRA terms on the routed experts, as the fused MoE kernels take them: y_e += (x A_e^T) B_e^T per
token-expert assignment, the rank product in one small launch (`moe_lora_shrink`), the rest in the MoE kernels'
epilogues (moe_gate_up.py, moe_down.py: t B_e^T added to the float32 accumulator before its rounding, so to gate
and up before the activation).

Operands: the adapters' factors on one projection [E, N, K], stacked along the rank (`LoRAFactors`: A [E, R, K],
B [E, N, R] with each adapter's scale folded in, R a power of two of at least 16, zero-padded) and each rank
column's adapter slot; each token's slot where the server's rows choose adapters (`ExpertAdapters.token_slots`).

`moe_lora_shrink_kernel`: a program takes one block of the MoE block plan (routing.py: BLOCK_M rows of one expert),
gathers its rows of x (the tokens' rows for gate-up, ids // TOPK; the plan's own rows of h for down), walks K in
BLOCK_K steps multiplying by expert e's [R, BLOCK_K] tile of A (float32 accumulation), zeroes the columns of other
adapters than each row's own (SLOTS), rounds to the compute dtype as the torch path rounds its first product, and
stores t [rows of the plan, R] at the block's rows. The epilogues read their block's t rows back (BLOCK_M x R, from
L2) and B_e's rows for their columns. The rank product is not recomputed by each column tile's program (as it
would be inside the MoE kernels' K loops, whose registers are spent already), and the MoE kernels' loops stay as
they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import interpreting
from .common import block_rows, dot_acc, lora_expand, pair_ordered, store_rounded


@dataclass(eq=False)
class LoRAFactors:
    """Adapters' low-rank terms on one expert projection [E, N, K], stacked along the rank (lora.ExpertLowRank
    makes them once): A [E, R, K] and B [E, N, R] (each adapter's scale folded in) in the compute dtype and K order,
    R a power of two of at least 16 (zero rows pad it); slot int32 [R], the adapter slot of each rank column (-1 on
    the padding)."""

    A: torch.Tensor
    B: torch.Tensor
    slot: torch.Tensor

    def a_in_pair_order(self) -> torch.Tensor:
        """A with each group of 8 inputs in the NVFP4 decode's pair order, as the NVFP4 kernels' activations come
        (common.pair_ordered): made at first use and kept with the factors."""
        if "_pair" not in self.__dict__:
            E, R, K = self.A.shape
            self._pair = pair_ordered(self.A.reshape(E * R, K)).reshape(E, R, K).contiguous()
        return self._pair

    def check(self, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
        E, N, K = shape
        R = self.A.shape[1]
        if (self.A.shape != (E, R, K) or self.B.shape != (E, N, R) or self.slot.shape != (R,) or R < 16
                or R & (R - 1) or self.A.dtype != dtype or self.B.dtype != dtype):
            raise ValueError(f"LoRA factors A {tuple(self.A.shape)}, B {tuple(self.B.shape)} do not fit experts "
                             f"{shape} in {dtype} (rank a power of two, at least 16)")


class ExpertAdapters(NamedTuple):
    """What the fused experts add for adapters: the gate-up and down projections' factors (None: that projection is
    not adapted) and each token's adapter slot (int32 [T]; None: every adapter on every token)."""

    gate_up: LoRAFactors | None
    down: LoRAFactors | None
    token_slots: torch.Tensor | None = None


@triton.jit
def moe_lora_shrink_kernel(x_ptr, ids_ptr, block_expert_ptr, a_ptr, lcol_ptr, tslot_ptr, t_ptr, K, E, TOPK,
                           GATHER: tl.constexpr, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_R: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    pid_b = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    tok = tl.where(live, ids // TOPK, 0)
    src = tok if GATHER else slots  # x's row of each plan row: the token's (gate-up), or its own (h, for down)
    rr = tl.arange(0, BLOCK_R)
    t = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_ptr + src[:, None].to(tl.int64) * K + rk[None, :], mask=live[:, None], other=0.0)
            a = tl.load(a_ptr + (e.to(tl.int64) * BLOCK_R + rr[:, None]) * K + rk[None, :])
        else:
            x = tl.load(x_ptr + src[:, None].to(tl.int64) * K + rk[None, :],
                        mask=live[:, None] & (rk[None, :] < K), other=0.0)
            a = tl.load(a_ptr + (e.to(tl.int64) * BLOCK_R + rr[:, None]) * K + rk[None, :], mask=rk[None, :] < K,
                        other=0.0)
        t = dot_acc(t, x, tl.trans(a), IEEE, EMULATE)
    if SLOTS:  # each row takes its own adapter's columns only (0: none)
        ts = tl.load(tslot_ptr + tok)
        cs = tl.load(lcol_ptr + rr)
        t = tl.where(ts[:, None] == cs[None, :], t, 0.0)
    store_rounded(t_ptr + slots[:, None].to(tl.int64) * BLOCK_R + rr[None, :], t, live[:, None], EMULATE)


@triton.jit
def lora_epilogue(acc, t_ptr, lb_ptr, slots, live, e, cols, NROWS, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                  EMULATE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (float32, the output's scale) + t B_e^T for output rows `cols` of expert e's B
    [NROWS, BLOCK_R]: t's rows are the block's plan rows (`moe_lora_shrink`)."""
    return lora_expand(acc, t_ptr, lb_ptr, slots, live, e.to(tl.int64) * NROWS + cols, cols < NROWS, BLOCK_R, IEEE,
                       EMULATE)


def moe_lora_shrink(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, factors: LoRAFactors,
                    token_slots: torch.Tensor | None, topk: int, block_m: int, gather: bool,
                    pair: bool) -> torch.Tensor:
    """-> t [len(sorted_ids), R] in x's dtype, each live plan row's x A_e^T (masked to its token's adapter), in the
    plan's row order (padding rows unwritten: the epilogues never read them). gather: x [T, K] holds tokens (the
    plan's ids // topk); else x [rows of the plan, K] holds the plan's rows. pair: x's inputs are in the NVFP4
    decode's pair order, and A's are then read in that order too."""
    E, R, K = factors.A.shape
    a = factors.a_in_pair_order() if pair else factors.A
    t = torch.empty(sorted_ids.numel(), R, dtype=x.dtype, device=x.device)
    block_k = 128 if K % 128 == 0 and block_m < 128 else 64 if K % 64 == 0 else 32  # the x tile's registers
    slots = token_slots is not None
    moe_lora_shrink_kernel[(block_expert.numel(),)](
        x, sorted_ids, block_expert, a, factors.slot, token_slots if slots else factors.slot, t, K, E, topk, gather,
        slots, block_m, block_k, R, K % block_k == 0, x.dtype == torch.float32, interpreting(), num_warps=4)
    return t
