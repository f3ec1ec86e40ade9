"""The token automaton of an expression, built over token classes (docs/design.md, Constrained canvases).

outlines-core's `Index` walks every token of the vocabulary from every state of the expression's automaton: at
262,144 tokens a JSON string's state alone is a walk of the whole vocabulary, a bounded string one per character it
may still take (a 50-property form with strings of at most 32 characters: 20 million edges), and the compile takes
seconds. Here the automaton is built in three parts:

1. The expression's *byte* automaton, its strings' bodies (a JSON string's characters, a tool call's string
   characters: a character class repeated, `X*` or `X{m,n}`) each replaced by one placeholder character (a "marker":
   U+10F000 + k), so that it is a few hundred states over bytes. outlines-core builds it (its `Index` over a
   vocabulary of single bytes), with an end character appended: its Index drops the edges that leave an accepting
   state for one that is not (`(?:ab)+` takes "ab" once), which an end character makes no state be.
2. The body's own byte automaton `(?:X)*`, walked once per vocabulary (cached): for each token and each body state,
   whether it stays inside the body (how many characters it adds, where it ends), leaves it at a character's end
   (after how many characters, at which byte) or cannot be written there. The tokens that stay inside a body from a
   character's end fall in *classes* (characters added, the state they end in): a few dozen, the same in every body
   of the expression. A bounded body's states count the characters written (k = 0..m), and a class moves k by its
   characters: a bound costs states, not edges.
3. A breadth-first walk of the token-level states: (byte state) outside bodies, (body, k, body state) inside them.
   Outside a body only the tokens whose first two bytes lead somewhere are walked (numpy, every token at once); inside,
   the class table gives the edges, and only the tokens that leave the body are walked on (from the body's end).

The tables are constrain.TokenAutomaton's (structure.automaton_tables's) with class groups added: an edge on a set of
classes (every token of them), which constrain.TokenAutomaton searches as a big group: one mask per set of classes.
"""

from __future__ import annotations

import re
import threading
from collections import deque

import numpy as np

from ..errors import UsageError
from .structure import BIG_GROUP

MARK_BASE = 0x10F000  # body k is written as the character MARK_BASE + k while the byte automaton is built
END_MARK = 0x10FFFD  # appended to every expression (see 1. above)
JSON_CHAR = r'([^"\\\x00-\x1F\x7F-\x9F]|\\["\\/bfnrt])'  # one character of a JSON string, as outlines-core writes it
CALL_CHAR = r"[^<\U00100000-\U0010FFFF]"  # one character of a tool call's string (tools._Regex.string)
BODIES = (JSON_CHAR, CALL_CHAR)
_QUANTIFIER = r"(\*|\+|\?|\{(\d+)\}|\{(\d+),(\d*)\})?"
MAX_STATES = 200_000  # token-level states an automaton may have (a bounded body's count is its maxLength + 1 each)


class NotClassed(Exception):
    """The expression is built the other way (structure.regex_tables: outlines-core's token Index)."""


# ------------------------------------------------------------------------------------------------ expressions


