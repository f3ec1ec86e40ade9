"""A held row's search on the host, over token classes (docs/design.md, Constrained canvases: the search on the
host): the device's classes and edges (device_search.DeviceTables), one gather of the tokens outside the biggest
class, segmented reductions over them, and one dynamic programme for both paths.

Per position and class the search needs the class's best score (for the argmax path) and its log-mass (for the
drawn path: the max over a class of log-probability plus Gumbel noise is distributed as the class's log-mass plus
one Gumbel draw, and its token, independently of it, as a draw from the distribution restricted to the class;
classes are disjoint, so one Gumbel draw per position and class is exactly per-token noise). A set's value is the
best of its classes'.

The biggest class (a string's characters: most of the vocabulary) is never gathered:
- its log-mass is what the other tokens leave of 1 (the scores are log-probabilities), taken from the row itself
  where that difference would lose its precision;
- its best score is the position's best (the sampler's argmax) where that token lies in it, and is read from the row
  only at positions where a set holding the class lacks the class of the position's best token (everywhere else,
  every set holding it also holds a better token, so its exact value decides nothing);
- its token on a path is the sampler's argmax, or its free draw, where that lies in the class (a draw that landed in
  it is a draw from the distribution restricted to it), else read from that row.

The gather is the cost: on this CPU it reads a column about 5x slower than a pass streams it, and the structures of
BENCHMARKS.md put a fifth of the vocabulary outside the biggest class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .device_search import DeviceTables, device_tables


def host_tables(auto, end_ids, pad_id: int) -> "HostTables":
    """The automaton's host tables for these end ids and pad, made once (kept with its DeviceTables, which
    device_tables caches on the automaton)."""
    t = device_tables(auto, end_ids, pad_id)
    if "_host" not in t.__dict__:
        t._host = HostTables(t)
    return t._host


class HostTables:
    """DeviceTables laid out for the host's pass (module docstring)."""

    def __init__(self, t: DeviceTables):
        self.t = t
        K = t.classes
        size = np.bincount(t.blk, minlength=K)
        self.big = int(np.argmax(size)) if K else -1
        cls = t.class_of.astype(np.int64)
        cls[cls < 0] = K  # class K: tokens no set holds (read only for the big class's log-mass)
        self.class_of = cls
        rest = np.flatnonzero(cls != self.big)
        rest = rest[np.argsort(cls[rest], kind="stable")]  # class-major, tokens ascending within a class
        self.cols = torch.from_numpy(rest)
        seg_class = cls[rest]
        self.starts = np.flatnonzero(np.r_[True, seg_class[1:] != seg_class[:-1]]) if rest.size else \
            np.zeros(0, dtype=np.int64)
        self.ends = np.r_[self.starts[1:], rest.size].astype(np.int64)
        self.sizes = self.ends - self.starts
        self.seg_class = seg_class[self.starts]
        self.seg_of_class = np.full(K + 1, -1, dtype=np.int64)
        self.seg_of_class[self.seg_class] = np.arange(self.seg_class.size)
        self.big_mask = torch.from_numpy(cls == self.big)
        self._copies: dict = {}  # (name, device) -> a table copied there
        # sets as runs of (set, class) pairs (DeviceTables makes them set by set, in order)
        ps, pb = t.pair_set.astype(np.int64), t.pair_blk.astype(np.int64)
        self.pair_set, self.pair_blk = ps, pb
        self.set_start = np.searchsorted(ps, np.arange(t.sets))
        self.set_end = np.searchsorted(ps, np.arange(t.sets), side="right")
        self.set_empty = self.set_start == self.set_end
        has = np.zeros((t.sets, K + 1), dtype=bool)
        has[ps, pb] = True
        holds_big = has[:, self.big] if K else np.zeros(t.sets, dtype=bool)
        # unsure[c]: a position whose best token is of class c needs the big class's own best (a set holding the big
        # class lacks class c)
        self.unsure = (holds_big[:, None] & ~has).any(axis=0)
        # the programme's edges, sorted by target as the device's
        self.e_src, self.e_set, self.e_dst = (a.astype(np.int64) for a in (t.e_src, t.e_set, t.e_dst))
        self.dist = t.dist.astype(np.int64)

    def outside(self, device) -> torch.Tensor:
        """bool [V] on `device`: the tokens outside the biggest class (copied there once)."""
        return self._on("outside", device, lambda: ~self.big_mask)

    def cols_on(self, device) -> torch.Tensor:
        """`cols` on `device` (copied there once)."""
        return self._on("cols", device, lambda: self.cols)

    def _on(self, name: str, device, make) -> torch.Tensor:
        key = (name, torch.device(device))
        if key not in self._copies:
            self._copies[key] = make().to(key[1])
        return self._copies[key]


