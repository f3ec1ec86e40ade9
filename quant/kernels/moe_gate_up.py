"""Routed experts, first half: h = gelu_tanh(x W_gate^T) * (x W_up^T) per token-expert assignment, fused.

Operands (E experts, hidden H, expert width I, T tokens, top-k K):
- x            [T, H] compute dtype (float32 / bfloat16), rows contiguous;
- sorted_ids, block_expert: the block plan (routing.py): BLOCK_M rows of one expert per block, -1 rows padding;
- gate_up weights [E, 2I, H] in one format (FORMAT constexpr):
  NVFP4 (0): packed uint8 [E, 2I, H/2] (low nibble first), scales e4m3 bits [E, 2I, H/16], global scales float32
  [E, S] over S equal row segments (ModelOpt keeps gate and up apart: S = 2); INT8 (1): int8 [E, 2I, H] and
  float32 row scales [E, 2I] (the `s2_ptr` operand is unused);
  rows 0..I-1 are the gate, I..2I-1 the up projection;
- h            [max_blocks * BLOCK_M, I] compute dtype, in the plan's padded row order (padding rows untouched).
A program takes one block (one expert) and BLOCK_N columns of I, gathers its BLOCK_M token rows of x, and walks H
in BLOCK_K steps dequantizing its gate and up rows as one [2 * BLOCK_N, BLOCK_K] tile in registers (as the reference
rounds them: (code * scale) * scale_2 in float32, then the compute dtype) for one dot as wide as both; gate and up
accumulate in float32 and are rounded to the compute dtype
before the activation, as the reference's two matmuls are, then the product is rounded once more.
LORA (adapters, moe_lora.py): t [rows of the plan, R], the block's rows' x A_e^T made by moe_lora_shrink, and B
[E, 2I, R]; the epilogue adds t B_e^T to the gate and up accumulators before their rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import arch, interpreting, shared_b_operand
from .ggml_decode import KINDS, row_bytes_of
from .ggml_tile import SUPER_BLOCK_KINDS, ggml_tile, tile_order
from .common import (block_rows, dot_acc, gate_up_rows, gelu_tanh, global_segments, load_nvfp4_tile, nvfp4_operand,
                     pair_order, segment_scale, split_gate_up, store_rounded, to_compute)
from .common import pair_ordered  # noqa: F401  (re-exported for callers)
from .moe_lora import LoRAFactors, lora_epilogue
from .routing import moe_blocks  # noqa: F401  (re-exported for callers)


FORMATS = {"nvfp4": 0, "int8": 1, "gguf": 2}  # the kernels' FORMAT constexpr


@triton.jit
def weight_tile(w_ptr, s_ptr, e, rows, k0, H, NROWS, FORMAT: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_N: tl.constexpr, dtype: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr,
                KIND: tl.constexpr):
    """Expert e's rows `rows` at inputs k0..k0+BLOCK_K as the dot's operand [BLOCK_N, BLOCK_K] (rows of an
    [E, NROWS, H] stack). NVFP4: a * s * 2^-62 (bfloat16 / float32) or a * s (float16), common.nvfp4_operand, with
    the inputs of each group of 8 in the decode's own order (common.pair_order: the other operand comes in that
    order too); the global scale is left to the epilogue (half_factor). INT8: q * row scale rounded to the compute
    dtype, as the reference dequantizes, in K order. GGUF (2): the file's blocks read where they lie
    (ggml_tile.ggml_tile; KIND: the block type) and rounded to the compute dtype, in the tile's own order (the
    activations are loaded in it: `input_order`). EVEN: whole tiles (rows < NROWS, inputs < H): no masks."""
    base = e.to(tl.int64) * NROWS + rows
    if FORMAT == 0:
        w, _ = nvfp4_operand(load_nvfp4_tile(w_ptr, s_ptr, base, k0, H, (e.to(tl.int64) + 1) * NROWS, BLOCK_N,
                                             BLOCK_K, False, not EVEN, EMULATE), dtype)
        return w
    elif FORMAT == 1:
        rk = k0 + tl.arange(0, BLOCK_K)
        m = (rows[:, None] < NROWS) & (rk[None, :] < H)
        q = tl.load(w_ptr + base[:, None] * H + rk[None, :], mask=m, other=0).to(tl.float32)
        scale = tl.load(s_ptr + base, mask=rows < NROWS, other=0.0)
        return to_compute(q * scale[:, None], dtype, EMULATE)
    else:
        safe = tl.where(rows < NROWS, base, e.to(tl.int64) * NROWS)  # rows past the stack read its first row
        # ggml_tile gives the dot's operand [BLOCK_K, BLOCK_N]; the callers transpose this one back (the two cancel)
        w = tl.trans(ggml_tile(w_ptr, safe, k0, H, row_bytes_of(H, KIND), KIND, BLOCK_N, BLOCK_K))
        if not EVEN:
            w = tl.where((rows < NROWS)[:, None], w, 0.0)
        return to_compute(w, dtype, EMULATE)


@triton.jit
def input_order(FORMAT: tl.constexpr, KIND: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_K]: the input (offset from k0) each column of `weight_tile` holds: K order, or a GGUF tile's own
    (ggml_tile.tile_order), in which the kernels load their activations."""
    if FORMAT == 2:
        return tile_order(BLOCK_K, KIND)
    else:
        return tl.arange(0, BLOCK_K)


