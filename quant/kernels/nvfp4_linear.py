"""y = x @ W^T with W in NVFP4, decoded in registers (never materialised in memory).

Shapes and packing (ModelOpt's layout, see quant/nvfp4.py):
- x            [M, K] float32 / bfloat16 / float16, rows contiguous;
- weight       uint8 [N, K/2] (element 2i of a row in the low nibble of byte i), read as int32 words [N, K/8];
- weight_scale float8_e4m3fn [N, K/16], read as its bits;
- row_scale_2  float32 [N]: each row's global scale (weight_scale_2 expanded);
- y            [M, N] in x's dtype.
K must be a multiple of 16; M and N are arbitrary (masked). A program computes a BLOCK_M x BLOCK_N tile and walks K
in BLOCK_K steps; each step decodes its [BLOCK_N, BLOCK_K] weight tile bit-parallel (common.nvfp4_tile: a few
integer operations and one bfloat16 multiply per pair of weights) into exact a * scale products and multiplies on
the tensor cores with float32 accumulation; the epilogue applies 2^62 * scale_2 per output column and rounds once.
A weight tile is decoded once per BLOCK_M rows, so BLOCK_M covers as many rows as the registers allow (the launch
table below), and the grid is ordered so programs sharing a weight tile run together (the second read hits L2).
LORA (adapters): t [M, R] (lora.lora_shrink: the rows' x A^T, masked and rounded) and B [N, R]; the epilogue adds
t B^T to the float32 result before its rounding (and, GATED, each half's before the activation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import arch, fewest_waves, interpreting, m_bucket, shared_b_operand, sm_count, tile_counters, tuning
from .common import (dot_acc, gelu_tanh, load_nvfp4_tile, lora_expand, nvfp4_operand, segment_of, store_rounded,
                     to_compute)
from .lora import LinearAdapters, lora_shrink


@triton.jit
def nvfp4_linear_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, wu_ptr, su_ptr, s2u_ptr, t_ptr, lb_ptr, tu_ptr, lbu_ptr,
                        M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr, GATED: tl.constexpr,
                        LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16,
                        w1_ptr=None, s1_ptr=None, s21_ptr=None, y1_ptr=None, N1=0,
                        w2_ptr=None, s2b_ptr=None, s22_ptr=None, y2_ptr=None, N2=0, SEGMENTS: tl.constexpr = 1,
                        part_ptr=None, count_ptr=None, KS=0, SPLITS: tl.constexpr = 1):
    pid_n = tl.program_id(0)  # fastest: consecutive programs share the x rows... and M blocks of one N tile follow
    pid_m = tl.program_id(1)
    if SEGMENTS > 1:  # the column tiles of 2 or 3 linears of the same x, one after another: this tile's linear
        w_ptr, s_ptr, s2_ptr, y_ptr, N, pid_n = segment_of(
            pid_n, BLOCK_N, w_ptr, s_ptr, s2_ptr, y_ptr, N, w1_ptr, s1_ptr, s21_ptr, y1_ptr, N1,
            w2_ptr, s2b_ptr, s22_ptr, y2_ptr, N2, SEGMENTS)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # 64-bit: M x K passes 2^31 on long prompts
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED: the up projection's (unused otherwise)
    if SPLITS > 1:  # this program's inputs: [part * KS, (part + 1) * KS) of K, whole BLOCK_K steps
        part = tl.program_id(2)
        k_lo = part * KS
        k_hi = tl.minimum(K, k_lo + KS)
    else:
        k_lo = 0
        k_hi = K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN:  # whole tiles in N and K: only the rows are masked
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        else:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)
        w, _ = nvfp4_operand(load_nvfp4_tile(w_ptr, s_ptr, rn, k0, K, N, BLOCK_N, BLOCK_K, True, not EVEN,
                                             EMULATE), x.dtype)
        acc = dot_acc(acc, x, tl.trans(w), IEEE, EMULATE)
        if GATED:
            wu, _ = nvfp4_operand(load_nvfp4_tile(wu_ptr, su_ptr, rn, k0, K, N, BLOCK_N, BLOCK_K, True, not EVEN,
                                                  EMULATE), x.dtype)
            acc_u = dot_acc(acc_u, x, tl.trans(wu), IEEE, EMULATE)
    if SPLITS == 1:
        _finish(acc, acc_u, y_ptr, s2_ptr, s2u_ptr, t_ptr, lb_ptr, tu_ptr, lbu_ptr, rm, rn, M, N, GATED, LORA, BLOCK_R,
                IEEE, EMULATE)
    else:
        # K split over SPLITS programs (a grid of fewer tiles than the GPU has SMs): each writes its float32 partial
        # sums, and the last of the tile's programs to finish (the counter it increments) adds them and finishes the
        # tile; it then sets the counter back to 0 for the next launch. Not with GATED or SEGMENTS (the wrapper
        # never asks)
        tile = pid_m * tl.num_programs(0) + pid_n
        # [tiles, SPLITS, BLOCK_M, BLOCK_N]: each tile's partial sums whole and contiguous (no masks, 32-bit offsets)
        at = part_ptr + tile.to(tl.int64) * (SPLITS * BLOCK_M * BLOCK_N) \
            + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(at + part * (BLOCK_M * BLOCK_N), acc)
        tl.debug_barrier()  # every thread's sums stored before the counter says so (its release is the CTA's)
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            # every part's sums from L2 (other SMs wrote them; its own too: the sums then keep the stored tiles'
            # layout), added in the programs' order whichever finished last
            total = tl.load(at, cache_modifier=".cg")
            for q in tl.static_range(1, SPLITS):
                total += tl.load(at + q * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
            _finish(total, acc_u, y_ptr, s2_ptr, s2u_ptr, t_ptr, lb_ptr, tu_ptr, lbu_ptr, rm, rn, M, N, GATED, LORA,
                    BLOCK_R, IEEE, EMULATE)


@triton.jit
def _finish(acc, acc_u, y_ptr, s2_ptr, s2u_ptr, t_ptr, lb_ptr, tu_ptr, lbu_ptr, rm, rn, M, N, GATED: tl.constexpr,
            LORA: tl.constexpr, BLOCK_R: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr):
    """The tile's epilogue from its float32 sums (acc, and acc_u GATED): 2^62 * scale_2 per column, the adapters'
    terms, the activation, one rounding into y."""
    dtype = y_ptr.dtype.element_ty
    _, unshift = nvfp4_operand(tl.zeros((1, 1), dtype=tl.bfloat16), dtype)
    s2 = tl.load(s2_ptr + rn, mask=rn < N, other=0.0) * unshift
    y = acc * s2[None, :]
    if LORA:  # adapters: their rank product t (lora.lora_shrink's) times B's rows for the tile's columns
        y = lora_expand(y, t_ptr, lb_ptr, rm, rm < M, rn, rn < N, BLOCK_R, IEEE, EMULATE)
    if GATED:  # gelu_tanh(gate) * up, each matmul output and the activation rounded as the torch path rounds them
        s2u = tl.load(s2u_ptr + rn, mask=rn < N, other=0.0) * unshift
        gate = to_compute(y, dtype, EMULATE).to(tl.float32)
        up = acc_u * s2u[None, :]
        if LORA:
            up = lora_expand(up, tu_ptr, lbu_ptr, rm, rm < M, rn, rn < N, BLOCK_R, IEEE, EMULATE)
        up = to_compute(up, dtype, EMULATE).to(tl.float32)
        y = to_compute(gelu_tanh(gate), dtype, EMULATE).to(tl.float32) * up
    store_rounded(y_ptr + rm[:, None] * N + rn[None, :], y, (rm[:, None] < M) & (rn[None, :] < N), EMULATE)


def candidates(M: int, K: int, device: torch.device, gated: bool = False) -> list[dict]:
    """Launch settings to try for an [M, K] input, best first by the static report (make kernel-report).

    Hopper and datacenter Blackwell (wgmma / tcgen05, `shared_b_operand`: the decoded tile goes to shared memory
    once, so the issue cost per weight hardly grows with BLOCK_M): as many rows per program as fit, so each weight is
    decoded once or twice per step. Ampere, Ada and RTX 50 (mma.sync: each warp takes its slice of the decoded tile
    in registers): 64 rows, 4 warps (more rows only add register moves and spills). A handful of rows: 16."""
    block_k = 128 if K % 128 == 0 else 64 if K % 64 == 0 else 32 if K % 32 == 0 else 16
    if gated:  # two weight tiles and two accumulators a step: half the columns a program
        return [dict(c, BLOCK_N=c["BLOCK_N"] // 2) for c in candidates(M, K, device)]
    if M <= 16:
        return [dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)]
    if shared_b_operand(arch(device)):
        return [dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=block_k, num_warps=8),
                dict(BLOCK_M=256, BLOCK_N=64, BLOCK_K=block_k, num_warps=8),
                dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)]
    return [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k, num_warps=4),
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=min(block_k, 64), num_warps=4),
            dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, num_warps=4)]


def split_choices(cands: list[dict], M: int, N: int, K: int, device: torch.device,
                  splits: int | None = None) -> list[dict]:
    """The candidates with how many programs share a tile's K (SPLITS). `splits` given: that, for each. Otherwise,
    where a candidate's tiles are fewer than the GPU's SMs (o_proj and the dense MLP's down on a canvas: 88 tiles for
    132 SMs on an H100 / H200), first the split with the fewest waves per unit of work (`fewest_waves`: 3 ways
    there, 264 programs in two full waves of a third of the work each), then the candidate unsplit, so the tuner
    on the GPU keeps whichever runs faster; elsewhere unsplit. The split costs the partial sums' float32 traffic
    (written by every program, read by the last: L2-resident at these sizes, counted as DRAM by the static report)."""
    out, sms = [], sm_count(device)
    for c in cands:
        steps = triton.cdiv(K, c["BLOCK_K"])
        if splits is not None:
            out.append(dict(c, SPLITS=min(splits, steps)))
            continue
        tiles = triton.cdiv(N, c["BLOCK_N"]) * triton.cdiv(M, c["BLOCK_M"])
        S = fewest_waves(device, tiles, [s for s in (1, 2, 3, 4) if s <= steps]) if sms and tiles < sms else 1
        out += [dict(c, SPLITS=S)] if S > 1 else []
        out.append(dict(c, SPLITS=1))
    return out


def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 row_scale_2: torch.Tensor, up: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 lora: LinearAdapters | None = None, lora_up: LinearAdapters | None = None,
                 more: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
                 splits: int | None = None) -> torch.Tensor | list:
    """x [..., K] -> [..., N] (see the module docstring for the operands). With `up` (the weight, scales and row
    scales of a second NVFP4 matrix of the same shape): gelu_tanh(x W^T) * (x W_up^T), the gated MLP's first half in
    one kernel. lora (and lora_up with `up`, of the same stacked rank): adapters' terms, their rank products made
    first (lora.lora_shrink), their expansions added in the epilogue (before the activation). more: one or two
    further linears of x (weight, scales, row scales; q, k and v), multiplied in the same launch, their column
    tiles after this one's: the list of the outputs, [..., N_i] each (no up or adapters with them). splits: how many
    programs share each tile's K (whole BLOCK_K steps each; the last to finish adds their float32 sums), for one
    linear without `up` or `more`; None: `split_choices`' first (the fewest waves where the tiles leave SMs idle)."""
    N, half = weight.shape
    K = 2 * half
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    words, scale_bits, s2 = weight.contiguous().view(torch.int32), weight_scale.view(torch.uint8), \
        row_scale_2.float().contiguous()
    if up is not None:
        if up[0].shape != weight.shape:
            raise ValueError(f"gate {tuple(weight.shape)} and up {tuple(up[0].shape)} weights differ in shape")
        words_u, scale_bits_u, s2u = up[0].contiguous().view(torch.int32), up[1].view(torch.uint8), \
            up[2].float().contiguous()
    else:
        words_u, scale_bits_u, s2u = words, scale_bits, s2  # stand-ins, never read
    if len(more) > 2 or more and (up is not None or lora is not None or any(m[0].shape[1] != half for m in more)):
        raise ValueError("nvfp4_linear: up to two more linears of the same input width, without up or adapters")
    segs = [(m[0].contiguous().view(torch.int32), m[1].view(torch.uint8), m[2].float().contiguous(),
             torch.empty(M, m[0].shape[0], dtype=x.dtype, device=x.device), m[0].shape[0]) for m in more]
    stand_in = (words, scale_bits, s2, y, 0)  # never read
    seg_args = [a for seg in (segs + [stand_in] * 2)[:2] for a in seg]
    t = lb = tu = lbu = x2  # stand-ins, never read without adapters
    rank = 16
    if lora is not None:
        if (up is not None) != (lora_up is not None) or lora.factors.B.shape[0] != N or lora_up is not None and (
                lora_up.factors.A.shape != lora.factors.A.shape or lora_up.factors.B.shape[0] != N):
            raise ValueError("nvfp4_linear: the adapters' factors do not fit the linear (gated: both halves, one rank)")
        t, lb, rank = lora_shrink(x2, lora), lora.factors.B.contiguous(), lora.factors.A.shape[0]
        if lora_up is not None:
            tu, lbu = lora_shrink(x2, lora_up), lora_up.factors.B.contiguous()
    widths = [N] + [seg[4] for seg in segs]

    splittable = up is None and not more
    if splits is not None and (splits < 1 or splits > 1 and not splittable):
        raise ValueError(f"nvfp4_linear splits K 1 or more ways, and only for one linear without up (got {splits})")

    def launch(cfg: dict) -> None:
        bn, S = cfg["BLOCK_N"], cfg.get("SPLITS", 1)
        grid = (sum(triton.cdiv(n, bn) for n in widths), triton.cdiv(M, cfg["BLOCK_M"]))
        split_args = {}
        if S > 1:
            steps = triton.cdiv(K, cfg["BLOCK_K"])
            split_args = dict(part_ptr=torch.empty(grid[0] * grid[1], S, cfg["BLOCK_M"], bn, dtype=torch.float32,
                                                   device=x.device),
                              count_ptr=tile_counters("nvfp4_linear", x.device, grid[0] * grid[1]),
                              KS=triton.cdiv(steps, S) * cfg["BLOCK_K"], SPLITS=S)
            grid = grid + (S,)
        nvfp4_linear_kernel[grid](x2, words, scale_bits, s2, y, words_u, scale_bits_u, s2u, t, lb, tu, lbu, M, N, K,
                                  cfg["BLOCK_M"], bn, cfg["BLOCK_K"],
                                  all(n % bn == 0 for n in widths) and K % cfg["BLOCK_K"] == 0,
                                  x.dtype == torch.float32, interpreting(), up is not None, lora is not None, rank,
                                  *seg_args, SEGMENTS=len(widths), **split_args, num_warps=cfg["num_warps"])

    key = (m_bucket(M), sum(widths), K, str(x.dtype)) + (("gated",) if up is not None else ()) + (
        ("lora", rank) if lora is not None else ())
    cands = candidates(M, K, x.device, up is not None)
    if splittable:
        cands = split_choices(cands, M, N, K, x.device, splits)
        key = key + (("splits", splits) if splits is not None else ())
    cfg = tuning.choose("nvfp4_linear", key, cands, launch, x.device)
    launch(cfg)
    if more:
        return [out.reshape(*lead, out.shape[-1]) for out in [y] + [seg[3] for seg in segs]]
    return y.reshape(*lead, N)
