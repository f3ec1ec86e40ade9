"""Constrained canvases: answers held to a regular language, valid by construction (docs/design.md, Constrained
canvases).

A constraint is a regular expression over the answer's bytes: given as it is (`run --regex`), or compiled from a
JSON Schema (`schema_regex`: outlines-core's compiler, with integer and number ranges, which it ignores, spelled
out here). outlines-core turns the expression and the tokenizer's vocabulary into a DFA over token ids; it is kept
as `TokenAutomaton`: from each state, the states it can go to and, per target state, the tokens that lead there.

Each denoise step, after sampling, the canvas's argmax (what the answer would keep) and its sample (what the
accepted positions keep) are replaced by the best paths through the automaton (`best_path`): dynamic programming
over (position, state) on the step's per-position log-probabilities, over every token of the vocabulary, so the
argmax path is the most probable canvas (positions taken as independent, as the sampler takes them) that keeps the
answer completable; the sample path is the same search on log-probabilities plus Gumbel noise, so different seeds
give different valid answers. A path may end the answer (an end-of-sequence id from an accepting state; after it
every position scores as end-of-sequence or pad) or stop at the canvas's end in a state from which the tokens left
under max_new_tokens can still reach an accepting one. What is exact: every kept canvas is a prefix of a word of the
language, and an answer that ended is a word of it. What is approximate: the search scores positions independently
(the model's own distribution is joint), and it is re-run every step, so an accepted token is kept only while the
best path keeps it.

Nothing here knows the model or the view: the sampler hands `RowConstraint.step` a row's log-probabilities and gets
its two paths back.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np
import torch

from ..errors import UsageError
from .structure import (MAX_EDGES, MAX_REPEAT, Structure, integer_regex, lark_grammar,  # noqa: F401
                        number_regex, outlines_vocabulary, regex_tables, schema_regex)

# ------------------------------------------------------------------------------------------ the token automaton


class TokenAutomaton:
    """A DFA over token ids, compacted (structure.automaton_tables: what the compile worker returns): states 0..S-1
    (0 the start), only states from which an accepting one can be reached. Edges are grouped by (source, target):
    group g goes from src[g] to dst[g] on the tokens tokens[offsets[g]:offsets[g + 1]] (flat) or, for a big group,
    on the tokens of its mask. dist[s]: the fewest tokens from s to
    an accepting state. End-of-sequence ids are not in it: the search adds them from accepting states."""

    def __init__(self, tables: dict):
        self.S, self.vocab_size, self.edges = tables["S"], tables["vocab_size"], tables["edges"]
        self.dist = torch.tensor(tables["dist"], dtype=torch.long)
        self.final = self.dist == 0
        self.src = torch.tensor(tables["src"], dtype=torch.long)
        self.dst = torch.tensor(tables["dst"], dtype=torch.long)
        self.G = self.src.numel()
        offsets = tables["offsets"]
        self.offsets = offsets
        # Small groups are searched token by token (their distinct token lists gathered, below); a big one (a
        # string's characters: most of the vocabulary) through its membership mask (_big_edge_weights), once per mask.
        self.tokens = torch.tensor(tables["tokens"], dtype=torch.long)
        self.big: list[tuple[int, int]] = [tuple(x) for x in tables["big"]]  # (group, index into self.masks)
        member_lists = list(tables["masks"])
        # Class groups (classes.class_tables): an edge on every token of a set of token classes (a string's
        # characters, by how many a token adds), searched as a big group is, one mask per set of classes.
        token_class = tables.get("token_class")
        if tables.get("classes"):
            tc = np.asarray(token_class)
            first = len(member_lists)
            for classes in tables["class_sets"]:
                member_lists.append(np.flatnonzero(np.isin(tc, classes)))
            self.big += [(g, first + k) for g, k in tables["classes"]]
        self.masks: list[torch.Tensor] = []  # bool [V]: the group's tokens
        self.complements: list[torch.Tensor | None] = []  # the tokens not in it, where they are the smaller side
        self.members: list[torch.Tensor | None] = []  # its tokens where they are at most half the vocabulary
        for members in member_lists:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[torch.as_tensor(np.asarray(members), dtype=torch.long)] = True
            self.masks.append(mask)
            small = 2 * len(members) <= self.vocab_size
            self.complements.append(None if small else torch.nonzero(~mask).flatten())
            self.members.append(torch.nonzero(mask).flatten() if small else None)
        self.groups_of_mask = [[g for g, k in self.big if k == m] for m in range(len(self.masks))]
        # Small groups of the same tokens (an integer's digits in every integer field, a key's first token in each
        # state it may follow) are searched once: `sets` of distinct token lists, set_tokens flat with set_of_token
        # [T'] naming each one's set, and set_of [G] each group's (-1: a big group's, or no token).
        sets: dict[bytes, int] = {}
        self.set_of = torch.full((self.G,), -1, dtype=torch.long)
        pieces: list[torch.Tensor] = []
        for g in range(self.G):
            piece = self.tokens[offsets[g] : offsets[g + 1]]
            if piece.numel():
                key = piece.numpy().tobytes()
                if key not in sets:
                    sets[key] = len(pieces)
                    pieces.append(piece)
                self.set_of[g] = sets[key]
        self.set_tokens = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
        self.set_of_token = torch.repeat_interleave(torch.arange(len(pieces)),
                                                    torch.tensor([x.numel() for x in pieces], dtype=torch.long))
        self.small_groups = torch.nonzero(self.set_of >= 0).flatten()
        self._mask_of = dict(self.big)
        self._out: dict[int, list[int]] = {}  # state -> its groups, made when an answer first passes there
        self._small: dict[int, dict[int, int]] = {}  # state -> {token: next state} of its small groups

    def step(self, state: int, token: int) -> int | None:
        """The state after `token` from `state`, or None where it has no edge."""
        if state not in self._out:
            groups = torch.nonzero(self.src == state).flatten().tolist()
            self._out[state] = groups
            self._small[state] = {t: int(self.dst[g]) for g in groups if g not in self._mask_of
                                  for t in self.tokens[self.offsets[g] : self.offsets[g + 1]].tolist()}
        nxt = self._small[state].get(token)
        if nxt is not None:
            return nxt
        if not 0 <= token < self.vocab_size:
            return None
        for g in self._out[state]:
            k = self._mask_of.get(g)
            if k is not None and bool(self.masks[k][token]):
                return int(self.dst[g])
        return None

    @property
    def start(self) -> int:
        return 0

    def row(self, max_new_tokens: int, end_ids, pad_id: int, generator: torch.Generator | None = None,
            device_search: bool | None = None):
        return RowConstraint(self, max_new_tokens, end_ids, pad_id, generator, device_search)

    def advance(self, state: int, tokens) -> int | None:
        """The state after `tokens` from `state`, or None where a token has no edge."""
        for t in tokens:
            state = self.step(state, int(t))
            if state is None:
                return None
        return state


_CACHE: OrderedDict = OrderedDict()  # (kind, source, tokenizer id, vocab) -> compiled, most recent last
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 16


def compile_structure(structure: Structure, tokenizer, vocab_size: int):
    """`structure` compiled over `tokenizer`'s vocabulary in this process, without a budget: a TokenAutomaton
    (expressions, schemas) or a LarkGrammar (grammars); either makes a request's per-row state with `.row(...)`.
    Cached per structure and tokenizer. What a client sends goes through `worker.StructureCompiler`
    instead (a killable process with a time and memory budget), which builds the same objects."""
    key = (structure.kind, structure.source, id(tokenizer), vocab_size)
    with _CACHE_LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    if structure.kind == "grammar":
        auto = LarkGrammar(lark_grammar(structure.source), tokenizer, vocab_size)  # lark_grammar checks it
    else:
        from .classes import NotClassed, class_tables

        regex = structure.regex()
        try:
            tables = class_tables(regex, tokenizer.token_bytes(), vocab_size, structure.specials, BIG_GROUP)
        except NotClassed:
            vocabulary = outlines_vocabulary(tokenizer.token_bytes(), vocab_size, structure.specials)
            tables = regex_tables(regex, vocabulary, vocab_size, BIG_GROUP)
        auto = TokenAutomaton(tables)
    with _CACHE_LOCK:
        _CACHE[key] = auto
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return auto


# ---------------------------------------------------------------------------------------------------- the search

_GATHER = 1 << 23  # score elements gathered at once (positions x tokens): 32 MB of float32
BIG_GROUP = 4096  # tokens above which a group is searched by its mask and complement, not token by token


def gumbel(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    """Standard Gumbel noise: adding it to log-probabilities and taking the max draws from the distribution."""
    u = torch.empty(shape, device=device).uniform_(generator=generator)
    return -torch.log(-torch.log(u.clamp_(min=1e-20)))


def _gathered(score: torch.Tensor, tokens: torch.Tensor, cache: dict | None, key) -> torch.Tensor:
    """score[:, tokens], gathered once per step: the argmax and the draw search read the same columns (a gather
    over the vocabulary costs about what a pass over it does)."""
    if cache is None:
        return score[:, tokens]
    if key not in cache:
        cache[key] = score[:, tokens]
    return cache[key]


def _edge_weights(auto: TokenAutomaton, score: torch.Tensor, noise: torch.Generator | bool | None,
                  hint: torch.Tensor | None = None, cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """score [P, V] -> (w [P, G]: the best score among each group's tokens, tok [P, G]: that token). noise: add
    Gumbel noise to the scores (from this generator; True: torch's global one), one draw per position and token
    (groups of the same tokens get the same best). hint [P]: each position's best token over the whole vocabulary
    (without noise) or a draw from its distribution (with noise), which the sampler has already made; None: made
    here (a pass or three over `score`). cache: a dict kept for one step's searches of the same `score` (its gathers
    are made once)."""
    P, T, G = score.shape[0], auto.set_tokens.numel(), auto.G
    dev = score.device
    w = torch.full((P, G), -math.inf, dtype=score.dtype, device=dev)
    tok = torch.zeros((P, G), dtype=torch.long, device=dev)
    if T:
        tokens, set_of_token = auto.set_tokens.to(dev), auto.set_of_token.to(dev)
        D = int(auto.set_of_token[-1]) + 1
        wd = torch.empty((P, D), dtype=score.dtype, device=dev)
        td = torch.empty((P, D), dtype=torch.long, device=dev)
        step = max(1, _GATHER // T)
        whole = _gathered(score, tokens, cache, "tokens") if step >= P else None  # [P, T'] when it fits
        for p0 in range(0, P, step):
            s = whole if whole is not None else score[p0 : p0 + step, tokens]  # [p, T']
            if noise is not None and noise is not False:
                s = s + gumbel(s.shape, None if noise is True else noise, dev)
            idx = set_of_token.expand_as(s)
            wp = torch.full((s.shape[0], D), -math.inf, dtype=s.dtype, device=dev).scatter_reduce(1, idx, s, "amax")
            pos = torch.where(s == wp.gather(1, idx), torch.arange(T, device=dev).expand_as(s), T)
            first = torch.full((s.shape[0], D), T, dtype=torch.long, device=dev).scatter_reduce(1, idx, pos, "amin")
            wd[p0 : p0 + s.shape[0]] = wp
            td[p0 : p0 + s.shape[0]] = tokens[first.clamp(max=T - 1)]
        small, sets = auto.small_groups.to(dev), auto.set_of[auto.small_groups].to(dev)
        w[:, small], tok[:, small] = wd[:, sets], td[:, sets]
    if auto.big:
        _big_edge_weights(auto, score, noise, w, tok, hint, cache)
    return w, tok


def _big_edge_weights(auto: TokenAutomaton, score: torch.Tensor, noise, w: torch.Tensor, tok: torch.Tensor,
                      hint: torch.Tensor | None, cache: dict | None = None) -> None:
    """The big groups' columns of w and tok, without gathering their tokens, once per mask (groups of the same
    tokens share their best token). Argmax: the position's best token (`hint`) where it is in the group, else the
    best of the group's (searched at those positions only). With noise (a draw): the max over a group of
    log-probability plus Gumbel noise is distributed as the group's log-mass plus one Gumbel draw, and its token,
    independent of it, as a draw from the distribution restricted to the group; the log-mass is taken through the
    smaller of the group and its complement (log(1 - the mass outside)), the token is the position's draw from the
    whole distribution (`hint`) where that landed in the group (so restricted to it), else a draw restricted to the
    group at those positions. Exact in distribution, as the token-by-token search is; groups of the same mask get
    the same value and token at a position, as they would under one noise draw per position and token."""
    P, dev = score.shape[0], score.device
    gen = None if noise is True or noise is False else noise
    drawing = noise is not None and noise is not False
    if hint is None:
        hint = _draws(score, 1, gen).squeeze(1) if drawing else score.argmax(dim=1)
    hint = hint.to(dev)
    best = None if drawing else score.gather(1, hint[:, None]).squeeze(1)
    for k, groups in enumerate(auto.groups_of_mask):
        if not groups:
            continue
        mask, members, cols = auto.masks[k].to(dev), auto.members[k], torch.tensor(groups, device=dev)
        members = None if members is None else members.to(dev)
        hit = mask[hint]
        t = hint.clone()
        miss = torch.nonzero(~hit).flatten()
        own = _gathered(score, members, cache, ("mask", k)) if members is not None and (drawing or miss.numel()) \
            else None  # [P, members]: the draw's log-mass reads it, the argmax only where its hint missed
        sub = None
        if miss.numel():  # the positions whose best token (draw) is not in the group: its own tokens there
            sub = own[miss] if own is not None else score[miss].masked_fill(~mask, -math.inf)
        if not drawing:
            v = torch.where(hit, best, -math.inf)
            if sub is not None:
                mv, mi = sub.max(dim=1)
                v[miss], t[miss] = mv, (members[mi] if members is not None else mi)
            w[:, cols], tok[:, cols] = v[:, None], t[:, None]
            continue
        if members is not None:  # the group is the smaller side: sum it
            lse = torch.logsumexp(own, dim=1)
        else:
            comp = auto.complements[k].to(dev)
            out_mass = torch.logsumexp(score[:, comp], dim=1) if comp.numel() else \
                torch.full((P,), -math.inf, device=dev)
            lse = torch.log(-torch.expm1(out_mass))  # log(1 - mass outside)
            close = out_mass > -1e-4  # nearly all the mass outside: take the group's own sum
            if bool(close.any()):
                lse[close] = torch.logsumexp(score[close].masked_fill(~mask, -math.inf), dim=1)
        if sub is not None:
            i = _draws(sub, 1, gen).squeeze(1)
            t[miss] = members[i] if members is not None else i
        w[:, cols] = (lse + gumbel((P,), gen, dev))[:, None]
        tok[:, cols] = t[:, None]


def _draws(score: torch.Tensor, k: int, gen: torch.Generator | None) -> torch.Tensor:
    """k independent draws per row of softmax(score) [P, V] -> [P, k], by inverse CDF (a cumulative sum and a
    search per draw), 32 rows at a time (a cumulative sum of the whole canvas would be canvas x vocab floats)."""
    P, V = score.shape
    out = torch.empty(P, k, dtype=torch.long, device=score.device)
    for p0 in range(0, P, 32):
        sc = score[p0 : p0 + 32]
        cdf = (sc - sc.max(dim=1, keepdim=True).values).exp_().cumsum_(dim=1)
        u = torch.rand(sc.shape[0], k, generator=gen, device=score.device) * cdf[:, -1:]
        out[p0 : p0 + 32] = torch.searchsorted(cdf, u).clamp_(max=V - 1)
    return out


def best_path(auto: TokenAutomaton, score: torch.Tensor, state: int, room: int, after: int, end_ids: list[int],
              pad_id: int, noise: torch.Generator | bool | None = None, hint: torch.Tensor | None = None,
              cache: dict | None = None) -> tuple[torch.Tensor, bool]:
    """The best-scoring canvas that the automaton accepts a prefix of, from `state`.

    score [C, V]: per-position log-probabilities; noise: search on them plus Gumbel noise (a draw, not the argmax;
    a generator, or True for torch's global one). room: positions of this canvas within max_new_tokens (the rest
    are pad); after: tokens allowed after this canvas. A path either ends (an id of end_ids from an accepting state;
    later positions score as their best end or pad id and hold it) or reaches the canvas's end in a state at most
    `after` tokens from acceptance. hint [C]: each position's argmax (noise None) or free draw (with noise), where
    the sampler made them (_edge_weights). Returns (tokens [C], ok): ok False when no such path exists, the tokens
    then the best path that ignores the length limit (an answer cut short)."""
    C = score.shape[0]
    dev = score.device
    END = auto.S
    out = torch.full((C,), pad_id, dtype=torch.long, device=dev)
    if room <= 0:
        return out, bool(auto.final[state])
    sc = score[:room]
    w, wtok = _edge_weights(auto, sc, noise, None if hint is None else hint[:room], cache)
    finals = torch.nonzero(auto.final).flatten()
    ends = torch.tensor(sorted(set(end_ids)), dtype=torch.long, device=dev)
    stop = torch.tensor(sorted(set(end_ids) | {pad_id}), dtype=torch.long, device=dev)
    end_sc, stop_sc = sc[:, ends], sc[:, stop]
    if noise is not None and noise is not False:
        g = None if noise is True else noise
        end_sc, stop_sc = end_sc + gumbel(end_sc.shape, g, dev), stop_sc + gumbel(stop_sc.shape, g, dev)
    eos_w, eos_i = end_sc.max(dim=1)
    stop_w, stop_i = stop_sc.max(dim=1)
    # The dynamic programme runs on the host over [room, edges] tables (edges: the automaton's groups, a few
    # hundred to a few thousand): on a GPU its per-position loop would be hundreds of tiny kernels and a host
    # round trip per position of the back-trace; the device's work is the vocabulary-wide gathers above.
    nf = finals.numel()
    cpu = torch.device("cpu")
    src = torch.cat([auto.src, finals, torch.tensor([END])])
    dst = torch.cat([auto.dst, torch.full((nf,), END), torch.tensor([END])])
    W = torch.cat([w, eos_w[:, None].expand(room, nf), stop_w[:, None]], dim=1).to(cpu)  # [room, E]
    tok = torch.cat([wtok, ends[eos_i][:, None].expand(room, nf), stop[stop_i][:, None]], dim=1).to(cpu)
    dist = torch.cat([auto.dist, torch.tensor([0])])
    path, ok = host_path(W, tok, src, dst, dist, state, after)
    if path is None:
        return out, False
    out[:room] = path.to(dev)
    return out, ok


def host_path(W: torch.Tensor, tok: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, dist: torch.Tensor,
              state: int, after: int) -> tuple[torch.Tensor | None, bool]:
    """best_path's dynamic programme, on the host. W, tok [room, E]: each edge's score and token per position; src,
    dst [E]: its states (the last one, END, absorbs); dist [S + 1]: tokens to acceptance. Returns (tokens [room],
    ok), or (None, False) when no path exists at all.

    numpy, with the edges sorted by target once: a position is a gather, an add and one segmented max
    (`maximum.reduceat`) over the edges. No back-pointers are kept: the back-trace takes, at each position, the
    best edge into the state it is in from the kept best scores (its in-edges only)."""
    room, E = W.shape
    S1 = dist.numel()
    Wn = W.numpy()
    order = np.argsort(dst.numpy(), kind="stable")
    ds, ss = dst.numpy()[order], src.numpy()[order]
    starts = np.flatnonzero(np.concatenate(([True], ds[1:] != ds[:-1]))) if E else np.zeros(0, dtype=np.int64)
    targets = ds[starts]
    ends = np.append(starts[1:], E)
    first = np.full(S1, -1, dtype=np.int64)
    last_in = np.full(S1, -1, dtype=np.int64)
    first[targets], last_in[targets] = starts, ends
    Wo = Wn[:, order]  # [room, E], in target order
    best = np.empty((room + 1, S1), dtype=Wn.dtype)  # best[p, s]: the best score of positions < p ending in s
    v = np.full(S1, -np.inf, dtype=Wn.dtype)
    v[state] = 0.0
    best[0] = v
    for p in range(room):
        v = np.full(S1, -np.inf, dtype=Wn.dtype)
        if E:
            v[targets] = np.maximum.reduceat(best[p][ss] + Wo[p], starts)
        best[p + 1] = v
    feasible = np.where(dist.numpy() <= after, v, -np.inf)
    ok = bool(np.isfinite(feasible).any())
    at = int(np.argmax(feasible if ok else v))
    if not np.isfinite(v[at]):
        return None, False
    edges = np.empty(room, dtype=np.int64)
    for p in range(room - 1, -1, -1):
        lo, hi = first[at], last_in[at]
        j = lo + int(np.argmax(best[p][ss[lo:hi]] + Wo[p, lo:hi]))
        edges[p] = order[j]
        at = int(ss[j])
    return tok[torch.arange(room), torch.from_numpy(edges)], ok


def _room(limit: int, produced: int, length: int) -> int:
    """Positions of a canvas (or its kept ids) of `length` within max_new_tokens, `produced` tokens in."""
    return max(0, min(length, limit - produced))


def device_search_default(device: torch.device) -> bool:
    """Where a held row searches on the device unless told (RowConstraint's device_search): a CUDA device where the
    Triton kernels run (quant.kernels.use_triton)."""
    from quant.kernels import use_triton

    return device.type == "cuda" and use_triton(device)


class RowConstraint:
    """One answer's constraint as its canvases are denoised: where the automaton is at the current canvas's start,
    how many tokens the answer has, and whether it could be kept."""

    def __init__(self, auto: TokenAutomaton, max_new_tokens: int, end_ids, pad_id: int,
                 generator: torch.Generator | None = None, device_search: bool | None = None):
        self.auto, self.limit = auto, max_new_tokens
        self.end_ids, self.pad_id = [int(i) for i in end_ids], pad_id
        self.gen = generator
        self.state = auto.start
        self.produced = 0  # tokens of finished canvases
        self.ended = False  # an end id was kept from an accepting state
        self.ok = True  # every step found a path within the length limit
        # the search on the device (device_search.py): None decides per device (`on_device`), True forces it (the
        # interpreter's tests), False keeps the host search
        self.device_search = device_search
        self._device: dict = {}  # (device, canvas) -> DeviceSearch, or None where the automaton stays on the host
        self._device_ok = None  # the DeviceSearch whose last step's `ok` is still on the device

    def on_device(self, device, canvas: int) -> bool:
        """Whether this row's search runs on `device` for canvases of `canvas` positions: a CUDA device where the
        Triton kernels run (quant.kernels.use_triton), an automaton whose back-pointers fit (device_search.MAX_BACK).
        Such a step reads nothing on the host, so the row keeps the lagged stop test."""
        return self._searcher(torch.device(device), canvas) is not None

    def _searcher(self, device: torch.device, canvas: int):
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device: one search
            device = torch.device("cuda", torch.cuda.current_device())
        key = (device, canvas)
        if key not in self._device:
            use = self.device_search
            if use is None:
                use = device_search_default(device)
            searcher = None
            if use:
                from .device_search import DeviceSearch, NotOnDevice, device_tables

                try:
                    searcher = DeviceSearch(device_tables(self.auto, self.end_ids, self.pad_id), canvas, self.pad_id,
                                            device, self.gen)
                except NotOnDevice:
                    searcher = None
            self._device[key] = searcher
        return self._device[key]

    def step(self, logp: torch.Tensor, sample: torch.Tensor, argmax: torch.Tensor, greedy: bool,
             drawn: bool = False) -> None:
        """logp [C, V]: this step's log-probabilities for the row's canvas; sample, argmax [C]: overwritten in place
        with the best paths (the sample's on Gumbel-perturbed scores). drawn: they hold the sampler's draws from
        logp and its argmax (the sampler's step), which the search then reads instead of making its own."""
        C = logp.shape[0]
        room = _room(self.limit, self.produced, C)
        after = self.limit - self.produced - room
        searcher = self._searcher(logp.device, C) if room > 0 else None
        if searcher is not None:  # two kernels and a fill; ok stays on the device until the canvas ends
            searcher.set_canvas(self.state, room, after)
            searcher.step(logp, sample, argmax, greedy)
            self._device_ok = searcher
            return
        self._device_ok = None
        free_draw = sample.clone() if drawn and not greedy else None
        cache: dict = {}  # the two searches' shared gathers
        best, ok = best_path(self.auto, logp, self.state, room, after, self.end_ids, self.pad_id,
                             hint=argmax.clone() if drawn else None, cache=cache)
        self.ok = ok
        argmax.copy_(best)
        if greedy:
            sample.copy_(best)
            return
        drawn, _ = best_path(self.auto, logp, self.state, room, after, self.end_ids, self.pad_id,
                             noise=self.gen if self.gen is not None else True, hint=free_draw, cache=cache)
        sample.copy_(drawn)

    def step_keys(self, keys: torch.Tensor, sample: torch.Tensor, argmax: torch.Tensor, greedy: bool) -> None:
        """As `step`, from the class keys the fused head made for this row's positions (keys [2, C, width]: its
        `HeldRows`; `on_device` must hold): the programme alone, on the device."""
        C = keys.shape[1]
        room = _room(self.limit, self.produced, C)
        searcher = self._searcher(keys.device, C)
        if room <= 0:  # past max_new_tokens: pad, nothing searched (the keys set back for the next step)
            from quant.kernels.class_pass import KEY_MIN

            keys.fill_(KEY_MIN)
            argmax.fill_(self.pad_id)
            sample.fill_(self.pad_id)
            self._device_ok = None
            self.ok = bool(self.auto.final[self.state])
            return
        searcher.set_canvas(self.state, room, self.limit - self.produced - room)
        searcher.search_keys(keys, sample, argmax, greedy)
        self._device_ok = searcher

    def tile_runs(self, device, canvas: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused head's class tables for its tiles of `tile` tokens (device_search.DeviceTables.tile_runs), on
        `device`, made once per automaton (`on_device` must hold)."""
        searcher = self._searcher(torch.device(device), canvas)
        return searcher.tile_runs(tile)

    @property
    def classes(self) -> int:
        return next(s for s in self._device.values() if s is not None).t.classes

    def end_canvas(self, tokens) -> None:
        """The canvas kept (its ids, pad after an end id): move the automaton through it."""
        if self._device_ok is not None:  # the last step's search ran on the device: whether it kept within the limit
            self.ok = self._device_ok.path_found()
            self._device_ok = None
        room = _room(self.limit, self.produced, len(tokens))
        for t in list(tokens)[:room]:
            t = int(t)
            if t in self.end_ids:
                self.ended = bool(self.auto.final[self.state])
                self.ok = self.ok and self.ended
                break
            nxt = self.auto.step(self.state, t)
            if nxt is None:  # a canvas the search did not produce (it ran out of room): the answer is cut short
                self.ok = False
                break
            self.state = nxt
        self.produced += len(tokens)

    @property
    def satisfied(self) -> bool:
        """The answer is a whole word of the language: it ended from an accepting state, or the length limit came
        exactly where one is."""
        ok = self.ok if self._device_ok is None else self._device_ok.path_found()
        return ok and (self.ended or bool(self.auto.final[self.state]))


# ------------------------------------------------------------------------------------------- grammars (llguidance)


class LarkGrammar:
    """A context-free grammar over this vocabulary: llguidance's tokenizer (every token's bytes; added tokens as
    special ones, which no grammar spells) and the compiled grammar text. A row's state is an llguidance matcher."""

    def __init__(self, grammar: str, tokenizer, vocab_size: int):
        import llguidance

        self.vocab_size = vocab_size
        self.tok = ll_tokenizer(tokenizer, vocab_size)
        self.grammar = grammar
        probe = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if probe.is_error():
            raise UsageError(f"the grammar cannot be compiled for this model's vocabulary: "
                             f"{probe.get_error().splitlines()[0][:300]}")

    def matcher(self):
        import llguidance

        return llguidance.LLMatcher(self.tok, self.grammar, log_level=0)

    def row(self, max_new_tokens: int, end_ids, pad_id: int, generator: torch.Generator | None = None):
        return GrammarRowConstraint(self, max_new_tokens, end_ids, pad_id, generator)


_LL_TOKENIZERS: dict = {}  # (id(tokenizer), vocab_size) -> (tokenizer, llguidance.LLTokenizer)
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's tokenizer over this vocabulary (every token's bytes; added tokens as special ones, which no
    grammar spells), made once per tokenizer: about a second and 120 MB at 262,144 tokens, which every grammar a
    client sends would otherwise pay again."""
    from .structure import ll_tokenizer as structure_ll_tokenizer

    key = (id(tokenizer), vocab_size)
    with _LL_LOCK:
        held = _LL_TOKENIZERS.get(key)
        if held is not None and held[0] is tokenizer:
            return held[1]
        made = structure_ll_tokenizer(tokenizer.token_bytes(), vocab_size, tokenizer.encode_text, tokenizer.eos_id,
                                      tokenizer.bos_id)
        _LL_TOKENIZERS[key] = (tokenizer, made)  # the tokenizer held too: its id is never another's
        return made


def _allowed(matcher, vocab_size: int, device) -> torch.Tensor:
    """The matcher's next-token mask as bool [vocab_size] (llguidance packs it 32 tokens to a little-endian word)."""
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    mask = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
    return mask[:vocab_size].to(device)


class GrammarRowConstraint:
    """One answer held to a grammar. A grammar has no finite automaton to search, so each step walks the canvas
    left to right from where the answer stands: at each position the best token the grammar allows there (the
    argmax walk: by log-probability; the sample walk: drawn from the distribution restricted to what is allowed),
    ending with an end id where the grammar accepts and the model prefers ending. Every kept canvas is a prefix of a
    sentence of the grammar; the walk does not look ahead, so near max_new_tokens it may not be able to finish,
    which the answer then says (`satisfied` False). Same interface as RowConstraint."""

    def __init__(self, grammar: LarkGrammar, max_new_tokens: int, end_ids, pad_id: int,
                 generator: torch.Generator | None = None):
        self.g, self.limit = grammar, max_new_tokens
        self.end_ids, self.pad_id = [int(i) for i in end_ids], pad_id
        self.gen = generator
        self.m = grammar.matcher()  # at the current canvas's start
        self._host_gen: torch.Generator | None = None
        self.produced = 0
        self.ended = False
        self.ok = True

    def _walk(self, logp: torch.Tensor, C: int, draw: bool) -> torch.Tensor:
        """logp [room, V] on the host -> the walked canvas [C] (on the host)."""
        room, V = logp.shape
        dev = logp.device
        out = torch.full((C,), self.pad_id, dtype=torch.long, device=dev)
        ends = torch.tensor(self.end_ids, dtype=torch.long, device=dev)
        consumed = 0
        for p in range(room):
            if self.m.is_error():
                break
            allowed = _allowed(self.m, V, dev)
            can_end = self.m.is_accepting()
            if can_end:
                allowed[ends] = True
            else:
                allowed[ends] = False
            if not bool(allowed.any()):
                break
            row = logp[p].masked_fill(~allowed, -math.inf)
            if draw:
                t = int(torch.multinomial((row - row.max()).exp(), 1, generator=self._host_generator()))
            else:
                t = int(row.argmax())
            out[p] = t
            if t in self.end_ids:
                stop = logp[p + 1 : room][:, torch.tensor(sorted(set(self.end_ids) | {self.pad_id}), device=dev)]
                if stop.numel():
                    best = torch.tensor(sorted(set(self.end_ids) | {self.pad_id}), device=dev)[stop.argmax(dim=1)]
                    out[p + 1 : room] = best
                break
            if not self.m.consume_token(t):
                break
            consumed += 1
        self.m.rollback(consumed)  # back to the canvas's start: the next step walks again
        return out

    def _host_generator(self) -> torch.Generator | None:
        """The generator the walk's draws take: the row's own on the CPU; for a row on a GPU, a host generator
        seeded from it once (the walk runs on the host)."""
        if self.gen is None or self.gen.device.type == "cpu":
            return self.gen
        if self._host_gen is None:
            self._host_gen = torch.Generator().manual_seed(self.gen.initial_seed())
        return self._host_gen

    def step(self, logp: torch.Tensor, sample: torch.Tensor, argmax: torch.Tensor, greedy: bool,
             drawn: bool = False) -> None:
        """As RowConstraint.step. The walk reads the step's log-probabilities on the host, copied there once (on a
        GPU one host round trip a step, not a read-back and a mask upload per position)."""
        C = logp.shape[0]
        room = _room(self.limit, self.produced, C)
        host = logp[:room].to("cpu")
        best = self._walk(host, C, draw=False)
        argmax.copy_(best)
        sample.copy_(best if greedy else self._walk(host, C, draw=True))

    def on_device(self, device, canvas: int) -> bool:
        """A grammar's walk reads the step on the host."""
        return False

    def end_canvas(self, tokens) -> None:
        room = _room(self.limit, self.produced, len(tokens))
        for t in list(tokens)[:room]:
            t = int(t)
            if t in self.end_ids:
                self.ended = self.m.is_accepting()
                self.ok = self.ok and self.ended
                break
            if not self.m.consume_token(t):
                self.ok = False
                break
        self.produced += len(tokens)

    @property
    def satisfied(self) -> bool:
        return self.ok and (self.ended or self.m.is_accepting())
