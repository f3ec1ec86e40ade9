"""Floors for dgemma's kernels on six NVIDIA GPUs, from compiled code: what a call cannot beat, three ways.

- DRAM-bound: the call's minimal bytes (each weight and scale byte once, activations read once, outputs written
  once) at the GPU's peak bandwidth. The kernels' own extra traffic (a float32 intermediate, a padded buffer, a
  second sweep) is not in it: it is estimated apart (`traffic`) and shown next to it.
- tensor-bound: the useful FLOPs (2 x rows x N x K over the real, routed rows, not padded ones) at the GPU's dense
  bf16/fp16 peak with float32 accumulation (its FP4 peak for a kernel that multiplies FP4 x FP4).
- issue-bound: the instructions the SASS loops issue, warp-instructions per iteration x iterations x warps x CTAs,
  over every SM issuing 4 warp-instructions per clock at the boost clock. It leaves out the code around the loops,
  stalls and tails, so it too is a floor.
A kernel is at its floor by construction when issue <= max(DRAM, tensor): its instruction stream keeps up with the
memory or the tensor cores. `issue / max(DRAM, tensor)` above 1 says the kernel is bound by its own instructions.

The issue-bound needs the loops' trip counts: `KERNELS` declares them per kernel, read from a launch's arguments
by parameter name. The SASS must show exactly the declared top-level loops (spin-waits aside) with no loop nested
in them, or `LoopMismatch` is raised: a changed kernel is never silently mis-estimated; update its entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    clock_ghz: float  # boost clock
    dram_tbs: float  # peak DRAM bandwidth, TB/s
    tensor_tflops: float  # dense bf16/fp16 tensor-core peak with float32 accumulation
    smem_per_block: int  # bytes: the most shared memory one block may opt into
    fp4_tflops: float | None = None  # dense block-scaled FP4 peak, where the tensor cores have it


# Target (compute capability) -> the GPU it is reported for. SMs, clocks, bandwidth and tensor peaks are NVIDIA's
# published figures (dense, without sparsity); the per-block shared memory is the CUDA C++ Programming Guide's
# "maximum amount of shared memory per thread block" for the compute capability.
GPUS = {
    # A100 SXM4 80 GB: NVIDIA A100 datasheet (2,039 GB/s, 312 TFLOPS bf16) and A100 architecture whitepaper
    # (108 SMs, 1,410 MHz boost); cc 8.0: 163 KB per block.
    80: GPU("A100", 108, 1.41, 2.039, 312, 163 * 1024),
    # GeForce RTX 3090: GA102 whitepaper appendix (82 SMs, 1,695 MHz boost, 936 GB/s, 71 TFLOPS fp16/bf16 tensor
    # with fp32 accumulate); cc 8.6: 99 KB per block.
    86: GPU("RTX 3090", 82, 1.695, 0.936, 71, 99 * 1024),
    # GeForce RTX 4090: Ada Lovelace (AD102) whitepaper appendix (128 SMs, 2,520 MHz boost, 1,008 GB/s,
    # 165.2 TFLOPS fp16/bf16 tensor with fp32 accumulate); cc 8.9: 99 KB per block.
    89: GPU("RTX 4090", 128, 2.52, 1.008, 165.2, 99 * 1024),
    # H200 SXM: H200 datasheet (4.8 TB/s, 1,979 TFLOPS bf16 with sparsity, so 989 dense); 132 SMs and 1,980 MHz
    # boost as the H100 SXM (Hopper architecture whitepaper); cc 9.0: 227 KB per block.
    90: GPU("H200", 132, 1.98, 4.8, 989, 227 * 1024),
    # B200: HGX B200 datasheet (8 TB/s; per GPU with sparsity 4.5 PFLOPS bf16 and 18 PFLOPS FP4, so 2,250 and
    # 9,000 dense); 148 SMs and about 1,965 MHz boost from public spec listings (not in the datasheet); cc 10.0:
    # 227 KB per block.
    100: GPU("B200", 148, 1.965, 8.0, 2250, 227 * 1024, fp4_tflops=9000),
    # GeForce RTX 5090: Blackwell RTX (GB202) whitepaper appendix (170 SMs, 2,407 MHz boost, 1,792 GB/s,
    # 209.5 TFLOPS fp16/bf16 tensor with fp32 accumulate, 3,352 FP4 AI TOPS with sparsity, so 1,676 dense);
    # cc 12.0: 99 KB per block.
    120: GPU("RTX 5090", 170, 2.407, 1.792, 209.5, 99 * 1024, fp4_tflops=1676),
}
# The cards of the placement tables (dgemma_cli/placement: cards smaller than the model), each costed with the kernels
# compiled for its compute capability. SMs, boost clock, memory bandwidth and L2 from NVIDIA's product pages (and the
# Ampere GA10x / Ada whitepaper appendices where they list the card); the tensor peaks are the architecture's per-SM
# rate with fp32 accumulation, as the whitepapers give it for the RTX 3090 / 4090 / 5090 above (about 512 dense
# bf16 FLOP per SM per clock on GA10x, AD10x and GB20x; FP4 8x that on GB20x), times SMs x boost clock. The PCIe
# links are in dgemma_cli/placement/cards.py.
CARD_GPUS = {
    # GA106, 28 SMs, 1,777 MHz boost, 360 GB/s, 3 MB L2
    "RTX 3060 12GB": (86, GPU("RTX 3060 12GB", 28, 1.777, 0.360, 25.4, 99 * 1024)),
    # GA102: the RTX 3090 above (6 MB L2)
    "RTX 3090": (86, GPUS[86]),
    # AD107, 24 SMs, 2,460 MHz boost, 272 GB/s, 24 MB L2
    "RTX 4060": (89, GPU("RTX 4060", 24, 2.46, 0.272, 30.2, 99 * 1024)),
    # AD106, 34 SMs, 2,535 MHz boost, 288 GB/s, 32 MB L2
    "RTX 4060 Ti 16GB": (89, GPU("RTX 4060 Ti 16GB", 34, 2.535, 0.288, 44.1, 99 * 1024)),
    # AD103, 76 SMs, 2,505 MHz boost, 716.8 GB/s, 64 MB L2; 97.5 TFLOPS in the Ada whitepaper appendix
    "RTX 4080": (89, GPU("RTX 4080", 76, 2.505, 0.7168, 97.5, 99 * 1024)),
    # GB203, 84 SMs, 2,617 MHz boost, 960 GB/s, 64 MB L2; 1,801 FP4 AI TOPS with sparsity, so about 900 dense
    "RTX 5080": (120, GPU("RTX 5080", 84, 2.617, 0.960, 112.6, 99 * 1024, fp4_tflops=900)),
    "RTX 4090": (89, GPUS[89]),  # above (72 MB L2)
    "RTX 5090": (120, GPUS[120]),  # above (96 MB L2)
}
# GPUs the whole-step table also costs, each with the code compiled for a target above (the same compute capability):
# H100 SXM5 80 GB: H100 datasheet (3.35 TB/s, 1,979 TFLOPS bf16 with sparsity, so 989 dense); 132 SMs and 1,980 MHz
# boost (Hopper architecture whitepaper); cc 9.0: 227 KB per block. The design card's GPU, where the peer's figures
# stand.
STEP_ALSO = {90: (GPU("H100 SXM", 132, 1.98, 3.35, 989, 227 * 1024),)}
FP4_OPS = {"OMMA", "UTCOMMA"}  # block-scaled FP4 tensor-core instructions (sm_120, sm_100)
ISSUE_PER_CLOCK = 4  # warp-instructions per SM per clock: four schedulers, one each
# Microseconds a kernel launched on its own (outside the step's CUDA graph) adds to a step: the gap a stream leaves
# between two dependent launches that a graph's replay does not. An assumption, not measured here (no GPU was
# lent): the whole-step table charges it per such kernel (dgemma_cli.step_trace StepTrace.eager_kernels), in the
# bound and in the serial floor alike, since no kernel's own speed removes it.
LAUNCH_US = 2.0
OVER = 1.25  # issue / max(DRAM, tensor) above this is marked


class LoopMismatch(RuntimeError):
    """The compiled kernel's loops are not the ones its KERNELS entry declares."""