@dataclass
class ClassValues:
    """One step's per-class values over a row's positions (HostTables.values)."""

    best: np.ndarray  # [P, K + 1] float32: each class's best score (the big class's where it can decide)
    drawn: np.ndarray | None  # [P, K + 1]: each class's log-mass plus a Gumbel draw (None: argmax only)
    mass: np.ndarray | None  # [P, K + 1]: each class's log-mass (None: argmax only)
    X: np.ndarray  # [P, N]: the gathered scores, class-major (HostTables.cols)
    big_token: dict  # position -> the big class's best token where it was read from the row


def values(h: HostTables, score: torch.Tensor, argmax: torch.Tensor, drawing: bool,
           gen: torch.Generator | None) -> ClassValues:
    """score [P, V] log-probabilities; argmax [P]: each position's best token (the sampler's)."""
    P, K = score.shape[0], h.t.classes
    Xt = score.gather(1, h.cols_on(score.device).expand(P, -1)).cpu() if h.cols.numel() else \
        torch.zeros((P, 0), dtype=torch.float32)
    X = Xt.numpy()
    best = np.full((P, K + 1), -np.inf, dtype=np.float32)
    M = np.maximum.reduceat(X, h.starts, axis=1) if X.shape[1] else np.zeros((P, 0), dtype=np.float32)
    best[:, h.seg_class] = M
    big_token: dict = {}
    if h.big >= 0:
        am = argmax.cpu().numpy()
        hint_cls = h.class_of[am]
        top = score.gather(1, argmax.to(score.device)[:, None])[:, 0].cpu().numpy()
        inside = hint_cls == h.big
        best[inside, h.big] = top[inside]
        need = np.flatnonzero(~inside & h.unsure[hint_cls])
        if need.size:  # a set holding the big class lacks these positions' best token: its own best, from the rows
            rows = torch.from_numpy(need).to(score.device)
            v, i = score.index_select(0, rows).masked_fill_(h.outside(score.device), -math.inf).max(dim=1)
            best[need, h.big] = v.cpu().numpy()
            big_token = dict(zip(need.tolist(), i.cpu().tolist()))
    drawn = mass = None
    if drawing:
        finite = np.isfinite(M)
        Mf = np.where(finite, M, 0).astype(np.float32)
        shift = torch.from_numpy(np.repeat(Mf, h.sizes, axis=1))
        E = torch.sub(Xt, shift, out=shift).exp_().numpy()  # torch's exp: vectorized, on every core
        with np.errstate(divide="ignore"):
            L = np.where(finite, np.log(np.add.reduceat(E, h.starts, axis=1)) + Mf, -np.inf) if E.shape[1] else M
        mass = np.full((P, K + 1), -np.inf, dtype=np.float32)
        mass[:, h.seg_class] = L
        if h.big >= 0:
            outside = np.logaddexp.reduce(L, axis=1) if L.shape[1] else np.full(P, -np.inf, dtype=np.float32)
            with np.errstate(invalid="ignore", divide="ignore"):
                mass[:, h.big] = np.log(-np.expm1(np.minimum(outside, 0)))
            close = np.flatnonzero(outside > -1e-4)  # nearly all the mass outside: the class's own sum
            if close.size:
                rows = torch.from_numpy(close).to(score.device)
                own = score[rows].masked_fill(h.outside(score.device), -math.inf)
                mass[close, h.big] = torch.logsumexp(own, dim=1).cpu().numpy()
        noise = torch.empty((P, K + 1), device=gen.device if gen is not None else "cpu").uniform_(generator=gen)
        noise = -torch.log(-torch.log(noise.clamp_(min=1e-20)))
        drawn = mass + noise.cpu().numpy()
    return ClassValues(best, drawn, mass, X, big_token)


