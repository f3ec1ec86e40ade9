"""The dynamic programme of a held row's search on the device: the best path through a structure's automaton over
the canvas's positions, and its tokens, written where the sampler reads them (docs/design.md, Constrained canvases:
the search on the device). It follows the class pass (class_pass.py) and reads nothing from the host during a step.

The same programme as dgemma_cli/structured/constrain.py `host_path`, over the automaton's edges sorted by target:
    best[0] = 0 at the row's state, -inf elsewhere
    best[p + 1][t] = max over edges e into t of best[p][src e] + w[p, set e]
where w[p, s] is the best key of the token set s at p: the max over the set's classes of the class pass's keys (the
edges of one set share it, as an integer's digits in every integer field do). The path ends at the feasible state
(at most `after` tokens from acceptance) of the highest best[room], else at the best state at all (ok = 0: an
answer cut short); it is traced back through the edge each state took at each position (`back` [P, S]).

One program per search (0: the argmax path on the class pass's best keys, 1: the drawn path on its noisy ones), of
BLOCK lanes, positions in order: per position the sets' keys (a segmented max-scan over set -> class pairs sorted by
set), a barrier, the targets' values (a segmented max-scan over edges sorted by target, each run carried across the
lanes' chunks, each target written once, by the lane of its last edge), a barrier. A search is a few thousand to a
few million (position, edge) pairs (the 50-property form of BENCHMARKS: 256 x 15,322): one SM's work, not worth a
grid's synchronisation; its time on a GPU is not measured. With `reset` (the fused head's keys, which the head maxes
into) each program sets its plane of the keys back to KEY_MIN at its end (both planes where only the argmax is
searched).

Operands: keys int64 [2, P, NB] (class_pass's out); pair_set, pair_blk int32 [NSB] (set -> class pairs, by set);
e_src, e_set, e_dst int32 [E] (by target); dist int32 [S] (tokens to acceptance); meta int32 [3] = (state, room,
after) on the device (written at a canvas's start); scratch: setk int64 [2, P, NS], vals float32 [2, 3, S], back
int32 [2, P, S] (P: the canvas); keys' planes KP and rows KROW elements apart; outputs: out0, out1 int64 [C] (the
argmax path, the drawn path: pad past room, and everywhere when no path exists), ok int32 [2].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting
from .class_pass import keep_max, pack, unpack_index, unpack_value

KMIN: tl.constexpr = tl.constexpr(-(1 << 63))  # below every key


@triton.jit
def _last_of(seg, key, lanes, n):
    """The segment and key at lane n - 1 (the chunk's last live lane): what the next chunk's first run continues."""
    at = lanes == n - 1
    return tl.max(tl.where(at, seg, -1)), tl.max(tl.where(at, key, KMIN))


@triton.jit
def automaton_dp_kernel(key_ptr, pair_set_ptr, pair_blk_ptr, e_src_ptr, e_set_ptr, e_dst_ptr, dist_ptr, meta_ptr,
                        setk_ptr, val_ptr, back_ptr, out0_ptr, out1_ptr, ok_ptr,
                        P, NB, KP, KROW, NS, NSB, E, S, C, pad_id, SEARCHES, RESET: tl.constexpr,
                        BLOCK: tl.constexpr):
    which = tl.program_id(0)
    state = tl.load(meta_ptr)
    room = tl.load(meta_ptr + 1)
    after = tl.load(meta_ptr + 2)
    key_ptr += which.to(tl.int64) * KP
    setk_ptr += which.to(tl.int64) * P * NS
    val_ptr += which.to(tl.int64) * 3 * S
    back_ptr += which.to(tl.int64) * P * S
    lanes = tl.arange(0, BLOCK)
    NEG = -float("inf")
    # values: buffer 0 the start (0 at the state), buffers 1 and 2 alternate; a state no edge enters stays -inf
    for s0 in range(0, S, BLOCK):
        s = s0 + lanes
        m = s < S
        tl.store(val_ptr + s, tl.where(s == state, 0.0, NEG), mask=m)
        tl.store(val_ptr + S + s, tl.full([BLOCK], NEG, tl.float32), mask=m)
        tl.store(val_ptr + 2 * S + s, tl.full([BLOCK], NEG, tl.float32), mask=m)
    tl.debug_barrier()
    for p in range(0, room):
        cur = val_ptr + tl.where(p == 0, 0, 1 + (p - 1) % 2) * S
        nxt = val_ptr + (1 + p % 2) * S
        kp = key_ptr + p * KROW
        sk = setk_ptr + p * NS
        # the sets' keys at p: max over each set's classes
        c_seg = -1
        c_key = KMIN
        for i0 in range(0, NSB, BLOCK):
            i = i0 + lanes
            m = i < NSB
            seg = tl.load(pair_set_ptr + i, mask=m, other=-1)
            nseg = tl.load(pair_set_ptr + i + 1, mask=i + 1 < NSB, other=-1)
            k = tl.load(kp + tl.load(pair_blk_ptr + i, mask=m, other=0), mask=m, other=KMIN)
            _, k = tl.associative_scan((seg, k), 0, keep_max)
            k = tl.where(seg == c_seg, tl.maximum(k, c_key), k)
            tl.store(sk + seg, k, mask=m & (seg != nseg))
            c_seg, c_key = _last_of(seg, k, lanes, tl.minimum(NSB - i0, BLOCK))
        tl.debug_barrier()
        # the targets' values at p + 1, and the edge each took
        c_seg = -1
        c_key = KMIN
        for i0 in range(0, E, BLOCK):
            i = i0 + lanes
            m = i < E
            d = tl.load(e_dst_ptr + i, mask=m, other=-1)
            nd = tl.load(e_dst_ptr + i + 1, mask=i + 1 < E, other=-1)
            v = tl.load(cur + tl.load(e_src_ptr + i, mask=m, other=0), mask=m, other=NEG)
            w = unpack_value(tl.load(sk + tl.load(e_set_ptr + i, mask=m, other=0), mask=m, other=0))
            _, k = tl.associative_scan((d, pack(tl.where(m, v + w, NEG), i)), 0, keep_max)
            k = tl.where(d == c_seg, tl.maximum(k, c_key), k)
            end = m & (d != nd)
            tl.store(nxt + d, unpack_value(k), mask=end)
            tl.store(back_ptr + p * S + d, unpack_index(k), mask=end)
            c_seg, c_key = _last_of(d, k, lanes, tl.minimum(E - i0, BLOCK))
        tl.debug_barrier()
    # where the path ends: the best feasible state, else the best state
    fin = val_ptr + tl.where(room == 0, 0, 1 + (room - 1) % 2) * S
    best_ok = KMIN
    best_any = KMIN
    for s0 in range(0, S, BLOCK):
        s = s0 + lanes
        m = s < S
        v = tl.load(fin + s, mask=m, other=NEG)
        dist = tl.load(dist_ptr + s, mask=m, other=1 << 30)
        best_ok = tl.maximum(best_ok, tl.max(tl.where(m & (dist <= after), pack(v, s), KMIN)))
        best_any = tl.maximum(best_any, tl.max(tl.where(m, pack(v, s), KMIN)))
    ok = unpack_value(best_ok) > NEG
    end_key = tl.where(ok, best_ok, best_any)
    found = unpack_value(end_key) > NEG
    at = unpack_index(end_key)
    out_ptr = tl.where(which == 0, out0_ptr, out1_ptr)
    for q in range(0, room):  # the back-trace: one edge a position, from the last
        p = room - 1 - q
        e = tl.load(back_ptr + p * S + at)
        tok = unpack_index(tl.load(setk_ptr + p * NS + tl.load(e_set_ptr + e)))
        tl.store(out_ptr + p, tl.where(found, tok, pad_id).to(tl.int64))
        at = tl.where(found, tl.load(e_src_ptr + e), at)
    for c0 in range(0, C, BLOCK):
        c = c0 + lanes
        tl.store(out_ptr + c, tl.full([BLOCK], pad_id, tl.int64), mask=(c < C) & (c >= room))
    tl.store(ok_ptr + which, ok.to(tl.int32))
    if RESET:  # the keys back to KEY_MIN for the next step's head (both planes where only the argmax is searched)
        for q in range(which, 2 - SEARCHES + 1 + which):
            plane = key_ptr + (q - which).to(tl.int64) * KP
            for i0 in range(0, C * NB, BLOCK):
                i = i0 + lanes
                tl.store(plane + (i // NB) * KROW + i % NB, tl.full([BLOCK], KMIN, tl.int64), mask=i < C * NB)


def automaton_dp(keys: torch.Tensor, pair_set: torch.Tensor, pair_blk: torch.Tensor, sets: int, e_src: torch.Tensor,
                 e_set: torch.Tensor, e_dst: torch.Tensor, dist: torch.Tensor, meta: torch.Tensor,
                 scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], out0: torch.Tensor, out1: torch.Tensor,
                 ok: torch.Tensor, pad_id: int, searches: int, reset: bool = False) -> None:
    """One kernel: searches 1 (the argmax path into out0) or 2 (and the drawn path into out1). keys [2, C, >= NB]
    (rows KROW apart, planes KP); reset: set them back to KEY_MIN after reading (the fused head's keys, which it
    maxes into)."""
    NB = keys.shape[2]
    setk, vals, back = scratch
    P = setk.shape[1]
    automaton_dp_kernel[(searches,)](
        keys, pair_set, pair_blk, e_src, e_set, e_dst, dist, meta, setk, vals, back, out0, out1, ok,
        P, NB, keys.stride(0), keys.stride(1), sets, pair_set.numel(), e_src.numel(), dist.numel(), out0.numel(),
        pad_id, searches, reset, 64 if interpreting() else 1024, num_warps=8)  # the interpreter's scan calls its combine once a lane