def _all_ctas(args: dict, grid: tuple) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


def _live_blocks(args: dict, grid: tuple) -> int:
    """MoE kernels: one CTA per (block of the plan, column tile), whatever the grid's axis order; blocks whose
    expert id is E exit at once, the others run the loop."""
    block_expert = args["block_expert_ptr"]
    tiles, rest = divmod(_all_ctas(args, grid), block_expert.numel())
    if rest:
        raise LoopMismatch(f"grid {grid} is not a whole number of CTAs per block of the plan")
    return int((block_expert < args["E"]).sum()) * tiles


def _live_rows(args: dict, grid: tuple) -> int:
    """quantize_act: one CTA per row; with SKIP, rows whose id is negative (MoE padding) exit at once."""
    if args.get("SKIP"):
        return int((args["ids_ptr"] >= 0).sum())
    return _all_ctas(args, grid)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Loops:
    """How a kernel's loops run, from a launch's arguments (by parameter name, constexprs included)."""

    trips: Callable[[dict], list[int]]  # iterations of each top-level loop, in address order ([]: loop-free)
    elems: Callable[[dict], int]  # weight (or logit, or summed) elements one CTA consumes
    ctas: Callable[[dict, tuple], int] = _all_ctas  # CTAs that run the loops
    # tensors streamed more than once: reads + writes (or a function of the launch's arguments giving that dict)
    passes: dict[str, int] | Callable[[dict], dict[str, int]] = field(default_factory=dict)
    # FLOPs one live CTA's tensor-core instructions execute: its whole tile, padded rows and K included (0: none)
    mma: Callable[[dict], int] = lambda a: 0
    # FLOPs the launch's result needs, whatever its tiles: 2 x real rows x N x K of each product (0: none)
    useful: Callable[[dict], int] = lambda a: 0
    # the kernel's own scratch (a split's partial sums and counters): in its traffic, not in what the result needs
    scratch: frozenset[str] = frozenset()


