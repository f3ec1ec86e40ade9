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
        # A small group keeps its token list; a big one (a string's characters: most of the vocabulary) its
        # membership mask. The search reads both as token classes (host_search.py, device_search.py).
        self.tokens = torch.tensor(tables["tokens"], dtype=torch.long)
        self.big: list[tuple[int, int]] = [tuple(x) for x in tables["big"]]  # (group, index into self.masks)
        member_lists = list(tables["masks"])
        # Class groups (classes.class_tables): an edge on every token of a set of token classes (a string's
        # characters, by how many a token adds), searched as a big group is, one mask per set of classes.
        token_class = tables.get("token_class")
        if tables.get("classes"):
            tc = np.asarray(token_class)
            first = len(member_lists)
            width = int(tc.max()) + 2  # class ids, and -1 (no class) read as the last, never chosen
            for classes in tables["class_sets"]:
                chosen = np.zeros(width, dtype=bool)
                chosen[np.asarray(classes, dtype=np.int64)] = True
                member_lists.append(np.flatnonzero(chosen[tc]))
            self.big += [(g, first + k) for g, k in tables["classes"]]
        self.masks: list[torch.Tensor] = []  # bool [V]: the group's tokens
        for members in member_lists:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            mask[torch.as_tensor(np.asarray(members), dtype=torch.long)] = True
            self.masks.append(mask)
        # Small groups of the same tokens (an integer's digits in every integer field, a key's first token in each
        # state it may follow) are searched once: `sets` of distinct token lists, set_tokens flat with set_of_token
        # [T'] naming each one's set, and set_of [G] each group's (-1: a big group's, or no token).
        sets: dict[bytes, int] = {}
        set_of = np.full(self.G, -1, dtype=np.int64)
        pieces: list[np.ndarray] = []
        flat = self.tokens.numpy()
        for g in range(self.G):
            lo, hi = offsets[g], offsets[g + 1]
            if hi > lo:
                key = flat[lo:hi].tobytes()
                if key not in sets:
                    sets[key] = len(pieces)
                    pieces.append(flat[lo:hi])
                set_of[g] = sets[key]
        self.set_of = torch.from_numpy(set_of)
        self.set_tokens = torch.from_numpy(np.concatenate(pieces)) if pieces else torch.zeros(0, dtype=torch.long)
        self.set_of_token = torch.repeat_interleave(torch.arange(len(pieces)),
                                                    torch.tensor([x.size for x in pieces], dtype=torch.long))
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

BIG_GROUP = 4096  # tokens above which a group is kept as a membership mask, not a token list


def best_path(auto: TokenAutomaton, score: torch.Tensor, state: int, room: int, after: int, end_ids: list[int],
              pad_id: int, noise: torch.Generator | bool | None = None, hint: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, bool]:
    """The best-scoring canvas that the automaton accepts a prefix of, from `state` (searched on the host over token
    classes: host_search.py).

    score [C, V]: per-position log-probabilities; noise: search on them plus Gumbel noise (a draw, not the argmax;
    a generator, or True for torch's global one). room: positions of this canvas within max_new_tokens (the rest
    are pad); after: tokens allowed after this canvas. A path either ends (an id of end_ids from an accepting state;
    later positions score as their best end or pad id and hold it) or reaches the canvas's end in a state at most
    `after` tokens from acceptance. hint [C]: each position's argmax (noise None) or free draw (with noise), where
    the sampler made them. Returns (tokens [C], ok): ok False when no such path exists, the tokens then the best path
    that ignores the length limit (an answer cut short)."""
    from .host_search import host_tables, search

    drawing = noise is not None and noise is not False
    gen = None if noise is True or not drawing else noise
    out = torch.full((score.shape[0],), pad_id, dtype=torch.long, device=score.device)
    if room <= 0:
        return out, bool(auto.final[state])
    h = host_tables(auto, end_ids, pad_id)
    argmax = None if drawing or hint is None else hint[:room]
    draw = hint[:room] if drawing and hint is not None else None
    paths = search(h, score[:room], state, after, argmax, draw, drawing, gen)
    path, ok = paths[-1]
    if path is None:
        return out, False
    out[:room] = torch.from_numpy(path).to(score.device)
    return out, ok


def host_path(W: torch.Tensor, tok: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, dist: torch.Tensor,
              state: int, after: int) -> tuple[torch.Tensor | None, bool]:
    """The dynamic programme (host_search.programme) over per-edge scores: W, tok [room, E] each edge's score and
    token per position; src, dst [E] its states (the last one, END, absorbs); dist [S + 1]: tokens to acceptance.
    Returns (tokens [room], ok), or (None, False) when no path exists at all. (The device programme's reference in
    its tests.)"""
    from .host_search import programme

    order = np.argsort(dst.numpy(), kind="stable")
    edges, ok, found = programme(src.numpy()[order], order, dst.numpy()[order], dist.numpy(),
                                 W.numpy()[None], state, after)
    if not found[0]:
        return None, False
    room = W.shape[0]
    return tok[torch.arange(room), torch.from_numpy(order[edges[0]])], bool(ok[0])


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
        if room <= 0:
            argmax.fill_(self.pad_id)
            sample.fill_(self.pad_id)
            self.ok = bool(self.auto.final[self.state])
            return
        from .host_search import host_tables, search

        rows = logp[:room]
        paths = search(host_tables(self.auto, self.end_ids, self.pad_id), rows, self.state, after,
                       argmax[:room].clone() if drawn else None, sample[:room].clone() if drawn else None,
                       not greedy, self.gen)
        for i, (path, ok) in enumerate(paths):
            target = argmax if i == 0 else sample
            target.fill_(self.pad_id)
            if path is not None:
                target[:room] = torch.from_numpy(path).to(target.device)
        self.ok = paths[0][1]  # False where no path exists at all
        if greedy:
            sample.copy_(argmax)

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