def search(h: HostTables, score: torch.Tensor, state: int, after: int, argmax: torch.Tensor | None,
           draw: torch.Tensor | None, drawing: bool, gen: torch.Generator | None) -> list:
    """The argmax path and, if `drawing`, the drawn one over score [room, V] (log-probabilities) from `state`, within
    `after` tokens after the canvas. argmax [room]: each position's best token, the sampler's (None: made here);
    draw [room]: its free draw (None: none made). Returns per path (tokens [room] int64 numpy, or None where no path
    exists at all; ok: it keeps within the limit)."""
    if argmax is None:
        argmax = score.argmax(dim=1)
    cv = values(h, score, argmax, drawing, gen)
    tables = [cv.best] + ([cv.drawn] if drawing else [])
    sv = np.stack([set_values(h, v) for v in tables])
    edges, ok, found = programme(h.e_src, h.e_set, h.e_dst, h.dist, sv, state, after)
    am = argmax.cpu().numpy()
    dr = None if draw is None else draw.cpu().numpy()
    out = []
    for i, v in enumerate(tables):
        if not found[i]:
            out.append((None, False))
            continue
        out.append((_tokens(h, score, cv, v, edges[i], am if i == 0 else dr, drawn=i == 1, gen=gen), bool(ok[i])))
    return out


def _tokens(h: HostTables, score: torch.Tensor, cv: ClassValues, v: np.ndarray, edges: np.ndarray,
            hint: np.ndarray | None, drawn: bool, gen: torch.Generator | None) -> np.ndarray:
    """A path's tokens: at each position the best class of its edge's set (by v), and that class's best token
    (the argmax path) or a draw from the distribution restricted to it (the drawn path)."""
    P = edges.size
    sets = h.e_set[edges]
    pairs = np.where(h.pair_set[None] == sets[:, None], v[:, h.pair_blk], -np.inf)  # [P, pairs]: the sets' classes
    cls = h.pair_blk[np.argmax(pairs, axis=1)]
    u = torch.rand(P, generator=gen, device=gen.device if gen is not None else "cpu").cpu().numpy() if drawn else None
    out = np.empty(P, dtype=np.int64)
    rows = []  # positions whose token is the big class's, read from the row
    for p in range(P):
        c = cls[p]
        if c == h.big:
            if hint is not None and h.class_of[hint[p]] == c:
                out[p] = hint[p]
            elif not drawn and p in cv.big_token:
                out[p] = cv.big_token[p]
            else:
                rows.append(p)
            continue
        seg = h.seg_of_class[c]
        lo, hi = h.starts[seg], h.ends[seg]
        x = cv.X[p, lo:hi]
        out[p] = h.cols[lo + (_draw_one(x, u[p]) if drawn else int(np.argmax(x)))]
    if rows:  # all at once, from the rows' scores with the tokens outside the class masked
        at = torch.tensor(rows, device=score.device)
        own = score.index_select(0, at)
        outside = h.outside(score.device)
        if drawn:  # probabilities within the class: exp(score - its log-mass), at most 1
            shift = torch.from_numpy(cv.mass[rows, h.big]).to(score.device)[:, None]
            p = own.sub_(shift).exp_().masked_fill_(outside, 0.0)
            picked = _draw_rows(p, torch.from_numpy(u[rows]).to(score.device))
        else:
            picked = own.masked_fill_(outside, -math.inf).argmax(dim=1)
        out[rows] = picked.cpu().numpy()
    return out


def _draw_rows(p: torch.Tensor, u: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """A draw from each row of p [r, V] (weights, not normalized), by inverse CDF at the uniforms u [r], in two levels
    (the chunks' masses, then the tokens of the chunk drawn), so no cumulative sum runs the row's length in
    float32."""
    r, V = p.shape
    n = -(-V // chunk)
    if n * chunk != V:
        p = torch.nn.functional.pad(p, (0, n * chunk - V))
    p = p.view(r, n, chunk)
    cum = p.sum(dim=2).double().cumsum_(dim=1)  # [r, n]
    want = u.to(cum) * cum[:, -1]
    j = torch.searchsorted(cum, want[:, None]).clamp_(max=n - 1)[:, 0]  # the chunk
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = p[torch.arange(r, device=p.device), j].double().cumsum_(dim=1)  # [r, chunk]
    k = torch.searchsorted(inner, (want - before)[:, None], right=True).clamp_(max=chunk - 1)[:, 0]
    return (j * chunk + k).clamp_(max=V - 1)


def _draw_one(x: np.ndarray, u: float) -> int:
    """A draw from softmax(x), by inverse CDF at the uniform u."""
    cdf = np.cumsum(np.exp(x - x.max(), dtype=np.float64))
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), x.size - 1)