def marked(regex: str) -> tuple[str, str | None, list[tuple[int, int | None]]]:
    """regex -> (the expression with each body (X quantified) replaced by its marker character, X, each marker's
    (fewest, most) characters, most None for unbounded). One kind of body per expression (the first of BODIES
    found); none found: (regex, None, [])."""
    probe = regex
    for body in BODIES:
        probe = probe.replace(body, "")
    if any(ord(c) >= MARK_BASE for c in probe) or re.search(r"\\U0010F|\\[ux]\{10F", probe, re.IGNORECASE):
        return regex, None, []  # a character of the markers' own in the text
    for body in BODIES:
        if body not in regex:
            continue
        bounds: list[tuple[int, int | None]] = []
        out, at = [], 0
        for m in re.finditer(re.escape(body) + _QUANTIFIER, regex):
            start = m.start()
            slashes = len(regex[:start]) - len(regex[:start].rstrip("\\"))
            nxt = regex[m.end() : m.end() + 1]
            if slashes % 2 or nxt in ("?", "+"):  # escaped, or a lazy or possessive repetition: left as it is
                continue
            q = m.group(1)
            if q is None:
                lo, hi = 1, 1
            elif q in ("*", "+", "?"):
                lo, hi = (0, None) if q == "*" else (1, None) if q == "+" else (0, 1)
            elif m.group(2) is not None:
                lo = hi = int(m.group(2))
            else:
                lo, hi = int(m.group(3)), (int(m.group(4)) if m.group(4) else None)
            out.append(regex[at:start])
            if (lo, hi) not in bounds:  # bodies of the same bounds share their marker: where the automaton
                bounds.append((lo, hi))  # is in two of them at once (an optional field written twice) it is one
            out.append(f"\\U{MARK_BASE + bounds.index((lo, hi)):08X}")
            at = m.end()
        if bounds:
            out.append(regex[at:])
            return "".join(out), body, bounds
    return regex, None, []


def _byte_automaton(regex: str, n_symbols: int, symbols: dict[bytes, int]):
    """`regex` + END_MARK over `symbols` (each a byte string: a byte, a special token's character, a marker, the end
    mark) -> (table int32 [S + 1, n_symbols]: the next state, S the dead state; start; accepting bool [S + 1])."""
    from outlines_core import Index, Vocabulary

    from .structure import _first_line

    try:
        index = Index(f"(?:{regex}){chr(END_MARK)}", Vocabulary(n_symbols + 1, {b: [i] for b, i in symbols.items()}))
    except Exception as e:  # ValueError: an expression that matches nothing, or that these symbols cannot spell
        if "following characters: []." in str(e):
            raise UsageError("the constraint cannot be compiled: the expression, or a branch of it, matches no text "
                             "(as a character class with no character in it does: [^\\s\\S])") from None
        raise UsageError(f"the constraint cannot be compiled for this model's vocabulary: {_first_line(e)}") from None
    transitions = index.get_transitions()
    names = sorted(set(transitions) | {t for e in transitions.values() for t in e.values()})
    S = len(names)
    end = symbols[chr(END_MARK).encode()]
    accepting = set(index.get_final_states())
    table = np.full((S + 1, n_symbols), S, dtype=np.int32)
    final = np.zeros(S + 1, dtype=bool)
    top = max(names) + 1
    index_of = np.full(top, S, dtype=np.int64)
    index_of[np.array(names, dtype=np.int64)] = np.arange(S)
    is_accepting = np.zeros(top, dtype=bool)
    is_accepting[np.array(sorted(accepting), dtype=np.int64)] = True
    for s, edges in transitions.items():  # each state's edges read into arrays at once
        sym = np.fromiter(edges.keys(), dtype=np.int64, count=len(edges))
        nxt = np.fromiter(edges.values(), dtype=np.int64, count=len(edges))
        keep = sym < n_symbols
        table[index_of[s], sym[keep]] = index_of[nxt[keep]]
        at_end = sym == end  # the expression is whole here (a class of characters may take the end mark too:
        if at_end.any():  # then it leads on to a state that is not accepting)
            final[index_of[s]] = bool(is_accepting[nxt[at_end][0]])
    table[:, end] = S
    return table, int(index_of[index.get_initial_state()]), final


def _reachable(table: np.ndarray, start: int, final: np.ndarray):
    """The states reachable from `start` (the dead state, last, stays last) -> (table, start, final)."""
    S1 = table.shape[0]
    reach = np.zeros(S1, dtype=bool)
    reach[start] = True
    frontier = np.array([start])
    while frontier.size:
        nxt = np.unique(table[frontier])
        frontier = nxt[~reach[nxt]]
        reach[frontier] = True
    keep = np.flatnonzero(reach[: S1 - 1])
    pos = np.full(S1, keep.size, dtype=np.int64)
    pos[keep] = np.arange(keep.size)
    table = np.vstack([pos[table[keep]], np.full((1, table.shape[1]), keep.size)]).astype(np.int32)
    final = np.concatenate([final[keep], [False]])
    return table, int(pos[start]), final