def _routed(a: dict) -> int:
    """MoE kernels: the token-expert assignments the block plan holds (its padding rows have id -1)."""
    return int((a["ids_ptr"] >= 0).sum())


def _tile_mma(tiles: int, k: str | Callable[[dict], int]) -> Callable[[dict], int]:
    """A CTA computing `tiles` BLOCK_M x BLOCK_N tiles over its depth (argument k, or k(args)) rounded up to
    BLOCK_K."""
    def mma(a: dict) -> int:
        depth = k(a) if callable(k) else a[k]
        return 2 * tiles * a["BLOCK_M"] * a["BLOCK_N"] * _cdiv(depth, a["BLOCK_K"]) * a["BLOCK_K"]
    return mma


def _lora_rank(a: dict) -> int:
    """Kernels with a LoRA epilogue: the adapters' stacked rank (BLOCK_R, zero-padded) when LORA, else 0."""
    return a["BLOCK_R"] if a.get("LORA") else 0


def _lora_epilogue(a: dict, tiles: int) -> int:
    """Kernels with LORA, per CTA: BLOCK_M x (tiles x BLOCK_N) over the rank."""
    return 2 * a["BLOCK_M"] * tiles * a["BLOCK_N"] * _lora_rank(a)


def _k_per_cta(a: dict) -> int:
    """Linear kernels that may split K over SPLITS CTAs a tile: the inputs one CTA takes (KS, at most K; K unsplit)."""
    return min(a["KS"], a["K"]) if a.get("SPLITS", 1) > 1 else a["K"]


def _segment_widths(a: dict) -> int:
    """Linear kernels launched for several linears of one input (SEGMENTS, q k v): their outputs' widths summed."""
    return a["N"] + sum(a.get(n, 0) for n in ("N1", "N2")[: a.get("SEGMENTS", 1) - 1])


def _segment_passes(a: dict) -> dict[str, int]:
    """The second and third linears' operands are stand-ins, never read or written, unless SEGMENTS has them."""
    segments = a.get("SEGMENTS", 1)
    return {name: int(segments > i + 1) for i, names in enumerate((("w1_ptr", "s1_ptr", "s21_ptr", "y1_ptr"),
                                                                   ("w2_ptr", "s2b_ptr", "s22_ptr", "y2_ptr")))
            for name in names}


def _lora_passes(a: dict) -> dict[str, int]:
    """MoE kernels: t and B are stand-in pointers, never read, unless LORA."""
    return {"t_ptr": int(bool(a.get("LORA"))), "lb_ptr": int(bool(a.get("LORA")))}


def _moe_passes(a: dict) -> dict[str, int]:
    """The 16-bit-MMA MoE kernels: _lora_passes, and the scale operands a FORMAT does not read (stand-ins: INT8 has
    no global scale, a GGUF's scales are in its blocks, which w_ptr already counts)."""
    fmt = a.get("FORMAT", 0)
    return dict(_lora_passes(a), s_ptr=int(fmt != 2), s2_ptr=int(fmt == 0))


