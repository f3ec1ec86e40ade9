"""The class pass of a held row's search: one read of the row's log-probabilities, each token class's best token per
position, and its best under Gumbel noise (docs/design.md, Constrained canvases: the search on the device).

A structure's automaton treats tokens in classes (dgemma_cli/structured/device_search.py `DeviceTables`: tokens
every edge of the automaton takes or leaves together share a class). The search needs, per canvas position p and
class c, the best token of c at p (the argmax path) and the best token of c under per-token Gumbel noise (the drawn
path: the max over a set of tokens of log-probability plus independent Gumbel noise is a draw from the distribution
restricted to the set, and its value is the set's log-mass plus one Gumbel draw, so sets that are unions of classes
take the max over their classes, exactly).

Operands: score float32 [P, V] (row stride `stride`: a canvas's rows of the sampler's buffer), perm int32 [T]: the
tokens some class holds, in class order, blk int32 [T]: each one's class (non-decreasing), seed int64 [1] on the
device (the row's generator draws it: no host value), out int64 [2, P, NB]: packed keys (`pack`), which the caller
fills with KEY_MIN first. Programs of BLOCK_P positions x BLOCK_V tokens of perm: the scores gathered through perm
(a class's tokens are in id order, so the big classes read rows nearly in order), a segmented max-scan along the
tokens (classes are runs of perm), and at each run's last token an atomic max into its (position, class) slot: one
atomic per run a program holds, not per token. The noise is Triton's philox (`tl.rand`) at offset p V + token, which
`philox_uniform` below repeats in numpy for the reference.

A key packs a score and its token so that one integer max picks the highest score and, among equal ones, the lowest
token: the float's bits mapped to an int32 of the same order in the high half, 2^31 - 1 - token in the low half.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from . import interpreting

KEY_MIN = -(1 << 63)  # below every key a score makes (no class is left without one: every class holds a token)


def _blocks() -> tuple[int, int]:
    """(BLOCK_P, BLOCK_V): 4 x 1024 on a GPU; small under the interpreter, whose scan calls its combine once a lane."""
    return (2, 128) if interpreting() else (4, 1024)


@triton.jit
def _ordered(x):
    """float32 -> int32 of the same order (a negative's bits below the sign flipped)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def pack(x, index):
    """float32 score and int32 index -> int64 key (higher score first, then the lower index)."""
    return (_ordered(x).to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def unpack_value(key):
    o = (key >> 32).to(tl.int32)
    return tl.where(o >= 0, o, o ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def unpack_index(key):
    return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def keep_max(seg_a, key_a, seg_b, key_b):
    """The segmented max-scan's step: a run's running max, restarted where the run (class, state, set) changes.
    Associative where runs are contiguous, as they are here."""
    return seg_b, tl.where(seg_a == seg_b, tl.maximum(key_a, key_b), key_b)


@triton.jit
def keep_max2(seg_a, best_a, drawn_a, seg_b, best_b, drawn_b):
    """keep_max over two keys of the same runs at once."""
    same = seg_a == seg_b
    return seg_b, tl.where(same, tl.maximum(best_a, best_b), best_b), tl.where(same, tl.maximum(drawn_a, drawn_b),
                                                                              drawn_b)


@triton.jit
def class_pass_kernel(score_ptr, perm_ptr, blk_ptr, seed_ptr, out_ptr, P, V, T, NB, stride, plane,
                      DRAW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr):
    pid_v = tl.program_id(0)  # token blocks vary fastest: programs reading one row run together
    pid_p = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_V)
    j = pid_v * BLOCK_V + lanes
    live = j < T
    tok = tl.load(perm_ptr + j, mask=live, other=0)
    blk = tl.load(blk_ptr + j, mask=live, other=-1)
    after = tl.load(blk_ptr + j + 1, mask=j + 1 < T, other=-1)
    last = live & ((blk != after) | (lanes == BLOCK_V - 1))  # a run's last token in this program
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    m = (rows < P)[:, None] & live[None, :]
    x = tl.load(score_ptr + rows[:, None].to(tl.int64) * stride + tok[None, :], mask=m, other=-float("inf"))
    seg = tl.broadcast_to(blk[None, :], (BLOCK_P, BLOCK_V))
    at = out_ptr + rows[:, None].to(tl.int64) * NB + blk[None, :]
    if DRAW:
        seed = tl.load(seed_ptr)
        u = tl.rand(seed, rows[:, None] * V + tok[None, :])
        g = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        _, best, drawn = tl.associative_scan((seg, pack(x, tok[None, :]), pack(x + g, tok[None, :])), 1, keep_max2)
        tl.atomic_max(at + plane, drawn, mask=m & last[None, :])
    else:
        _, best = tl.associative_scan((seg, pack(x, tok[None, :])), 1, keep_max)
    tl.atomic_max(at, best, mask=m & last[None, :])


def class_pass(score: torch.Tensor, perm: torch.Tensor, blk: torch.Tensor, classes: int, seed: torch.Tensor | None,
               out: torch.Tensor) -> torch.Tensor:
    """score float32 [P, V] (rows contiguous) -> out int64 [2, P, classes] (0: best, 1: drawn, when seed is given;
    a view whose planes are `out.stride(0)` apart, rows contiguous), filled here. Two kernels: the fill and the
    pass."""
    P, V = score.shape
    T = perm.numel()
    if P * V >= 1 << 31:
        raise ValueError(f"{P} x {V} scores: the noise's offsets need P x V < 2^31")
    if score.stride(1) != 1:
        raise ValueError("the scores' rows must be contiguous")
    out.fill_(KEY_MIN)
    if T == 0 or P == 0:
        return out
    draw = seed is not None
    BLOCK_P, BLOCK_V = _blocks()
    class_pass_kernel[(triton.cdiv(T, BLOCK_V), triton.cdiv(P, BLOCK_P))](
        score, perm, blk, seed if draw else perm, out, P, V, T, classes, score.stride(0), out.stride(0), draw,
        BLOCK_P, BLOCK_V,
        num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------ the reference


def keys_of(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pack, in torch: float32 value and integer index -> int64 key."""
    b = value.float().contiguous().view(torch.int32).long()
    o = torch.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (o << 32) | (0x7FFFFFFF - index.long())


def values_of(key: torch.Tensor) -> torch.Tensor:
    o = (key >> 32).to(torch.int32)
    return torch.where(o >= 0, o, o ^ 0x7FFFFFFF).view(torch.float32)


def indices_of(key: torch.Tensor) -> torch.Tensor:
    return 0x7FFFFFFF - (key & 0x7FFFFFFF)


_M32 = np.uint64(0xFFFFFFFF)


def philox_uniform(seed: int, offsets: np.ndarray) -> np.ndarray:
    """What `tl.rand(seed, offsets)` gives for int32 offsets: philox 4x32 with 10 rounds on (offset, 0, 0, 0) keyed
    by the seed's halves, its first word mapped to [0, 1) as triton.language.random maps an int32."""
    c0 = offsets.astype(np.uint64) & _M32
    c1 = np.zeros_like(c0)
    c2 = np.zeros_like(c0)
    c3 = np.zeros_like(c0)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)
    A, B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):
        p0, p2 = A * c0, B * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (p2 >> np.uint64(32)) ^ c1 ^ k0, p2 & _M32, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & _M32, (k1 + np.uint64(0xBB67AE85)) & _M32
    x = c0.astype(np.uint32).view(np.int32).astype(np.int64)
    x = np.where(x < 0, -x - 1, x).astype(np.int32)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def class_pass_reference(score: torch.Tensor, perm: torch.Tensor, blk: torch.Tensor, classes: int,
                         seed: int | None) -> torch.Tensor:
    """class_pass in torch (float32, the same noise from the same seed): int64 [2, P, classes]."""
    P, V = score.shape
    tok = perm.long().cpu()
    b = blk.long().cpu()
    x = score.float().cpu()[:, tok]  # [P, T]
    out = torch.full((2, P, classes), KEY_MIN, dtype=torch.int64)
    idx = b.expand(P, -1)
    out[0].scatter_reduce_(1, idx, keys_of(x, tok.expand(P, -1)), "amax")
    if seed is not None:
        offsets = (np.arange(P, dtype=np.int64)[:, None] * V + tok.numpy()[None, :]).astype(np.int32)
        u = torch.from_numpy(philox_uniform(int(seed), offsets))
        g = -torch.log(-torch.log(u.clamp(min=1e-20)))
        out[1].scatter_reduce_(1, idx, keys_of(x + g, tok.expand(P, -1)), "amax")
    return out