def _minimized(table: np.ndarray, start: int, final: np.ndarray):
    """Moore's refinement of the reachable states: those with the same future merged (a body's automaton is small;
    its character's end must be one state)."""
    table, start, final = _reachable(table, start, final)
    S1 = table.shape[0]
    cls = final.astype(np.int64) + 2 * (np.arange(S1) == S1 - 1)  # the dead state apart from the start
    while True:
        sig = np.concatenate([cls[:, None], cls[table]], axis=1)
        _, new = np.unique(sig, axis=0, return_inverse=True)
        new = new.reshape(-1)
        if len(np.unique(new)) == len(np.unique(cls)):
            break
        cls = new
    # renumber: the dead state's class last
    dead = cls[S1 - 1]
    order = [c for c in dict.fromkeys(cls.tolist()) if c != dead] + [dead]
    rank = np.empty(int(cls.max()) + 1, dtype=np.int64)
    rank[np.array(order)] = np.arange(len(order))
    new_of = rank[cls]
    n = len(order)
    out = np.full((n, table.shape[1]), n - 1, dtype=np.int32)
    out[new_of] = new_of[table]
    fin = np.zeros(n, dtype=bool)
    fin[new_of] = final
    return out, int(new_of[start]), fin


# ----------------------------------------------------------------------------------------------- the vocabulary


class Spelled:
    """A vocabulary as symbol sequences: flat [sum of lengths] uint32, offsets [V + 1], lens [V] (0: never written:
    a special token this structure does not name, an id past the tokenizer, a text token left out)."""

    def __init__(self, words, vocab_size: int, specials: tuple[int, ...], drop_f4: bool):
        lens = np.zeros(vocab_size, dtype=np.int64)
        pieces: list[bytes] = []
        special_at = {int(i): k for k, i in enumerate(specials) if 0 <= i < vocab_size}
        for i in range(vocab_size):
            w = words[i] if i < len(words) else None
            if i in special_at:
                pieces.append(b"")
                lens[i] = 1
            elif w and not (drop_f4 and 0xF4 in w):
                pieces.append(w)
                lens[i] = len(w)
            else:
                pieces.append(b"")
        flat = np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.uint32)
        offsets = np.zeros(vocab_size + 1, dtype=np.int64)
        offsets[1:] = np.cumsum(np.array([len(p) for p in pieces], dtype=np.int64))
        if special_at:  # a special token is one symbol: 256 + k
            flat = np.insert(flat, offsets[list(special_at)],
                             np.array([256 + k for k in special_at.values()], dtype=np.uint32))
            offsets = np.zeros(vocab_size + 1, dtype=np.int64)
            offsets[1:] = np.cumsum(lens)
        self.flat, self.offsets, self.lens = flat, offsets[:-1], lens
        self.V = vocab_size
        self.specials = len(specials)  # their symbols: 256 + k


_SPELLED: dict = {}
_BODY: dict = {}
_LOCK = threading.Lock()


def spelled(words, vocab_size: int, specials: tuple[int, ...], drop_f4: bool) -> Spelled:
    key = (id(words), vocab_size, specials, drop_f4)
    with _LOCK:
        held = _SPELLED.get(key)
        if held is None or held[0] is not words:
            held = _SPELLED[key] = (words, Spelled(words, vocab_size, specials, drop_f4))
        return held[1]