# Keyed by kernel function name. Update an entry with its kernel: the report fails when they disagree.
KERNELS = {
    # for k0 in range(0, K, BLOCK_K): one CTA per BLOCK_M x BLOCK_N tile of y
    # GATED: the gate's and the up projection's tiles each step (two decodes, two products)
    # LORA: after the loop, the rows' rank product t (lora_shrink_kernel's) times B's rows for the tile (each half)
    # SPLITS > 1: each CTA takes KS of K (the last part may be shorter: counted whole), writes its float32 sums and
    # the last of a tile's CTAs reads the others' (the partial sums counted written and read in full) and finishes
    "nvfp4_linear_kernel": Loops(trips=lambda a: [_cdiv(_k_per_cta(a), a["BLOCK_K"])],
                                 elems=lambda a: (2 if a["GATED"] else 1) * a["BLOCK_N"]
                                 * (_k_per_cta(a) + _lora_rank(a)),
                                 passes=lambda a: {"part_ptr": 2, "count_ptr": 1,
                                                   "wu_ptr": int(a["GATED"]), "su_ptr": int(a["GATED"]),
                                                   "s2u_ptr": int(a["GATED"]), "t_ptr": int(bool(a.get("LORA"))),
                                                   "lb_ptr": int(bool(a.get("LORA"))),
                                                   "tu_ptr": int(bool(a.get("LORA")) and a["GATED"]),
                                                   "lbu_ptr": int(bool(a.get("LORA")) and a["GATED"]),
                                                   **_segment_passes(a)},
                                 mma=lambda a: (2 if a["GATED"] else 1) * (_tile_mma(1, _k_per_cta)(a)
                                                                           + _lora_epilogue(a, 1)),
                                 useful=lambda a: (2 if a["GATED"] else 1) * 2 * a["M"] * _segment_widths(a)
                                 * (a["K"] + _lora_rank(a)), scratch=frozenset({"part_ptr", "count_ptr"})),
    # a linear's LoRA rank product (lora.py): for k0 in range(0, K, BLOCK_K), one CTA per BLOCK_M rows
    "lora_shrink_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])], elems=lambda a: a["BLOCK_R"] * a["K"],
                                passes=lambda a: {"rs_ptr": int(a["SLOTS"])},
                                mma=lambda a: 2 * a["BLOCK_M"] * a["BLOCK_R"] * _cdiv(a["K"], a["BLOCK_K"])
                                * a["BLOCK_K"],
                                useful=lambda a: 2 * a["M"] * a["BLOCK_R"] * a["K"]),
    # a GGUF linear (ggml_linear.py): for k0 in range(0, K, BLOCK_K), one CTA per BLOCK_M x BLOCK_N tile of y
    # GATED: the gate's and the up projection's tiles each step (two decodes, two products)
    "ggml_linear_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])],
                                elems=lambda a: (2 if a.get("GATED") else 1) * a["BLOCK_N"] * a["K"],
                                passes=lambda a: {"wu_ptr": int(bool(a.get("GATED")))},
                                mma=lambda a: (2 if a.get("GATED") else 1) * _tile_mma(1, "K")(a),
                                useful=lambda a: (2 if a.get("GATED") else 1) * 2 * a["M"] * a["N"] * a["K"]),
    "int8_linear_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])],
                                elems=lambda a: a["BLOCK_N"] * a["K"], mma=_tile_mma(1, "K"),
                                useful=lambda a: 2 * a["M"] * a["N"] * a["K"]),
    # for k0 in range(0, H, BLOCK_K), gate and up tiles each iteration; only blocks of a real expert run it.
    # LORA: after the loop, the block's rank product t (moe_lora_shrink_kernel's) times B_e's rows for the tile's
    # gate and up columns (_lora_epilogue)
    "moe_gate_up_kernel": Loops(trips=lambda a: [_cdiv(a["H"], a["BLOCK_K"])],
                                elems=lambda a: 2 * a["BLOCK_N"] * (a["H"] + _lora_rank(a)), ctas=_live_blocks,
                                passes=_moe_passes, mma=lambda a: _tile_mma(2, "H")(a) + _lora_epilogue(a, 2),
                                useful=lambda a: 2 * _routed(a) * 2 * a["I"] * (a["H"] + _lora_rank(a))),
    # for k0 in range(0, I, BLOCK_K) (LORA as the gate-up kernel's)
    "moe_down_kernel": Loops(trips=lambda a: [_cdiv(a["I"], a["BLOCK_K"])],
                             elems=lambda a: a["BLOCK_N"] * (a["I"] + _lora_rank(a)), ctas=_live_blocks,
                             passes=_moe_passes, mma=lambda a: _tile_mma(1, "I")(a) + _lora_epilogue(a, 1),
                             useful=lambda a: 2 * _routed(a) * a["H"] * (a["I"] + _lora_rank(a))),
    # the experts' LoRA rank product: for k0 in range(0, K, BLOCK_K), one CTA per block of the plan (moe_lora.py)
    "moe_lora_shrink_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])],
                                    elems=lambda a: a["BLOCK_R"] * a["K"], ctas=_live_blocks,
                                    passes=lambda a: {"tslot_ptr": int(a["SLOTS"])},
                                    mma=lambda a: 2 * a["BLOCK_M"] * a["BLOCK_R"] * _cdiv(a["K"], a["BLOCK_K"])
                                    * a["BLOCK_K"],
                                    useful=lambda a: 2 * _routed(a) * a["BLOCK_R"] * a["K"]),
    # W4A4: for k0 in range(0, K, BLOCK_K), FP4 x FP4 dot_scaled; one CTA per BLOCK_M x BLOCK_N tile of y
    # GATED: the gate's and the up projection's weight tiles each step (two products on the same activation tile)
    "nvfp4_w4a4_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])],
                               elems=lambda a: (2 if a.get("GATED") else 1) * a["BLOCK_N"] * (a["K"] + _lora_rank(a)),
                               passes=lambda a: dict(_lora_passes(a), **_segment_passes(a),
                                                     **{k: int(bool(a.get("GATED")))
                                                        for k in ("wu_ptr", "wsu_ptr", "wgu_ptr")}),
                               mma=lambda a: (2 if a.get("GATED") else 1) * _tile_mma(1, "K")(a)
                               + _lora_epilogue(a, 1),
                               useful=lambda a: (2 if a.get("GATED") else 1) * 2 * a["M"] * _segment_widths(a)
                               * a["K"] + 2 * a["M"] * a["N"] * _lora_rank(a)),
    # W4A4 experts: for k0 in range(0, H or I, BLOCK_K), FP4 x FP4 dot_scaled (gate and up each iteration); LORA
    # as the 16-bit MoE kernels' (its epilogue's 16-bit MMA counted at the launch's FP4 rate: a rank of 16 against
    # K of thousands)
    "moe_gate_up_w4a4_kernel": Loops(trips=lambda a: [_cdiv(a["H"], a["BLOCK_K"])],
                                     elems=lambda a: 2 * a["BLOCK_N"] * (a["H"] + _lora_rank(a)), ctas=_live_blocks,
                                     passes=_lora_passes, mma=lambda a: _tile_mma(2, "H")(a) + _lora_epilogue(a, 2),
                                     useful=lambda a: 2 * _routed(a) * 2 * a["I"] * (a["H"] + _lora_rank(a))),
    "moe_down_w4a4_kernel": Loops(trips=lambda a: [_cdiv(a["I"], a["BLOCK_K"])],
                                  elems=lambda a: a["BLOCK_N"] * (a["I"] + _lora_rank(a)), ctas=_live_blocks,
                                  passes=_lora_passes, mma=lambda a: _tile_mma(1, "I")(a) + _lora_epilogue(a, 1),
                                  useful=lambda a: 2 * _routed(a) * a["H"] * (a["I"] + _lora_rank(a))),
    # W8A8 dense linears (w8a8_linear.py): for k0 in range(0, K, BLOCK_K), one CTA per BLOCK_M x BLOCK_N tile;
    # GATED: the gate's and the up projection's codes each step; SEGMENTS: 2 or 3 linears' tiles in one grid
    "w8a8_linear_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])],
                                elems=lambda a: (2 if a["GATED"] else 1) * a["BLOCK_N"] * a["K"],
                                passes=lambda a: {"wu_ptr": int(a["GATED"]), "wsu_ptr": int(a["GATED"]),
                                                  **{k: int(a["SEGMENTS"] > i + 1) for i, names in enumerate(
                                                      (("w1_ptr", "s1_ptr", "y1_ptr"), ("w2_ptr", "s2b_ptr",
                                                                                        "y2_ptr"))) for k in names}},
                                mma=lambda a: (2 if a["GATED"] else 1) * _tile_mma(1, "K")(a),
                                useful=lambda a: (2 if a["GATED"] else 1) * 2 * a["M"] * _segment_widths(a) * a["K"]),
    # W8A8 experts: for k0 in range(0, H or I, BLOCK_K), int8 x int8 or e4m3 x e4m3 (gate and up each iteration)
    "moe_gate_up_w8a8_kernel": Loops(trips=lambda a: [_cdiv(a["H"], a["BLOCK_K"])],
                                     elems=lambda a: 2 * a["BLOCK_N"] * a["H"], ctas=_live_blocks,
                                     mma=_tile_mma(2, "H"),
                                     useful=lambda a: 2 * _routed(a) * 2 * a["I"] * a["H"]),
    "moe_down_w8a8_kernel": Loops(trips=lambda a: [_cdiv(a["I"], a["BLOCK_K"])],
                                  elems=lambda a: a["BLOCK_N"] * a["I"], ctas=_live_blocks, mma=_tile_mma(1, "I"),
                                  useful=lambda a: 2 * _routed(a) * a["H"] * a["I"]),
    # activations to INT8 / e4m3 per row, one row per CTA: a sweep for the amax, a second quantizing (x read twice)
    "quantize_rows_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])] * 2, elems=lambda a: a["K"],
                                  passes={"x_ptr": 2}, ctas=_live_rows),
    # activations to NVFP4, one row per CTA: a sweep for the row's amax, a second quantizing (x read twice); with a
    # calibrated static scale (STATIC) only the second
    "quantize_act_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"])] * (1 if a["STATIC"] else 2),
                                 elems=lambda a: a["K"], passes=lambda a: {"x_ptr": 1 if a["STATIC"] else 2},
                                 ctas=_live_rows),
    # no loop: one CTA per R rows of D elements; operands a launch does not have are stand-in pointers, never read
    "rms_norm_kernel": Loops(trips=lambda a: [], elems=lambda a: a["R"] * a["D"],
                             passes=lambda a: {"a2_ptr": int(a["HAS_A2"]), "w_ptr": int(a["HAS_W"]),
                                               "r_ptr": int(a["HAS_R"]), "s_ptr": int(a["HAS_S"]),
                                               "cos_ptr": int(a["ROPE"]), "sin_ptr": int(a["ROPE"]),
                                               "wa_ptr": int(a["NORM_A"]), "wa2_ptr": int(a["NORM_A2"]),
                                               "w2_ptr": int(a["HAS_Y2"]), "y2_ptr": int(a["HAS_Y2"]),
                                               "b_ptr": int(a["TWO"]), "wb_ptr": int(a["TWO"]),
                                               "yb_ptr": int(a["TWO"]),
                                               **{k: int(bool(a.get("THEN_PAIR")))
                                                  for k in ("wp_ptr", "wp2_ptr", "yp_ptr", "yp2_ptr")},
                                               "c_ptr": int(bool(a.get("THREE"))),
                                               "yc_ptr": int(bool(a.get("THREE"))),
                                               "q_ptr": int(bool(a.get("QUANT"))), "qs_ptr": int(bool(a.get("QUANT"))),
                                               "qg_ptr": int(a.get("QUANT") == 3),
                                               "gs_ptr": int(a.get("QUANT") == 3 and bool(a.get("STATIC")))}),
    # BLOCK_T tokens a CTA: a sweep over H for the norm, a sweep over its KS inputs (H unsplit; SPLITS programs a
    # token block share H) multiplying by W's tiles (the top-k after, unrolled); the tile's MMA work: BLOCK_T x
    # BLOCK_E x KS rounded up to BLOCK_K
    "router_kernel": Loops(trips=lambda a: [_cdiv(a["H"], a["BLOCK_K"]), _cdiv(min(a["KS"], a["H"]), a["BLOCK_K"])],
                           elems=lambda a: a["BLOCK_E"] * min(a["KS"], a["H"]),
                           # split: the partial sums written, then read by the last program; unsplit: stand-ins
                           passes=lambda a: {"part_ptr": 2, "count_ptr": 1} if a.get("SPLITS", 1) > 1 else
                           {"part_ptr": 0, "count_ptr": 0},
                           mma=lambda a: 2 * a["BLOCK_T"] * a["BLOCK_E"] * _cdiv(min(a["KS"], a["H"]), a["BLOCK_K"])
                           * a["BLOCK_K"],
                           useful=lambda a: 2 * a["T"] * a["E"] * a["H"],
                           scratch=frozenset({"part_ptr", "count_ptr"})),
    # the block plan, loop-free: one CTA per chunk of CH assignments
    "moe_count_kernel": Loops(trips=lambda a: [], elems=lambda a: a["CH"]),
    "moe_place_kernel": Loops(trips=lambda a: [], elems=lambda a: a["CH"]),
    # a LoRA term (quant/kernels/lora.py): for k0 in range(0, K, BLOCK_K) the rows' rank-R product, then for n0 in
    # the CTA's stretch of N_PER columns (the last stretch shorter: counted whole) B's tiles and y's read-add-write
    "lora_kernel": Loops(trips=lambda a: [_cdiv(a["K"], a["BLOCK_K"]), _cdiv(a["N_PER"], a["BLOCK_N"])],
                         elems=lambda a: a["R"] * (a["K"] + a["N_PER"]), passes={"y_ptr": 2},
                         mma=lambda a: 2 * a["BLOCK_M"] * a["BLOCK_R"] * (_cdiv(a["K"], a["BLOCK_K"]) * a["BLOCK_K"]
                                                                          + _cdiv(a["N_PER"], a["BLOCK_N"])
                                                                          * a["BLOCK_N"]),
                         useful=lambda a: 2 * a["M"] * a["R"] * (a["K"] + a["N"])),
    # no loop: one CTA converts and caps BLOCK logits
    "softcap_kernel": Loops(trips=lambda a: [], elems=lambda a: a["BLOCK"]),
    # GGUF blocks decoded (ggml_decode.py: a GGUF embedding's looked-up rows in a step), loop-free: one CTA per
    # BLOCK_R rows x BLOCK_K columns
    "ggml_decode_kernel": Loops(trips=lambda a: [], elems=lambda a: a["BLOCK_R"] * a["BLOCK_K"]),
    # the W8A8 MLP's gelu_tanh(gate) * up (gelu_mul.py): loop-free, BLOCK elements a CTA
    "gelu_mul_kernel": Loops(trips=lambda a: [], elems=lambda a: a["BLOCK"]),
    # no loop (the top-k rows unrolled): one CTA sums BLOCK columns of one token's TOPK rows
    "moe_sum_kernel": Loops(trips=lambda a: [], elems=lambda a: a["TOPK"] * a["BLOCK"]),
    # the fused head (quant/kernels/head.py), per vocab chunk: logits, for k0 in range(0, H, BLOCK_K), one CTA per
    # BLOCK_M rows x TILE columns; the soft embedding, for k0 in range(0, KC, BLOCK_K), one CTA per BLOCK_M rows x
    # BLOCK_N of H, its running sum read and written unless FIRST; then one CTA a row, loop-free, for the totals
    "head_logits_kernel": Loops(trips=lambda a: [_cdiv(a["H"], a["BLOCK_K"])], elems=lambda a: a["TILE"] * a["H"],
                                mma=lambda a: 2 * a["BLOCK_M"] * a["TILE"] * _cdiv(a["H"], a["BLOCK_K"]) * a["BLOCK_K"],
                                useful=lambda a: 2 * a["R"] * a["VC"] * a["H"]),
    # AFTER: one trip a vocab tile (its BLOCK_K steps unrolled), else one a BLOCK_K step
    "head_soft_kernel": Loops(trips=lambda a: [_cdiv(min(a["KC"], a["KS"]), a["TILE"] if a.get("AFTER") else
                                                     a["BLOCK_K"])],
                              elems=lambda a: a["BLOCK_N"] * min(a["KC"], a["KS"]),
                              passes=lambda a: {"part_ptr": 1 if a["FIRST"] else 2},
                              mma=lambda a: 2 * a["BLOCK_M"] * a["BLOCK_N"] * _cdiv(min(a["KC"], a["KS"]), a["BLOCK_K"])
                              * a["BLOCK_K"],
                              useful=lambda a: 2 * a["R"] * a["VC"] * a["H"]),
    "head_finish_kernel": Loops(trips=lambda a: [], elems=lambda a: a["H"]),
}