def set_values(h: HostTables, v: np.ndarray) -> np.ndarray:
    """v [P, K + 1] per class -> [P, sets]: each set's best class value."""
    per_pair = v[:, h.pair_blk]
    out = np.maximum.reduceat(per_pair, np.minimum(h.set_start, max(per_pair.shape[1] - 1, 0)), axis=1) \
        if per_pair.shape[1] else np.full((v.shape[0], h.set_start.size), -np.inf, dtype=v.dtype)
    out[:, h.set_empty] = -np.inf
    return out


def programme(src: np.ndarray, eset: np.ndarray, dst: np.ndarray, dist: np.ndarray, sv: np.ndarray, state: int,
              after: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The best paths through an automaton for n score tables at once, on the host (numpy).

    Edges sorted by target: src, dst [E] their states (the last state, END, absorbs), eset [E] the column of `sv`
    that scores each; sv [n, P, columns]: per path and position; dist [S + 1]: tokens to acceptance. A position is a
    gather, an add and one segmented max (`maximum.reduceat`) over the edges. No back-pointers are kept: the
    back-trace takes, at each position, the best edge into the state it is in from the kept best scores (its
    in-edges only). Returns (edges [n, P]: indices into the sorted edges, ok [n]: the path ends within `after` more
    tokens of acceptance, found [n]: a path exists at all; without one within `after`, the best that ignores it)."""
    n, P, _ = sv.shape
    S1, E = dist.size, src.size
    starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]]) if E else np.zeros(0, dtype=np.int64)
    ends = np.r_[starts[1:], E].astype(np.int64)
    targets = dst[starts]
    best = np.empty((P + 1, n, S1), dtype=np.float32)  # best[p, i, s]: path i's best score of positions < p ending in s
    v = np.full((n, S1), -np.inf, dtype=np.float32)
    v[:, state] = 0.0
    best[0] = v
    if E:  # the n paths side by side, flat: one take, an add and one segmented max a position
        C = sv.shape[2]
        flat_src = (src[None] + S1 * np.arange(n)[:, None]).ravel()
        flat_set = (eset[None] + C * np.arange(n)[:, None]).ravel()
        flat_starts = (starts[None] + E * np.arange(n)[:, None]).ravel()
        flat_targets = (targets[None] + S1 * np.arange(n)[:, None]).ravel()
        by_position = np.ascontiguousarray(sv.transpose(1, 0, 2)).reshape(P, n * C)
    for p in range(P):
        v = np.full(n * S1, -np.inf, dtype=np.float32)
        if E:
            cand = np.take(best[p].ravel(), flat_src)
            cand += np.take(by_position[p], flat_set)
            v[flat_targets] = np.maximum.reduceat(cand, flat_starts)
        best[p + 1] = v.reshape(n, S1)
    v = best[P]
    edges = np.zeros((n, P), dtype=np.int64)
    ok = np.zeros(n, dtype=bool)
    found = np.ones(n, dtype=bool)
    first = np.full(S1, -1, dtype=np.int64)
    last = np.full(S1, -1, dtype=np.int64)
    first[targets], last[targets] = starts, ends
    for i in range(n):
        feasible = np.where(dist <= after, v[i], -np.inf)
        ok[i] = bool(np.isfinite(feasible).any())
        at = int(np.argmax(feasible if ok[i] else v[i]))
        if not np.isfinite(v[i, at]):
            found[i] = False
            continue
        for p in range(P - 1, -1, -1):
            lo, hi = first[at], last[at]
            j = lo + int(np.argmax(best[p, i, src[lo:hi]] + sv[i, p, eset[lo:hi]]))
            edges[i, p] = j
            at = int(src[j])
    return edges, ok, found