@triton.jit
def half_factor(s2_ptr, e, UP: tl.constexpr, NSEG: tl.constexpr, FORMAT: tl.constexpr, dtype: tl.constexpr):
    """The float32 factor the accumulator of expert e's gate rows (UP False) or up rows needs: NVFP4 2^62 (or 1,
    common.nvfp4_operand) * their global scale (common.segment_scale; NSEG 1 for the down projection); INT8 1 (its
    scale is in the operand)."""
    if FORMAT == 0:
        _, unshift = nvfp4_operand(tl.zeros((1, 1), dtype=tl.bfloat16), dtype)
        return segment_scale(s2_ptr, e, UP, NSEG) * unshift
    else:
        return 1.0


@triton.jit
def moe_gate_up_kernel(x_ptr, ids_ptr, block_expert_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, t_ptr, lb_ptr, H, I, E, TOPK,
                       NSEG: tl.constexpr, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr,
                       LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, KIND: tl.constexpr = 0):
    pid_n = tl.program_id(0)  # fastest: the programs of one block share its gathered x rows (L2)
    pid_b = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= E:
        return
    slots, ids, live = block_rows(ids_ptr, pid_b, BLOCK_M)
    tok = tl.where(live, ids // TOPK, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of I
    # gate rows cols and up rows I + cols as one tile of 2 * BLOCK_N rows: one dot per K step, as wide as both
    # (half the tensor-core instructions, descriptors and loop bookkeeping of two BLOCK_N-wide dots)
    rows = gate_up_rows(pid_n, I, BLOCK_N)
    dtype = h_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    order = input_order(FORMAT, KIND, BLOCK_K)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + order
        if EVEN:
            x = tl.load(x_ptr + tok[:, None].to(tl.int64) * H + rk[None, :], mask=live[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + tok[:, None].to(tl.int64) * H + rk[None, :],
                        mask=live[:, None] & (rk[None, :] < H), other=0.0)
        w = weight_tile(w_ptr, s_ptr, e, rows, k0, H, 2 * I, FORMAT, BLOCK_K, 2 * BLOCK_N, dtype, EVEN, EMULATE,
                        KIND)
        acc = dot_acc(acc, x, tl.trans(w), IEEE, EMULATE)
    acc_g, acc_u = split_gate_up(acc, BLOCK_M, BLOCK_N)
    acc_g = acc_g * half_factor(s2_ptr, e, False, NSEG, FORMAT, dtype)
    acc_u = acc_u * half_factor(s2_ptr, e, True, NSEG, FORMAT, dtype)
    if LORA:  # the adapters' t B_e^T (moe_lora.py) for the gate rows and the up rows, before the activation
        acc_g = lora_epilogue(acc_g, t_ptr, lb_ptr, slots, live, e, cols, 2 * I, BLOCK_R, IEEE, EMULATE)
        acc_u = lora_epilogue(acc_u, t_ptr, lb_ptr, slots, live, e, I + cols, 2 * I, BLOCK_R, IEEE, EMULATE)
    # the reference rounds both matmul outputs and the activation to the compute dtype
    gate = to_compute(acc_g, dtype, EMULATE).to(tl.float32)
    up = to_compute(acc_u, dtype, EMULATE).to(tl.float32)
    act = to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32)
    at = pair_order(cols) if FORMAT == 0 else cols  # h is the down kernel's input: in its weights' order
    store_rounded(h_ptr + slots[:, None].to(tl.int64) * I + at[None, :], act * up,
                  live[:, None] & (cols[None, :] < I), EMULATE)


def candidates(rows_per_expert: float, H: int, I: int, device: torch.device) -> list[dict]:
    """Launch settings for both MoE kernels, best first by the static report (make kernel-report). BLOCK_M is chosen
    from the rows routed to an expert (T * K / E on average) so that one block covers an expert and its weights are
    decoded once per step: 64 or 128 where the tensor cores read the weights from shared memory (sm_90, sm_100:
    `shared_b_operand`), elsewhere (mma.sync: Ampere, Ada, RTX 50) 16 or 32, where more rows per program cost
    register moves and spills, not decode. Keys: BLOCK_M, then each kernel's tile and warps (GU_* gate-up,
    DN_* down)."""
    def cfg(block_m: int, gu: tuple[int, int, int], dn: tuple[int, int, int]) -> dict:
        gu_n, gu_k, gu_w = gu
        dn_n, dn_k, dn_w = dn
        while I % gu_n and gu_n > 16:  # whole tiles where the shapes allow (the kernels mask the rest)
            gu_n //= 2
        while H % gu_k and gu_k > 16:
            gu_k //= 2
        while I % dn_k and dn_k > 16:
            dn_k //= 2
        return dict(BLOCK_M=block_m, GU_N=gu_n, GU_K=gu_k, GU_W=gu_w, DN_N=dn_n, DN_K=dn_k, DN_W=dn_w)

    cc = arch(device)
    if shared_b_operand(cc):
        # the down projection 256 columns wide with 8 warps: each step loads its rows of h once for twice the
        # columns (sm_90, NVFP4: 4.7 -> 4.5 instructions a weight; the H200's down at batch 1 43.2 -> 40.5 us)
        small = cfg(64, (64, 128, 4), (256, 64, 8))
        large = cfg(128, (64, 128, 8), (128 if cc < 100 else 64, 64, 4))  # 128 x 128 spills on sm_100
        return [small, large] if rows_per_expert <= 96 else [large, small]
    small = cfg(16, (64, 128, 4), (128, 64, 4))
    large = cfg(32, (64, 128, 4), (128, 64, 4))
    return [small, large] if rows_per_expert <= 10 else [large, small]


def gguf_block_k(block_k: int, kind: str) -> int:
    """A MoE kernel's BLOCK_K for a GGUF stack of `kind`: a super-block type's tiles are 128 or 256 inputs
    (ggml_tile.py)."""
    return min(max(block_k, 128), 256) if KINDS.index(kind) in SUPER_BLOCK_KINDS else block_k


def moe_gate_up(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, fmt: str,
                weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | None, topk: int,
                cfg: dict, lora: LoRAFactors | None = None, token_slots: torch.Tensor | None = None,
                kind: str | None = None) -> torch.Tensor:
    """-> h [len(sorted_ids), I] (see the module docstring); cfg from `candidates`. NVFP4: x's inputs and h's
    columns are in the decode's pair order (common.pair_order; `pair_ordered` gives x that order). lora: adapters'
    low-rank terms added to gate and up before the activation; token_slots int32 [T]: each token's adapter slot
    (None: every adapter on every token). fmt "gguf": weight is the file's blocks [E, 2I, row bytes] of block type
    `kind` (ggml_decode.KINDS), scale and scale_2 None."""
    T, H = x.shape
    E, two_i = weight.shape[0], weight.shape[1]
    I = two_i // 2
    # rows of the plan's padding are never written nor read (moe_down loads live rows only): no fill
    h = torch.empty(sorted_ids.numel(), I, dtype=x.dtype, device=x.device)
    nvfp4 = fmt == "nvfp4"
    if nvfp4:
        segments = global_segments(scale_2)
        weight, scale, s2 = weight.contiguous().view(torch.int32), scale.view(torch.uint8), scale_2.float().contiguous()
    else:
        scale = weight if scale is None else scale  # GGUF: the scales are in the blocks
        s2, segments = scale, 1  # unused
    if fmt == "gguf":
        cfg = dict(cfg, GU_K=gguf_block_k(cfg["GU_K"], kind))
    grid = (triton.cdiv(I, cfg["GU_N"]), block_expert.numel())
    x = x.contiguous()
    t, lb, rank = lora_operands(lora, x, sorted_ids, block_expert, token_slots, topk, cfg["BLOCK_M"], True, nvfp4,
                                (E, two_i, H))
    moe_gate_up_kernel[grid](x, sorted_ids, block_expert, weight.contiguous(), scale, s2, h, t, lb, H, I, E, topk,
                             segments, FORMATS[fmt], cfg["BLOCK_M"], cfg["GU_N"], cfg["GU_K"],
                             I % cfg["GU_N"] == 0 and H % cfg["GU_K"] == 0, x.dtype == torch.float32, interpreting(),
                             lora is not None, rank, KINDS.index(kind) if kind else 0, num_warps=cfg["GU_W"])
    return h


def lora_operands(lora: LoRAFactors | None, x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                  token_slots: torch.Tensor | None, topk: int, block_m: int, gather: bool, pair: bool,
                  shape: tuple[int, int, int]) -> tuple:
    """The MoE kernels' LoRA operands (t, B, BLOCK_R): the rank product made now (moe_lora.moe_lora_shrink), or x
    standing in for both (never read) without adapters."""
    if lora is None:
        return x, x, 16
    lora.check(shape, x.dtype)
    from .moe_lora import moe_lora_shrink

    t = moe_lora_shrink(x, sorted_ids, block_expert, lora, token_slots, topk, block_m, gather, pair)
    return t, lora.B, lora.A.shape[1]