def declaration(kernel: str) -> Loops:
    if kernel not in KERNELS:
        raise LoopMismatch(f"{kernel}: no loop declaration; add one to quant/kernels/roofline.py KERNELS")
    return KERNELS[kernel]


def _call(kernel: str, what: str, f: Callable, *args):
    try:
        return f(*args)
    except KeyError as e:
        raise LoopMismatch(f"{kernel}: its {what} declaration reads argument {e}, which the launch does not "
                           f"have; update KERNELS") from None


def warp_instructions(kernel: str, decl: Loops, args: dict, grid: tuple, num_warps: int, loops: list[dict],
                      straight: int = 0) -> tuple[int, float]:
    """(warp-instructions the launch's loops issue, thread-instructions per weight element) for SASS top-level
    `loops` (aot.find_loops) checked against the declaration. A kernel declared without loops counts its
    `straight`-line instructions (aot.straight_line) once per warp instead."""
    trips = _call(kernel, "trips", decl.trips, args)
    if len(loops) != len(trips):
        raise LoopMismatch(f"{kernel}: the SASS has {len(loops)} top-level loop(s), KERNELS declares {len(trips)}")
    nested = [lp for lp in loops if lp["inner"]]
    if nested:
        raise LoopMismatch(f"{kernel}: the loop at 0x{nested[0]['start']:x} holds {nested[0]['inner']} nested "
                           f"loop(s), which KERNELS cannot count")
    per_cta = (sum(lp["instrs"] * t for lp, t in zip(loops, trips)) if trips else straight) * num_warps
    per_elem = per_cta * 32 / _call(kernel, "elems", decl.elems, args)
    return per_cta * _call(kernel, "ctas", decl.ctas, args, grid), per_elem