class BodyTable:
    """One body's byte automaton and every token's walk through it from each of its states (see the module's 2.):
    kind [B, V] (0 cannot be written, 1 stays inside, 2 leaves at a character's end), chars [B, V] (characters
    added), end [B, V] (the body state it ends in), at [B, V] (the symbol it leaves at). State 0 is a character's
    end. Classes: the tokens that stay inside from state 0, by (chars, end); token_class [V] (-1: none)."""

    def __init__(self, body: str, voc: Spelled, n_symbols: int, symbols: dict[bytes, int]):
        table, start, final = _minimized(*_byte_automaton(f"(?:{body})*", n_symbols, symbols))
        if not final[start] or int(final.sum()) != 1:
            raise NotClassed("a body whose characters are not one state apart")
        order = [start] + [s for s in range(table.shape[0] - 1) if s != start]  # the character's end first
        rank = np.empty(table.shape[0], dtype=np.int64)
        rank[np.array(order + [table.shape[0] - 1])] = np.arange(table.shape[0])
        self.table = np.empty_like(table)
        self.table[rank] = rank[table]
        self.dead = table.shape[0] - 1
        B, V = self.dead, voc.V
        self.kind = np.zeros((B, V), dtype=np.int8)
        self.chars = np.zeros((B, V), dtype=np.int32)
        self.end = np.zeros((B, V), dtype=np.int32)
        self.at = np.zeros((B, V), dtype=np.int32)
        every = np.flatnonzero(voc.lens > 0)
        for b in range(B):
            kind, chars, end, at = walk_body(self.table, self.dead, voc, every, np.full(every.size, b),
                                             np.zeros(every.size, dtype=np.int64))
            self.kind[b, every], self.chars[b, every], self.end[b, every], self.at[b, every] = kind, chars, end, at
        inside = self.kind[0] == 1
        pairs = self.chars[0].astype(np.int64) * B + self.end[0]
        self.token_class = np.full(V, -1, dtype=np.int32)
        keys, cls = np.unique(pairs[inside], return_inverse=True)
        self.token_class[inside] = cls.reshape(-1)
        self.class_chars, self.class_end = (keys // B).astype(np.int64), (keys % B).astype(np.int64)


def body_table(body: str, voc: Spelled, n_symbols: int, symbols: dict[bytes, int]) -> BodyTable:
    """The body's table over `voc`, made once per (body, vocabulary): over the vocabulary's own symbols (its bytes and
    special tokens) and the end mark only, so that structures with other markers (another count of bounded
    strings) share it. Its walks read no other symbol."""
    own = {b: i for b, i in symbols.items() if i < 256 + voc.specials}
    n_symbols = 256 + voc.specials + 1
    own[chr(END_MARK).encode()] = n_symbols - 1
    symbols = own
    key = (body, id(voc))
    with _LOCK:
        held = _BODY.get(key)
    if held is not None and held[0] is voc:
        return held[1]
    made = BodyTable(body, voc, n_symbols, symbols)
    with _LOCK:
        _BODY[key] = (voc, made)
    return made


# ----------------------------------------------------------------------------------------------------- walks


def walk_bytes(table: np.ndarray, dead: int, stop: np.ndarray, voc: Spelled, tokens: np.ndarray, state: np.ndarray,
               off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every token of `tokens` from its state and symbol offset through a byte automaton, at once, until it ends,
    dies (state `dead`) or reaches a state where `stop` holds (a body's start) with symbols left. -> (state, offset)."""
    state, off = state.astype(np.int64).copy(), off.astype(np.int64).copy()
    lens = voc.lens[tokens]
    act = np.flatnonzero(off < lens)
    while act.size:
        act = act[~stop[state[act]]]
        sym = voc.flat[voc.offsets[tokens[act]] + off[act]]
        state[act] = table[state[act], sym]
        off[act] += 1
        act = act[(state[act] != dead) & (off[act] < lens[act])]
    return state, off


def walk_body(table: np.ndarray, dead: int, voc: Spelled, tokens: np.ndarray, state: np.ndarray,
              off: np.ndarray):
    """Every token of `tokens` through a body's byte automaton from its state and offset -> (kind, chars, end, at)
    as BodyTable's: a byte the body has no edge on ends the walk there, a leaving (2) where the walk is at a
    character's end (state 0), else a token that cannot be written (0)."""
    n = tokens.size
    state, off = state.astype(np.int64).copy(), off.astype(np.int64).copy()
    lens = voc.lens[tokens]
    kind = np.ones(n, dtype=np.int8)
    chars = np.zeros(n, dtype=np.int32)
    act = np.flatnonzero(off < lens)
    while act.size:
        sym = voc.flat[voc.offsets[tokens[act]] + off[act]]
        nxt = table[state[act], sym]
        stuck = nxt == dead
        if stuck.any():
            s = act[stuck]
            kind[s] = np.where(state[s] == 0, 2, 0)
        go = act[~stuck]
        state[go] = nxt[~stuck]
        chars[go] += state[go] == 0
        off[go] += 1
        act = go[off[go] < lens[go]]
    return kind, chars, state, off


# ---------------------------------------------------------------------------------------------- the automaton


def class_tables(regex: str, words, vocab_size: int, specials: tuple[int, ...] = (),
                 big_group: int = BIG_GROUP) -> dict:
    """An expression over a vocabulary (token bytes, None: special; `specials`: the ids spelled by the characters
    structure.SPECIAL_BASE + k) -> the tables of constrain.TokenAutomaton, with class groups (see the module's
    docstring). NotClassed for what it does not build (the caller builds it with outlines-core's Index)."""
    from .structure import SPECIAL_BASE

    text, body, bounds = marked(regex)
    # With special tokens or markers the byte 0xF4 is not a symbol: plane 16's characters are then written only
    # as the composite symbols (a special token, a marker), so that a marker's source is the state whose one edge is
    # it (the text tokens holding a byte 0xF4 are left out, as structure.outlines_vocabulary leaves them out).
    drop_f4 = bool(specials) or bool(bounds)
    symbols: dict[bytes, int] = {bytes([b]): b for b in range(256) if not (drop_f4 and b == 0xF4)}
    for k in range(len(specials)):
        symbols[chr(SPECIAL_BASE + k).encode()] = 256 + k
    mark0 = 256 + len(specials)
    for k in range(len(bounds) + 1):  # the last: a marker no body has, live only where a class of text takes it
        symbols[chr(MARK_BASE + k).encode()] = mark0 + k
    n_symbols = mark0 + len(bounds) + 2
    symbols[chr(END_MARK).encode()] = n_symbols - 1
    voc = spelled(words, vocab_size, tuple(specials), drop_f4)
    try:
        table, start, final = _reachable(*_byte_automaton(text, n_symbols, symbols))
    except UsageError:
        if bounds and not specials:  # a character of plane 16 in the text, which the markers' symbols leave out
            raise NotClassed("plane 16 in the text") from None
        raise
    D = table.shape[0] - 1  # the dead state
    # A marker's source: a state whose only edge is the marker (the body is then the only way on); its target. A
    # state where a class of text characters takes markers (the unused one too) is not one.
    source_of = np.full(D + 1, -1, dtype=np.int64)  # state -> body index
    target_of = np.full(D + 1, -1, dtype=np.int64)  # a source -> the state after its body
    unused = mark0 + len(bounds)
    for k in range(len(bounds)):
        for s in np.flatnonzero((table[:D, mark0 + k] != D) & (table[:D, unused] == D)).tolist():
            row = table[s]
            if int((row != D).sum()) != 1 or final[s]:
                raise NotClassed("a body beside another way on")
            source_of[s], target_of[s] = k, row[mark0 + k]
    stop = source_of >= 0
    sources = np.flatnonzero(stop)
    bt = body_table(body, voc, n_symbols, symbols) if bounds else None
    for t in target_of[sources].tolist():  # what may follow a body must not also be a character of it
        firsts = np.flatnonzero(table[t, :256] != D)
        if stop[t] or (bt.table[0, firsts] != bt.dead).any():
            raise NotClassed("a body followed by one of its own characters")

    # Token-level states: ("o", q) outside bodies, ("b", source, k, body state) inside (k: characters written,
    # capped at the body's fewest where it is unbounded).
    lo_of = np.zeros(D + 1, dtype=np.int64)
    hi_of = np.full(D + 1, np.iinfo(np.int64).max, dtype=np.int64)
    cap_of = np.zeros(D + 1, dtype=np.int64)
    for s in sources.tolist():
        lo, hi = bounds[source_of[s]]
        lo_of[s], cap_of[s] = lo, hi if hi is not None else lo
        if hi is not None:
            hi_of[s] = hi

    def key_of(q: int):
        return ("b", q, 0, 0) if stop[q] else ("o", q)

    ids: dict = {}
    keys: list = []
    edges: list[tuple[int, object, str, np.ndarray]] = []  # (src id, dst key, "tokens" | "classes", ids)

    def state_id(key) -> int:
        i = ids.get(key)
        if i is None:
            if len(keys) >= MAX_STATES:  # left to the other builders: a schema's grammar, outlines-core's Index
                raise NotClassed(f"over {MAX_STATES:,} automaton states")
            i = ids[key] = len(keys)
            keys.append(key)
        return i

    first_sym = np.full(vocab_size, table.shape[1], dtype=np.int64)
    has = voc.lens > 0
    first_sym[has] = voc.flat[voc.offsets[has]]
    by_first = np.argsort(first_sym, kind="stable")
    first_cut = np.searchsorted(first_sym[by_first], np.arange(table.shape[1] + 1))
    # ... and by their first two (NS: none, a token of one symbol): a literal's state takes only the tokens that
    # begin with its next two bytes, not every token that begins with the next one
    NS = table.shape[1] + 1
    second = np.full(vocab_size, NS - 1, dtype=np.int64)
    two = voc.lens > 1
    second[two] = voc.flat[voc.offsets[two] + 1]
    pair = first_sym * NS + second
    by_pair = np.argsort(pair, kind="stable")
    pair_sorted = pair[by_pair]

    def candidates(q: int) -> np.ndarray:
        """The tokens whose walk from outside state q gets past its first two symbols (and those of one)."""
        live = np.flatnonzero(table[q] != D)
        if live.size > 32:  # most of the symbols: the tokens whose first one is live, in one pass
            alive = np.zeros(table.shape[1] + 1, dtype=bool)
            alive[live] = True
            return np.flatnonzero(alive[first_sym])
        pieces = []
        for c in live.tolist():
            after = int(table[q, c])
            nxt = np.flatnonzero(table[after] != D) if not stop[after] else None
            if nxt is None or nxt.size > 8:  # into a body, or most second symbols: every token beginning with c
                pieces.append(by_first[first_cut[c] : first_cut[c + 1]])
                continue
            for c2 in nxt.tolist() + [NS - 1]:
                a, b = np.searchsorted(pair_sorted, [c * NS + c2, c * NS + c2 + 1])
                pieces.append(by_pair[a:b])
        return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)

    def finish(tokens: np.ndarray, q: np.ndarray, off: np.ndarray) -> list:
        """Walk on tokens from outside states q at symbol offsets `off`, through bodies and out of them, to their
        end -> [(end key, token ids)] (the tokens that cannot be written left out)."""
        n = tokens.size
        q, off = q.astype(np.int64).copy(), off.astype(np.int64).copy()
        src, kk, bb = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        alive = np.zeros(n, dtype=bool)
        todo = np.arange(n)
        while todo.size:
            outside, inside = todo[q[todo] >= 0], todo[q[todo] < 0]
            nxt = []
            if outside.size:
                st, of = walk_bytes(table, D, stop, voc, tokens[outside], q[outside], off[outside])
                ok = st != D
                ended = ok & (of >= voc.lens[tokens[outside]])
                e = outside[ended]
                into = np.where(stop[st[ended]])[0]
                q[e] = st[ended]
                alive[e] = True
                q[e[into]], src[e[into]], kk[e[into]], bb[e[into]] = -1, st[ended][into], 0, 0
                go = outside[ok & ~ended]  # into a body with symbols left
                q[go], src[go], kk[go], bb[go], off[go] = -1, st[ok & ~ended], 0, 0, of[ok & ~ended]
                nxt.append(go)
            if inside.size:
                kind, chars, end, at = walk_body(bt.table, bt.dead, voc, tokens[inside], bb[inside], off[inside])
                s = src[inside]
                k = kk[inside] + chars
                ok = (kind != 0) & (k <= hi_of[s])
                stay = inside[ok & (kind == 1)]
                kk[stay], bb[stay] = np.minimum(k, cap_of[s])[ok & (kind == 1)], end[ok & (kind == 1)]
                alive[stay] = True
                out = ok & (kind == 2) & (k >= lo_of[s])
                go = inside[out]
                q[go], off[go] = target_of[s[out]], at[out]
                src[go], kk[go], bb[go] = -1, 0, 0
                nxt.append(go)
            todo = np.concatenate(nxt) if nxt else np.zeros(0, dtype=np.int64)
        return grouped(tokens[alive], q[alive], src[alive], kk[alive], bb[alive])

    def grouped(tokens, q, src, kk, bb) -> list:
        if not tokens.size:
            return []
        codes = (((q + 1) << 21 | (src + 1)) << 12 | kk) << 8 | bb  # 21 + 21 + 12 + 8 bits
        by = np.argsort(codes, kind="stable")
        sorted_codes = codes[by]
        cuts = np.flatnonzero(np.diff(sorted_codes)) + 1
        out = []
        for piece in np.split(by, cuts):
            a, b_, c, d = int(q[piece[0]]), int(src[piece[0]]), int(kk[piece[0]]), int(bb[piece[0]])
            out.append((("o", a) if a >= 0 else ("b", b_, c, d), tokens[piece]))
        return out

    leave_cache: dict = {}  # (source, body state) -> [(chars, end key, tokens)]: the tokens that leave the body
    inside_cache: dict = {}  # body state (not 0) -> [(chars, end body state, tokens)]: those that stay inside

    def leaving(s: int, b: int):
        if (s, b) not in leave_cache:
            t = np.flatnonzero(bt.kind[b] == 2)
            chars = bt.chars[b, t].astype(np.int64)
            groups = []
            for c in np.unique(chars).tolist():
                tc = t[chars == c]
                for key, ts in finish(tc, np.full(tc.size, target_of[s]), bt.at[b, tc].astype(np.int64)):
                    groups.append((c, key, ts))
            leave_cache[(s, b)] = groups
        return leave_cache[(s, b)]

    def staying(b: int):
        if b not in inside_cache:
            t = np.flatnonzero(bt.kind[b] == 1)
            pairs = bt.chars[b, t].astype(np.int64) * bt.dead + bt.end[b, t]
            groups = []
            for p in np.unique(pairs).tolist():
                groups.append((p // bt.dead, p % bt.dead, t[pairs == p]))
            inside_cache[b] = groups
        return inside_cache[b]

    queue = deque([state_id(key_of(start))])
    seen = {queue[0]}
    while queue:
        i = queue.popleft()
        key = keys[i]
        before = len(edges)
        if key[0] == "o":
            q = key[1]
            tokens = candidates(q)
            for e, ts in finish(tokens, np.full(tokens.size, q), np.zeros(tokens.size, dtype=np.int64)):
                edges.append((i, e, "tokens", ts))
        else:
            _, s, k, b = key
            lo, hi, top = int(lo_of[s]), int(hi_of[s]), int(cap_of[s])
            if b == 0:  # the classes, by target
                reach = k + bt.class_chars
                by_target: dict = {}
                for c in np.flatnonzero(reach <= hi).tolist():
                    by_target.setdefault(("b", s, min(int(reach[c]), top), int(bt.class_end[c])), []).append(c)
                for e, cs in by_target.items():
                    edges.append((i, e, "classes", np.array(cs, dtype=np.int64)))
            else:
                for c, end, ts in staying(b):
                    if k + c <= hi:
                        edges.append((i, ("b", s, min(k + c, top), end), "tokens", ts))
            for c, e, ts in leaving(s, b):
                if lo <= k + c <= hi:
                    edges.append((i, e, "tokens", ts))
        for j in range(before, len(edges)):
            d = state_id(edges[j][1])
            if d not in seen:
                seen.add(d)
                queue.append(d)

    def accepting(key) -> bool:
        if key[0] == "o":
            return bool(final[key[1]])
        _, s, k, b = key
        return b == 0 and lo_of[s] <= k <= hi_of[s] and bool(final[target_of[s]])

    return _tables(keys, ids, edges, accepting, vocab_size, big_group, bt)


def _tables(keys: list, ids: dict, edges: list, accepting, vocab_size: int, big_group: int, bt) -> dict:
    """The walk's states and edges -> automaton_tables' layout (states that cannot reach acceptance dropped, the start
    0, dist: fewest tokens to acceptance) with "classes": [(group, class set)], "class_sets", "token_class"."""
    n = len(keys)
    src = np.array([e[0] for e in edges], dtype=np.int64)
    dst = np.array([ids[e[1]] for e in edges], dtype=np.int64)
    dist = np.full(n, -1, dtype=np.int64)
    finals = [i for i, k in enumerate(keys) if accepting(k)]
    dist[finals] = 0
    back: dict[int, list[int]] = {}
    for a, b in zip(src.tolist(), dst.tolist()):
        back.setdefault(b, []).append(a)
    todo = deque(finals)
    while todo:
        s = todo.popleft()
        for p in back.get(s, ()):
            if dist[p] < 0:
                dist[p] = dist[s] + 1
                todo.append(p)
    if dist[0] < 0:
        raise UsageError("the constraint cannot be compiled for this model's vocabulary: no text its tokens spell "
                         "is accepted")
    kept = np.flatnonzero(dist >= 0)
    new = np.full(n, -1, dtype=np.int64)
    new[kept] = np.arange(kept.size)
    src_l, dst_l, tokens, offsets, big, masks, classes, class_sets = [], [], [], [0], [], [], [], []
    seen_mask: dict[bytes, int] = {}
    seen_set: dict[bytes, int] = {}
    class_size = np.bincount(bt.token_class[bt.token_class >= 0]) if bt is not None else None
    size = edge_count = 0
    order = np.lexsort((dst, src))
    for j in order.tolist():
        a, b = int(new[src[j]]), int(new[dst[j]])
        if a < 0 or b < 0:
            continue
        _, _, kind, what = edges[j]
        src_l.append(a)
        dst_l.append(b)
        g = len(src_l) - 1
        if kind == "classes":
            key = what.tobytes()
            if key not in seen_set:
                seen_set[key] = len(class_sets)
                class_sets.append(what.tolist())
            classes.append((g, seen_set[key]))
            edge_count += int(class_size[what].sum())
        elif what.size > big_group:
            key = what.tobytes()
            if key not in seen_mask:
                seen_mask[key] = len(masks)
                masks.append(what)
            big.append((g, seen_mask[key]))
            edge_count += int(what.size)
        else:
            tokens.append(what)
            size += int(what.size)
            edge_count += int(what.size)
        offsets.append(size)
    return {"S": int(kept.size), "vocab_size": vocab_size, "dist": dist[kept].tolist(), "src": src_l, "dst": dst_l,
            "tokens": (np.concatenate(tokens) if tokens else np.zeros(0)).astype(np.int32), "offsets": offsets,
            "big": big, "masks": [m.astype(np.int32) for m in masks], "edges": edge_count, "classes": classes, "class_sets": class_sets,
            "token_class": bt.token_class if bt is not None and classes else None}
