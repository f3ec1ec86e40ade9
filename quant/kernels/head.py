"""The fused head: logits, soft-capping, the sampler's statistics and draw, and the next step's soft embedding, over
vocab chunks, with no canvas x vocab float32 tensor.

What it replaces (the GPU path before it): the logits matmul into a 16-bit [R, V] tensor, its conversion to a float32
[R, V] buffer and capping, the sampler epilogue (softmax in place, entropy, argmax, draw), and at the next step the
soft embedding probs [R, V] @ embedding [V, H], which read the 1.48 GB embedding once per 64 rows. Here the
embedding is streamed twice a step (logits, then soft embedding, chunk by chunk) and the only vocab-wide tensors are
a 16-bit chunk of unnormalised probabilities [R, VC] and per-tile statistics [R, V / TILE].

Why not the flash-attention pattern in one pass (the embedding as keys and values): the soft embedding's output row
is H = 2,816 wide, an accumulator of [rows, H] float32 per program that fits no SM's registers or shared memory for
a row tile worth streaming the embedding for; splitting H would recompute the logits once per split, splitting the
vocab across programs would keep a partial [rows, H] per split. A vocab chunk's probabilities are written once in
bfloat16 and read once, which costs 2 x 2 x R x VC bytes a chunk, far less than either.

Per step, rows R = batch x canvas, chunk c = vocab [c VC, (c + 1) VC):
1. head_logits_kernel (one program per BLOCK_M rows x TILE vocab columns of the chunk): logits = h @ W^T in float32,
   capped (cap tanh(l / cap)), x = l log2(e) / t (the row's temperature, base 2). Per (row, tile): the tile max m_t,
   s_t = sum 2^(x - m_t), w_t = sum 2^(x - m_t) (x - m_t), the first index of the largest x, and a draw within the
   tile (inverse CDF of 2^(x - m_t) / s_t at the row's second uniform u2). Writes P = bfloat16(2^(x - m_t)) into the
   chunk buffer, and the chunk's row max into M[row, c] (atomic max).
2. head_soft_kernel (one program per BLOCK_M rows x BLOCK_N of H x split of the chunk's columns): acc = sum over the
   split's columns of P 2^(m_t - M_c) times W, the factor per row and tile: on sm_90 and sm_100 (AFTER, where the
   tensor cores read P from shared memory) multiplying each tile's float32 partial product, elsewhere applied to P
   before the tensor cores (which read it from registers there), rounded to bfloat16 once more; the split's running
   sums over the chunks so far are rescaled from their previous max to M_c, the max so far (read from M, so each
   program needs no other's result), and written back (the first chunk writes). The splits (1-8, `_splits`: the
   fewest waves for the GPU's SMs) fill a GPU the output tiles alone would not (88 of them at batch 1), each with a
   running sum of its own.
3. head_finish_kernel (one program per row, after the last chunk): M = max_t m_t (= the last running max),
   S = sum_t s_t 2^(m_t - M), entropy = ln S - ln 2 sum_t 2^(m_t - M) (w_t + s_t (m_t - M)) / S (of softmax(l / t),
   in nats, as the sampler's), argmax = the first tile holding M's index, the draw = the tile chosen by inverse CDF
   of the tile masses at the row's first uniform u1, then that tile's draw; soft = the splits' running sums added,
   / S * sqrt(H), as bfloat16; M reset to -inf for the next step (`HeadBuffers.reset` after a step that stopped
   midway).
The draw is exact in distribution: P(v) = P(its tile) P(v | its tile), from two uniforms per row that the caller
draws (torch's generator or a request's own), so `head_reference` here gives the same tokens from the same uniforms.
Kernels: 2 x chunks + 1 a step.

Operands: h [R, H] 16-bit (final-normed hidden, contiguous), W [V, H] 16-bit (the tied embedding), temperature
float32 [R], uniforms float32 [R, 2] in [0, 1). Outputs (in `HeadBuffers`): sample, argmax int64 [R], entropy
float32 [R], soft [R, H] in h's dtype (the next step's self-conditioning input, already times sqrt(H)).

A GGUF model's embedding stays as its blocks (uint8 [V, row bytes], `fused_head(kind=...)`: Q6_K in the published
files, 0.61 GB against 1.48 GB in 16 bits): both kernels then decode their W tile from the blocks in registers
(kernels/ggml_tile.py), in the tile's own order: the logits kernel loads h in that order, the soft-embedding kernel
stores its sums at the hidden columns in that order. Each weight is rounded to the compute dtype, as the decoded
16-bit embedding holds it; the logits kernel's K step is then 128 (half a super-block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import arch, fewest_waves, interpreting, shared_b_operand
from .class_pass import keep_max, pack
from .common import to_compute
from .ggml_tile import ggml_tile, tile_order
from .rmsnorm import _round

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

TILE = 128  # vocab columns per logits program (its statistics' granularity)
CHUNK = 32768  # vocab columns per chunk: the bfloat16 probabilities buffer is rows x CHUNK (16 MB per canvas)


@triton.jit
def _held_classes(x, base, rows, rmask, u_ptr, slot_ptr, order_ptr, run_ptr, key_ptr, KR, KP, NPAD,
                  TILE: tl.constexpr):
    """The class pass of the rows held to a structure (quant/kernels/class_pass.py, fused here): for each held row of
    the tile (slot >= 0: its structure's tables), each class's best x and best x + Gumbel noise (in x's base-2 units:
    the noise times log2 e), as keys, by atomic max into key_ptr [2, R, KR] (planes KP apart). The structure's tables
    (made once on the host: dgemma_cli/structured/device_search.py `DeviceTables.tile_runs`) list each tile's lanes
    in class order (order) and, at each place of that order, the class and whether a class's run ends there (run:
    class x 2 + 1 at a run's end, -2 for a token no class holds); the tile's x are gathered in that order, a segmented
    max-scan runs along them, and each run's end writes: an atomic per class present in the tile. The noise: philox
    keyed by the row's two uniforms (drawn from its own generator each step), at the token's id."""
    slot = tl.load(slot_ptr + rows, mask=rmask, other=-1)
    held = slot >= 0
    if tl.max(held.to(tl.int32)) > 0:
        at_t = slot[:, None].to(tl.int64) * NPAD + base + tl.arange(0, TILE)[None, :]
        at = tl.load(order_ptr + at_t, mask=held[:, None], other=0)  # [BLOCK_M, TILE]: lanes in class order
        run = tl.load(run_ptr + at_t, mask=held[:, None], other=-2)
        c = run >> 1  # the class (-1: none)
        last = (run & 1) == 1
        tok = base + at  # the tile's vocabulary is consecutive
        xs = tl.gather(x, at, 1)
        dst = key_ptr + rows[:, None].to(tl.int64) * KR + c
        _, best = tl.associative_scan((c, pack(xs, tok)), 1, keep_max)
        tl.atomic_max(dst, best, mask=last)
        u = tl.load(u_ptr + rows * 2, mask=held, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
        u2 = tl.load(u_ptr + rows * 2 + 1, mask=held, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
        r = tl.rand(((u << 32) | (u2 & 0xFFFFFFFF))[:, None], tok)
        g = -tl.log(-tl.log(tl.maximum(r, 1e-20))) * LOG2E
        _, drawn = tl.associative_scan((c, pack(xs + g, tok)), 1, keep_max)
        tl.atomic_max(dst + KP, drawn, mask=last)


@triton.jit
def head_logits_kernel(h_ptr, w_ptr, temp_ptr, u_ptr, p_ptr, tmax_ptr, tsum_ptr, tw_ptr, targ_ptr, tsamp_ptr,
                       m_ptr, slot_ptr, order_ptr, run_ptr, key_ptr, R, H, V, v0, VC, NT, NC, chunk, cap, KR, KP,
                       HAS_CAP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                       BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, HELD: tl.constexpr = False,
                       KIND: tl.constexpr = -1, row_bytes=0):
    pid_m = tl.program_id(0)  # row tiles vary fastest: the programs sharing a W tile run together (L2)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * TILE + tl.arange(0, TILE)  # within the chunk
    vocab = v0 + cols
    rmask = rows < R
    vmask = vocab < V
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None].to(tl.int64) * H + ks[None, :]
    b_ptrs = w_ptr + cols[:, None].to(tl.int64) * H + ks[None, :]  # [TILE, BLOCK_K]: W rows, contiguous in k
    acc = tl.zeros((BLOCK_M, TILE), dtype=tl.float32)
    if KIND >= 0:  # W as GGUF blocks (ggml_tile: the tile in its own order, h loaded in that order; H whole blocks)
        order = tile_order(BLOCK_K, KIND)
        wrows = tl.where(vmask, cols, 0).to(tl.int64)  # columns past V read row 0 (masked out of x below)
        for k0 in range(0, H, BLOCK_K):
            a = tl.load(h_ptr + rows[:, None].to(tl.int64) * H + (k0 + order)[None, :], mask=rmask[:, None],
                        other=0.0)
            b = to_compute(ggml_tile(w_ptr, wrows, k0, H, row_bytes, KIND, TILE, BLOCK_K), a.dtype, EMULATE)
            if EMULATE:
                acc += tl.dot(a.to(tl.float32), b, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    else:
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs + k0, mask=rmask[:, None], other=0.0)
                b = tl.load(b_ptrs + k0, mask=vmask[:, None], other=0.0)
            else:
                kmask = k0 + ks < H
                a = tl.load(a_ptrs + k0, mask=rmask[:, None] & kmask[None, :], other=0.0)
                b = tl.load(b_ptrs + k0, mask=vmask[:, None] & kmask[None, :], other=0.0)
            if EMULATE:  # the interpreter's 16-bit products are not IEEE; these are exact in float32
                acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)))
            else:
                acc = tl.dot(a, tl.trans(b), acc)
    if HAS_CAP:  # cap tanh(l / cap) as quant/kernels/softcap.py computes it
        v = tl.math.div_rn(acc, cap)
        e = tl.exp(-2.0 * tl.abs(v))
        t = (1.0 - e) / (1.0 + e)
        acc = tl.where(v < 0, -t, t) * cap
    c2 = LOG2E / tl.load(temp_ptr + rows, mask=rmask, other=1.0)  # [BLOCK_M]
    x = tl.where(vmask[None, :], acc * c2[:, None], -float("inf"))
    mt = tl.max(x, axis=1)  # finite: every tile holds a vocab column (the grid stops at V)
    d = tl.maximum(x - mt[:, None], -1000.0)  # <= 0; 2^-1000 is 0 (past V too), and 0 x d is 0, not nan
    e = tl.exp2(d)
    st = tl.sum(e, axis=1)
    wt = tl.sum(e * d, axis=1)
    idx = tl.arange(0, TILE)[None, :]
    am = tl.argmax(x, axis=1)  # the first index of the largest
    # the draw within the tile: the first column whose running sum passes u2 s_t; rounding can leave the scan short
    # of the tree sum s_t, then the last column with mass
    u2 = tl.load(u_ptr + rows * 2 + 1, mask=rmask, other=0.0)
    cs = tl.cumsum(e, axis=1)
    pos = e > 0
    first = tl.min(tl.where((cs > (u2 * st)[:, None]) & pos, idx, TILE), axis=1)
    last = tl.max(tl.where(pos, idx, -1), axis=1)
    pick = tl.where(first < TILE, first, last)
    p_at = p_ptr + rows[:, None].to(tl.int64) * VC + cols[None, :]
    if EMULATE:
        tl.store(p_at, _round(e, tl.bfloat16, EMULATE).to(tl.bfloat16), mask=rmask[:, None])
    else:
        tl.store(p_at, e.to(tl.bfloat16), mask=rmask[:, None])
    s_at = rows.to(tl.int64) * NT + pid_n  # the statistics pointers start at the chunk's first tile
    tl.store(tmax_ptr + s_at, mt, mask=rmask)
    tl.store(tsum_ptr + s_at, st, mask=rmask)
    tl.store(tw_ptr + s_at, wt, mask=rmask)
    tl.store(targ_ptr + s_at, (v0 + pid_n * TILE + am).to(tl.int32), mask=rmask)
    tl.store(tsamp_ptr + s_at, (v0 + pid_n * TILE + pick).to(tl.int32), mask=rmask)
    tl.atomic_max(m_ptr + rows * NC + chunk, mt, mask=rmask)
    if HELD:
        _held_classes(x, v0 + pid_n * TILE, rows, rmask, u_ptr, slot_ptr, order_ptr, run_ptr, key_ptr, KR, KP,
                      NT * TILE, TILE)


@triton.jit
def _soft_operands(p_ptrs, w_ptrs, k0, ks, rmask, hmask, H, V, v0, EVEN_V: tl.constexpr):
    """The soft-embedding product's operands at chunk column k0: P [BLOCK_M, BLOCK_K] and W [BLOCK_K, BLOCK_N]."""
    p = tl.load(p_ptrs + k0, mask=rmask[:, None], other=0.0)
    if EVEN_V:
        b = tl.load(w_ptrs + k0 * H, mask=hmask[None, :], other=0.0)
    else:
        b = tl.load(w_ptrs + k0 * H, mask=((v0 + k0 + ks) < V)[:, None] & hmask[None, :], other=0.0)
    return p, b


@triton.jit
def _soft_blocks(p_ptrs, w_ptr, k0, ks, rmask, n0, H, V, v0, row_bytes, KIND: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, W_DT: tl.constexpr, EMULATE: tl.constexpr):
    """`_soft_operands` where W is GGUF blocks: P [BLOCK_M, BLOCK_K] and W's rows k0 + ks of the chunk at hidden
    n0 + tile_order(BLOCK_N, KIND) (ggml_tile's own order: the caller stores its sums there), [BLOCK_K, BLOCK_N] in
    the compute dtype (float32 holding its values under EMULATE). Rows past V read row 0; their P is 0."""
    p = tl.load(p_ptrs + k0, mask=rmask[:, None], other=0.0)
    wrows = tl.where(v0 + k0 + ks < V, k0 + ks, 0).to(tl.int64)
    b = tl.trans(ggml_tile(w_ptr, wrows, n0, H, row_bytes, KIND, BLOCK_K, BLOCK_N))
    return p, to_compute(b, W_DT, EMULATE)


@triton.jit
def head_soft_kernel(p_ptr, w_ptr, tmax_ptr, m_ptr, part_ptr, R, H, V, v0, VC, NT, NC, chunk, KC, KS,
                     FIRST: tl.constexpr, EVEN_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, TILE: tl.constexpr, NC_P2: tl.constexpr, EMULATE: tl.constexpr,
                     AFTER: tl.constexpr = False, KIND: tl.constexpr = -1, row_bytes=0,
                     W_DT: tl.constexpr = tl.bfloat16):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)  # the chunk's columns [split KS, (split + 1) KS), into running sum number `split`
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if KIND >= 0:  # GGUF blocks: the hidden columns in the weight tile's own order
        hcols = pid_n * BLOCK_N + tile_order(BLOCK_N, KIND)
    else:
        hcols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < R
    hmask = hcols < H
    cidx = tl.arange(0, NC_P2)
    ms = tl.load(m_ptr + rows[:, None] * NC + cidx[None, :], mask=rmask[:, None] & (cidx[None, :] <= chunk),
                 other=-float("inf"))
    m_new = tl.where(rmask, tl.max(ms, axis=1), 0.0)  # the max over chunks 0..c, per row
    ks = tl.arange(0, BLOCK_K)
    p_ptrs = p_ptr + rows[:, None].to(tl.int64) * VC + ks[None, :]
    f_ptrs = tmax_ptr + rows.to(tl.int64) * NT  # the chunk's first tile
    w_ptrs = w_ptr + ks[:, None].to(tl.int64) * H + hcols[None, :]  # the chunk's first row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * KS
    k_hi = tl.minimum(KC, k_lo + KS)
    # KC: the chunk's columns, KS a split's: whole tiles (a step in one tile)
    if AFTER:
        # each tile's product with P as the logits kernel stored it, then the tile's factor on the float32 partial
        # sum: where the tensor cores read P from shared memory (wgmma, tcgen05), scaling P first cost a load, a
        # multiply, a repack and a store back per element of P, in each of the H / BLOCK_N programs reading it
        for t0 in range(k_lo, k_hi, TILE):
            f = tl.exp2(tl.load(f_ptrs + t0 // TILE, mask=rmask, other=0.0) - m_new)  # [BLOCK_M], <= 1
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in tl.static_range(0, TILE, BLOCK_K):
                if KIND >= 0:
                    p, b = _soft_blocks(p_ptrs, w_ptr, t0 + kk, ks, rmask, pid_n * BLOCK_N, H, V, v0, row_bytes, KIND,
                                        BLOCK_K, BLOCK_N, W_DT, EMULATE)
                else:
                    p, b = _soft_operands(p_ptrs, w_ptrs, t0 + kk, ks, rmask, hmask, H, V, v0, EVEN_V)
                if EMULATE:  # the interpreter's 16-bit products are not IEEE; these are exact in float32
                    part += tl.dot(p.to(tl.float32), b.to(tl.float32))
                else:
                    part = tl.dot(p, b, part)
            acc += part * f[:, None]
    else:  # (P, the factor, W in this order: Triton 3.6 spills with the factor first on sm_80/86/89, last on sm_120)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if KIND >= 0:
                p, b = _soft_blocks(p_ptrs, w_ptr, k0, ks, rmask, pid_n * BLOCK_N, H, V, v0, row_bytes, KIND,
                                    BLOCK_K, BLOCK_N, W_DT, EMULATE)
                f = tl.exp2(tl.load(f_ptrs + k0 // TILE, mask=rmask, other=0.0) - m_new)
            else:
                p = tl.load(p_ptrs + k0, mask=rmask[:, None], other=0.0)
                f = tl.exp2(tl.load(f_ptrs + k0 // TILE, mask=rmask, other=0.0) - m_new)  # [BLOCK_M], <= 1
                if EVEN_V:
                    b = tl.load(w_ptrs + k0 * H, mask=hmask[None, :], other=0.0)
                else:
                    b = tl.load(w_ptrs + k0 * H, mask=((v0 + k0 + ks) < V)[:, None] & hmask[None, :], other=0.0)
            # mma.sync reads P from registers: the factor in bfloat16, multiplied in bfloat16 pairs (one instruction
            # per two elements): P picks up two more roundings, each a relative 2^-9, which the sum averages out
            if EMULATE:
                a = _round(p.to(tl.float32) * _round(f, tl.bfloat16, EMULATE)[:, None], tl.bfloat16, EMULATE)
                acc += tl.dot(a, b.to(tl.float32))
            else:
                acc = tl.dot((p * f.to(tl.bfloat16)[:, None]).to(b.dtype), b, acc)
    at = part_ptr + (split * R + rows[:, None]).to(tl.int64) * H + hcols[None, :]
    mask = rmask[:, None] & hmask[None, :]
    if not FIRST:  # the running sum so far, from the max over chunks before this one to m_new
        m_old = tl.where(rmask, tl.max(tl.where(cidx[None, :] < chunk, ms, -float("inf")), axis=1), 0.0)
        acc += tl.load(at, mask=mask, other=0.0) * tl.exp2(m_old - m_new)[:, None]
    tl.store(at, acc, mask=mask)


@triton.jit
def head_finish_kernel(tmax_ptr, tsum_ptr, tw_ptr, targ_ptr, tsamp_ptr, m_ptr, part_ptr, u_ptr, soft_ptr, sample_ptr,
                       argmax_ptr, entropy_ptr, R, H, NT, NC, scale, NT_P2: tl.constexpr, NC_P2: tl.constexpr,
                       H_P2: tl.constexpr, SPLITS: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, NT_P2)
    tmask = t < NT
    at = row * NT + t
    mt = tl.load(tmax_ptr + at, mask=tmask, other=-float("inf"))
    m = tl.max(mt, axis=0)
    g = tl.exp2(mt - m)  # 0 past NT
    st = tl.load(tsum_ptr + at, mask=tmask, other=0.0)
    mass = st * g
    s = tl.sum(mass, axis=0)
    wt = tl.load(tw_ptr + at, mask=tmask, other=0.0)
    xlog = tl.sum(tl.where(tmask, g * (wt + st * (mt - m)), 0.0), axis=0)  # sum_v 2^(x - M) (x - M)
    tl.store(entropy_ptr + row, tl.log(s) - LN2 * xlog / s)
    best = tl.argmax(mt, axis=0)  # the first tile holding the max
    tl.store(argmax_ptr + row, tl.load(targ_ptr + row * NT + best).to(tl.int64))
    u1 = tl.load(u_ptr + row * 2)
    cum = tl.cumsum(mass, axis=0)
    pos = mass > 0
    first = tl.min(tl.where((cum > u1 * s) & pos, t, NT_P2), axis=0)
    last = tl.max(tl.where(pos, t, -1), axis=0)
    tile = tl.where(first < NT_P2, first, last)
    tl.store(sample_ptr + row, tl.load(tsamp_ptr + row * NT + tile).to(tl.int64))
    hh = tl.arange(0, H_P2)
    hmask = hh < H
    acc = tl.zeros((H_P2,), dtype=tl.float32)
    for k in tl.static_range(SPLITS):  # the splits' running sums, each already relative to M (the last running max)
        acc += tl.load(part_ptr + (k * R + row) * H + hh, mask=hmask, other=0.0)
    soft = acc * (scale / s)
    dt: tl.constexpr = soft_ptr.dtype.element_ty
    tl.store(soft_ptr + row * H + hh, _round(soft, dt, EMULATE).to(dt), mask=hmask)
    c = tl.arange(0, NC_P2)
    tl.store(m_ptr + row * NC + c, tl.full((NC_P2,), -float("inf"), tl.float32), mask=c < NC)


class HeadBuffers:
    """What the fused head keeps between steps for `rows` rows, allocated once per generation (or per server batch):
    the step's results (sample, argmax, entropy), the soft embedding the next step reads, and the chunk maxima (-inf
    between steps: the last kernel of a step leaves them so). `first(n)` gives views of the first n rows, `span(lo,
    n)` of rows [lo, lo + n). The step's scratch (the probabilities chunk, the tile statistics, the running sum) is
    allocated by each call: it lives while the head runs, when the layers' activations are gone, so the two share
    memory."""

    def __init__(self, rows: int, vocab: int, hidden: int, dtype: torch.dtype, device, chunk: int = CHUNK,
                 tile: int = TILE):
        if chunk % tile or tile % 64:
            raise ValueError(f"chunk {chunk} is not a multiple of tile {tile}, or the tile not one of 64 (the "
                             "soft-embedding kernel's step)")
        self.vocab, self.hidden, self.tile = vocab, hidden, tile
        self.chunk = min(chunk, triton.cdiv(vocab, tile) * tile)
        self.chunks = triton.cdiv(vocab, self.chunk)
        self.tiles = triton.cdiv(vocab, tile)
        self.chunk_max = torch.full((rows, self.chunks), -float("inf"), dtype=torch.float32, device=device)
        self.soft = torch.empty(rows, hidden, dtype=dtype, device=device)
        self.sample, self.argmax = (torch.empty(rows, dtype=torch.int64, device=device) for _ in range(2))
        self.entropy = torch.empty(rows, dtype=torch.float32, device=device)
        self.held: HeldRows | None = None  # rows held to structures: the class pass runs in the logits kernel

    def reset(self) -> None:
        """The chunk maxima back to -inf, as a completed step leaves them (after a step that stopped midway)."""
        self.chunk_max.fill_(-float("inf"))

    def first(self, rows: int) -> HeadBuffers:
        return self.span(0, rows)

    def span(self, lo: int, n: int) -> HeadBuffers:
        """Views of rows [lo, lo + n) (each buffer's rows are contiguous, so a view is one too)."""
        view = object.__new__(HeadBuffers)
        view.__dict__.update({k: (v[lo : lo + n] if isinstance(v, torch.Tensor) else v)
                              for k, v in self.__dict__.items()})
        view.held = None if self.held is None else self.held.span(lo, n)
        return view

    @property
    def rows(self) -> int:
        return self.soft.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(v.untyped_storage().nbytes() for v in self.__dict__.values() if isinstance(v, torch.Tensor))


class HeldRows:
    """The rows of a step held to structures, whose class pass the logits kernel runs (`_held_classes`): slot int32
    [rows] (-1: a free row; else its structure's row of the tables), order and run int32 [slots, tiles x TILE] (each
    structure's tile tables, dgemma_cli/structured/device_search.py `DeviceTables.tile_runs`, for this head's
    TILE), keys int64 [2, rows, width] (best and drawn keys per row and class; KEY_MIN before the head runs: the
    search's programme sets back what it read)."""

    def __init__(self, slot: torch.Tensor, order: torch.Tensor, run: torch.Tensor, keys: torch.Tensor):
        self.slot, self.order, self.run, self.keys = slot, order, run, keys

    def span(self, lo: int, n: int) -> HeldRows:
        return HeldRows(self.slot[lo : lo + n], self.order, self.run, self.keys[:, lo : lo + n])


def _settings(device: torch.device, blocks: bool = False) -> dict:
    """Launch settings per kernel; blocks: the weight is GGUF blocks (the logits kernel's K step then 128, half a
    super-block: ggml_tile's smallest tile of the 256-weight types, whole blocks of the others)."""
    cc = arch(device)
    big = shared_b_operand(cc)  # Hopper / datacenter Blackwell: 227 KB of shared memory, wgmma / tcgen05
    # sm_100 reads the accumulator out of tensor memory for the epilogue: 16 warps keep it in registers (8 spill)
    return dict(logits=dict(BLOCK_M=64, BLOCK_K=128 if blocks else 64, num_warps=16 if cc == 100 else 8,
                            num_stages=3 if big else 2),
                # AFTER: each vocab tile's factor on the partial sum where the tensor cores read P from shared memory
                # (two stages of a whole tile's operands: 96 KB, two programs an SM). sm_90: the tile in one product
                # (BLOCK_K = TILE): as two, Triton gave the first its own layout, both warpgroups computed it whole
                # and it went through shared memory to the second's (12 wgmma a tile for 8, 238 instructions for 165)
                soft=dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128 if cc == 90 else 64, num_warps=8 if cc == 90 else 4,
                          num_stages=2 if big else 3, AFTER=big))


def _splits(device: torch.device, programs: int, tiles: int) -> int:
    """How many ways the soft-embedding kernel splits a chunk's columns: its grid of `programs` output tiles is
    smaller than the GPU at batch 1 (88 at the real shapes on 128-170 SMs), so the split with the fewest waves per
    unit of work, at most 8 (`kernels.fewest_waves`); one where the SM count is unknown (the interpreter)."""
    return max(1, min(fewest_waves(device, programs, range(1, 9)), tiles))


def fused_head(h: torch.Tensor, weight: torch.Tensor, cap: float | None, scale: float, temperature: torch.Tensor,
               uniforms: torch.Tensor, buf: HeadBuffers, splits: int | None = None,
               kind: str | None = None) -> HeadBuffers:
    """h [R, H] (final-normed hidden), weight [V, H], temperature float32 [R], uniforms float32 [R, 2] -> buf with
    sample, argmax, entropy [R] and soft [R, H] written (as the module docstring says). `scale`: the embedding scale
    sqrt(H) as the model holds it. splits: how many ways the soft embedding splits a chunk's columns (each split a
    running sum of its own, added up at the end); None: `_splits` for the GPU. kind: the weight is GGUF blocks of
    that type (uint8 [V, row bytes], quant/ggml.py; the published files' embedding is Q6_K), read where they lie by
    both kernels (ggml_tile), each weight rounded to h's dtype as the decoded 16-bit embedding holds it."""
    from .. import ggml
    from ..ggml_modules import fused_head_fits
    from .ggml_decode import KINDS

    R, H = h.shape
    V = weight.shape[0]
    if kind is not None:
        if kind not in ggml.BLOCK_KINDS or weight.dtype != torch.uint8 or weight.shape[1] != ggml.row_bytes(kind, H):
            raise ValueError(f"a GGUF head of {kind} cannot read a {weight.dtype} weight {tuple(weight.shape)} "
                             f"for hidden {H}")
        if not fused_head_fits(kind, H):
            raise ValueError(f"a GGUF head of {kind} needs the hidden size in whole tiles (got {H})")
    if (V, H) != (buf.vocab, buf.hidden) or buf.rows < R or (kind is None and weight.shape[1] != H):
        raise ValueError(f"head buffers for vocab {buf.vocab} x hidden {buf.hidden} and {buf.rows} rows "
                         f"cannot take h {tuple(h.shape)} and weight {tuple(weight.shape)}")
    if R == 0:
        return buf
    h, weight = h.contiguous(), weight.contiguous()
    temperature, uniforms = temperature.contiguous(), uniforms.contiguous()
    cfg = _settings(h.device, kind is not None)
    lg, sf = cfg["logits"], cfg["soft"]
    gguf = dict(KIND=KINDS.index(kind), row_bytes=weight.shape[1]) if kind is not None else {}
    tile, VC, NT, NC = buf.tile, buf.chunk, buf.tiles, buf.chunks
    emulate = interpreting()
    nc_p2 = triton.next_power_of_2(NC)
    dev = h.device
    probs = torch.empty(R, VC, dtype=torch.bfloat16, device=dev)  # one chunk's, unnormalised
    stats = torch.empty(3, R, NT, dtype=torch.float32, device=dev)  # tile max, sum, sum 2^(x - max) (x - max)
    picks = torch.empty(2, R, NT, dtype=torch.int32, device=dev)  # tile argmax, tile draw (vocab indices)
    soft_grid = (triton.cdiv(R, sf["BLOCK_M"]), triton.cdiv(H, sf["BLOCK_N"]))
    S = splits or _splits(dev, soft_grid[0] * soft_grid[1], VC // tile)
    running = torch.empty(S, R, H, dtype=torch.float32, device=dev)  # the soft embedding's running sums, per split
    held = buf.held
    if held is not None:
        if held.order.shape[1] != NT * tile:
            raise ValueError(f"held rows' tile tables span {held.order.shape[1]} tokens, the head's tiles {NT * tile}")
        held_args = (held.slot, held.order, held.run, held.keys)
        held_strides = (held.keys.stride(1), held.keys.stride(0))
    else:  # no held row: the pointers are not read
        held_args, held_strides = (buf.chunk_max,) * 4, (0, 0)
    for c in range(NC):
        v0 = c * VC
        width = min(VC, V - v0)
        tiles = triton.cdiv(width, tile)
        # views of what a chunk touches: the embedding's rows, the statistics' tiles (strides as the whole's)
        w, t0 = weight[v0 : v0 + width], v0 // tile
        tmax, tsum, tw = stats[:, :, t0 : t0 + tiles]
        targ, tsamp = picks[:, :, t0 : t0 + tiles]
        p = probs[:, : tiles * tile]
        head_logits_kernel[(triton.cdiv(R, lg["BLOCK_M"]), tiles)](
            h, w, temperature, uniforms, p, tmax, tsum, tw, targ, tsamp, buf.chunk_max, *held_args, R, H, V, v0, VC,
            NT, NC, c, float(cap or 0.0), *held_strides, bool(cap), H % lg["BLOCK_K"] == 0, lg["BLOCK_M"], tile,
            lg["BLOCK_K"], emulate, held is not None, num_warps=lg["num_warps"], num_stages=lg["num_stages"], **gguf)
        per_split = triton.cdiv(triton.cdiv(VC, tile), S) * tile  # whole tiles a split (of a full chunk)
        head_soft_kernel[soft_grid + (S,)](
            p, w, tmax, buf.chunk_max, running, R, H, V, v0, VC, NT, NC, c, tiles * tile, per_split,
            c == 0, V % tile == 0, sf["BLOCK_M"], sf["BLOCK_N"], sf["BLOCK_K"], tile, nc_p2, emulate, sf["AFTER"],
            num_warps=sf["num_warps"], num_stages=sf["num_stages"],
            **(dict(gguf, W_DT=tl.float16 if h.dtype == torch.float16 else tl.bfloat16) if gguf else {}))
    first = buf.first(R)
    head_finish_kernel[(R,)](stats[0], stats[1], stats[2], picks[0], picks[1], first.chunk_max, running, uniforms,
                             first.soft, first.sample, first.argmax, first.entropy, R, H, NT, NC, float(scale),
                             triton.next_power_of_2(NT), nc_p2, triton.next_power_of_2(H), S, emulate, num_warps=8)
    return buf


def head_reference(h: torch.Tensor, weight: torch.Tensor, cap: float | None, scale: float, temperature: torch.Tensor,
                   uniforms: torch.Tensor, tile: int = TILE) -> tuple[torch.Tensor, ...]:
    """The same head in torch ops, float32 throughout (for the checks): (sample, argmax, entropy, soft float32).

    The draw is the same function of the uniforms: u1 picks a tile by inverse CDF of the tile masses, u2 a column
    within it by inverse CDF of the tile's own probabilities; entropy and soft are of softmax(capped logits / t)."""
    l = h.float() @ weight.float().t()
    if cap:
        l = torch.tanh(l / cap) * cap
    R, V = l.shape
    z = l / temperature.float().view(R, 1)
    p = torch.softmax(z, dim=-1)
    entropy = -(p * torch.log_softmax(z, dim=-1)).sum(-1)
    argmax = z.argmax(-1)
    soft = p @ weight.float() * scale
    nt = -(-V // tile)
    zt = torch.full((R, nt * tile), -float("inf"))
    zt[:, :V] = z
    zt = zt.view(R, nt, tile)
    mt = zt.amax(-1, keepdim=True)
    e = torch.exp(zt - mt)  # [R, NT, TILE]
    st = e.sum(-1)
    mass = st * torch.exp(mt.squeeze(-1) - mt.amax(1))
    cum = mass.cumsum(-1)
    u1, u2 = uniforms[:, 0:1].float(), uniforms[:, 1:2].float()
    pick_t = torch.where(cum > u1 * mass.sum(-1, keepdim=True), torch.arange(nt), nt).amin(-1)
    pick_t = torch.minimum(pick_t, (mass > 0).float().cumsum(-1).argmax(-1))  # rounding: the last tile with mass
    rows = torch.arange(R)
    et, s = e[rows, pick_t], st[rows, pick_t][:, None]
    within = torch.where(et.cumsum(-1) > u2 * s, torch.arange(tile), tile).amin(-1)
    within = torch.minimum(within, (et > 0).float().cumsum(-1).argmax(-1))
    return pick_t * tile + within, argmax, entropy, soft