def traffic(decl: Loops, args: dict, scratch: bool = True) -> int:
    """A launch's estimated DRAM bytes: every tensor argument once (a re-read tile is an L2 hit), times its
    declared passes; without its scratch (`Loops.scratch`) when `scratch` is False."""
    passes = decl.passes(args) if callable(decl.passes) else decl.passes
    return sum(min(v.numel() * v.element_size(), v.untyped_storage().nbytes()) * passes.get(k, 1)
               for k, v in args.items() if isinstance(v, torch.Tensor) and (scratch or k not in decl.scratch))


def dram_us(gpu: GPU, nbytes: float) -> float:
    return nbytes / (gpu.dram_tbs * 1e6)


def tensor_us(gpu: GPU, flops: float, fp4: bool = False) -> float:
    """At the bf16 peak, or the FP4 one for a kernel that multiplies on the FP4 tensor cores."""
    return flops / ((gpu.fp4_tflops if fp4 else gpu.tensor_tflops) * 1e6)


def gpu_named(name: str, sms: int) -> GPU | None:
    """The GPU above a card is, from its name as CUDA gives it ("NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3")
    and its SM count (which tells an H100 SXM from an H100 PCIe): None for a card not listed, whose bound is unknown."""
    def key(text: str) -> str:
        return text.lower().replace("nvidia", "").replace("geforce", "").replace(" ", "")

    listed = [*GPUS.values(), *(g for _, g in CARD_GPUS.values()), *(g for gs in STEP_ALSO.values() for g in gs)]
    for gpu in sorted(listed, key=lambda g: -len(g.name)):  # "RTX 4060 Ti 16GB" before "RTX 4060"
        family = key(gpu.name.split(" SXM")[0].removesuffix("16GB").removesuffix("12GB"))
        variant = any(v in key(name) for v in ("pcie", "nvl", "40gb"))  # other memory, other bandwidth
        if family in key(name) and gpu.sms == sms and not variant:
            return gpu
    return None


def issue_us(gpu: GPU, warp_instr: float) -> float:
    return warp_instr / (gpu.sms * ISSUE_PER_CLOCK * gpu.clock_ghz * 1e3)


def ratio(issue: float, dram: float, tensor: float) -> float:
    """issue / max(DRAM, tensor): above 1 the kernel's instructions, not memory or math, set its floor."""
    bound = max(dram, tensor)
    return issue / bound if bound else float("inf")


EIGHT_BIT_OPS = {"IMMA", "QMMA", "IGMMA", "QGMMA", "UTCIMMA", "UTCQMMA"}  # INT8 / FP8 tensor-core instructions


def tensor_rate(gpu: GPU, tc_ops: list[str]) -> float:
    """Dense TFLOPS of the tensor-core instructions a kernel issues: FP4 where it multiplies FP4 x FP4, twice the
    bf16 rate for INT8 / FP8 (as every target here has it, float32 accumulation), else bf16."""
    base = {op.split(".")[0] for op in tc_ops}
    if base & FP4_OPS and gpu.fp4_tflops:
        return gpu.fp4_tflops
    if base & EIGHT_BIT_OPS:
        return 2 * gpu.tensor_tflops
    return gpu.tensor_tflops


def launch_bound(gpu: GPU, kernel: str, args: dict, grid: tuple, compiled: dict, extra_bytes: int = 0) -> dict:
    """One launch's bound in microseconds on `gpu`, from its compiled code (aot.compile_job's result), counting what
    the GPU executes: dram (its estimated traffic + `extra_bytes`), tensor (its CTAs' MMA work as executed: whole
    tiles, padded rows included), issue (every warp-instruction: the loops x trips and the code outside them per live
    CTA; a CTA that exits at once, its code up to the first EXIT), and the busiest SM (ceil(live CTAs / SMs) CTAs:
    their issue at 4 per clock and their MMA work at one SM's share of the tensor peak). bound = the largest.
    Raises LoopMismatch when the code's loops are not the declared ones."""
    decl = declaration(kernel)
    warp_instructions(kernel, decl, args, grid, compiled["num_warps"], compiled["loops"], compiled["straight"])
    trips = _call(kernel, "trips", decl.trips, args)
    looped = sum(lp["instrs"] * t for lp, t in zip(compiled["loops"], trips))
    outside = compiled["straight"] - sum(lp["instrs"] for lp in compiled["loops"])
    warps = compiled["num_warps"]
    live = _call(kernel, "ctas", decl.ctas, args, grid)
    dead = _all_ctas(args, grid) - live
    per_cta = (looped + outside) * warps
    instr = live * per_cta + dead * compiled.get("first_exit", compiled["straight"]) * warps
    mma_cta = _call(kernel, "mma", decl.mma, args)
    rate = tensor_rate(gpu, compiled["tc_ops"]) * 1e6  # FLOPs per microsecond
    per_sm = _cdiv(live, gpu.sms)
    out = dict(dram=dram_us(gpu, traffic(decl, args) + extra_bytes), tensor=live * mma_cta / rate,
               issue=issue_us(gpu, instr), wave_issue=per_sm * per_cta / (ISSUE_PER_CLOCK * gpu.clock_ghz * 1e3),
               wave_tensor=per_sm * mma_cta / (rate / gpu.sms), mma_flops=live * mma_cta, warp_instr=instr)
    out["bound"] = max(out["dram"], out["tensor"], out["issue"], out["wave_issue"], out["wave_tensor"])
    # what no kernel computing this launch's result can beat: its bytes at peak bandwidth (its own scratch apart) or
    # its useful FLOPs at the rate of the tensor-core instructions it uses (padding, instructions, scratch and idle
    # SMs not counted)
    out["useful_flops"] = _call(kernel, "useful", decl.useful, args)
    out["least"] = max(dram_us(gpu, traffic(decl, args, scratch=False) + extra_bytes), out["useful_flops"] / rate)
    return out
