"""The log-probabilities of an answer's tokens, as the OpenAI API returns them (`logprobs`, `top_logprobs`).

What a canvas decoder reports: every token of an answer is the argmax of its canvas's last denoising step (the
canvas keeps the argmax canvas of the step at which it stopped; docs/design.md, The sampler), so a token's
log-probability is taken from that step's distribution, the sampler's: log_softmax(logits / T) at that step's
temperature T, with its k most likely alternatives from the same distribution (the batch loop computes them for a
row that asks, once per canvas: batching.token_logprobs). Under greedy decoding (`temperature: 0`) the schedule's
temperature still shapes that distribution, and an unconstrained token is always its top alternative. A structured
answer's token is the best path's, which need not be the position's own argmax; the distribution reported is still
the model's, unmasked.

Which tokens: those behind the text the client gets (`content` or `text`), in order, and the pieces they are given
concatenate to exactly that text: the answer's own decoding strips surrounding whitespace, drops special tokens,
the thought channel and tool calls, and cuts at a stop string, so the tokens outside it are left out and the first
and last piece are cut to it; a character split over byte tokens is the piece of the token that completes it (the
earlier ones get ""). `bytes` are the UTF-8 bytes of the piece. Alternatives are named by their own text.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass
class Entry:
    piece: str  # this token's part of the answer text
    token: int
    logprob: float
    top: list[tuple[int, float]]


class AnswerLogprobs:
    """An answer's token log-probabilities as its canvases finish (batching.RowCanvas.logprobs), handed out in
    step with its text (answer.AnswerText): `take` returns the entries of the tokens behind the text sent since the
    last call."""

    def __init__(self, tok, text):
        self.tok, self.text = tok, text
        self.values: list[tuple[float, list[tuple[int, float]]]] = []  # per generated position, all canvases
        self.done = 0  # candidates (see _spans) handed out or passed over
        self.offset = 0  # characters of text handed out (completions' text_offset)
        self._specials: set[int] | None = None
        self._bytes: set[int] | None = None  # byte-fallback tokens ("<0xE4>")
        self._names: dict[int, str] = {}  # alternatives' text, decoded once each
        self._ends: list[int] = []  # _spans_by_prefix: per leading id, its prefix's end, settled for good

    def add(self, canvas_logprobs) -> None:
        self.values += canvas_logprobs or []

    def take(self, final: bool = False) -> list[Entry]:
        """The entries of tokens now wholly inside the sent text (final: every token inside it, the last cut to it)."""
        ids = self.text.cut(self.text.ids)
        sent = self.text.sent
        spans, lo = self._spans(ids, sent)
        hi = lo + len(sent)
        out = []
        while self.done < len(spans):
            i, s, e = spans[self.done]
            if e <= lo and not (e == s == lo and lo < hi):  # before the text (stripped whitespace)
                self.done += 1
                continue
            if s >= hi or (not final and e > hi):  # after the text, or not wholly sent yet
                if final:
                    self.done += 1
                    continue
                break
            self.done += 1
            if i < len(self.values):
                value, top = self.values[i]
                out.append(Entry(self.joined[max(s, lo) : min(e, hi)], ids[i], value, top))
        return out

    # ------------------------------------------------------------------ where each token's text is

    def _spans(self, ids: list[int], sent: str) -> tuple[list[tuple[int, int, int]], int]:
        """([(index in ids, start, end)] of the tokens that may stand in the text, in order, over self.joined; the
        offset of the text in it). Each token's bytes decoded in a row; checked against the text, and where a
        tokenizer decodes otherwise, each prefix's text is decoded instead (slower, exact)."""
        tok, text = self.tok, self.text
        table = tok.token_bytes()
        specials = self._special_ids()
        answer = text.chat or text.tools  # decoded as a chat answer: thought apart, calls cut, stripped
        keep = range(len(ids))
        if answer:
            keep = self._answer_region(ids)
        byte_tokens = self._byte_tokens()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        spans, pieces, at, run = [], [], 0, []

        def flush() -> None:
            # A run of byte-fallback tokens decodes as the tokenizers library's ByteFallback decoder decodes it:
            # valid UTF-8, its characters (each the piece of the token completing it); else one U+FFFD per token.
            # (Python's decoder would write one per invalid sequence: the texts would differ, and the exact way,
            # quadratic in the answer's length, would run on the event loop for every canvas.)
            nonlocal at
            try:
                b"".join(table[t] for _, t in run).decode("utf-8")
                chars = codecs.getincrementaldecoder("utf-8")()
                cut = [chars.decode(table[t]) for _, t in run]
            except UnicodeDecodeError:
                cut = ["\ufffd"] * len(run)
            for (i, _), piece in zip(run, cut):
                spans.append((i, at, at + len(piece)))
                pieces.append(piece)
                at += len(piece)
            run.clear()

        for i in keep:
            t = ids[i]
            if t in specials:
                if answer:  # decoded with its special tokens (then removed), which end a run of bytes
                    flush()
                continue
            if t in byte_tokens:
                run.append((i, t))
                continue
            flush()
            raw = table[t] if 0 <= t < len(table) else None
            piece = decoder.decode(raw) if raw is not None else tok.decode([t])
            spans.append((i, at, at + len(piece)))
            pieces.append(piece)
            at += len(piece)
        flush()
        joined = "".join(pieces)
        lo = len(joined) - len(joined.lstrip()) if answer else 0
        if joined[lo : lo + len(sent)] == sent:
            self.joined = joined
            return spans, lo
        return self._spans_by_prefix(ids, sent), 0

    def _spans_by_prefix(self, ids: list[int], sent: str) -> list[tuple[int, int, int]]:
        """Each token's span as what its prefix's answer text adds (the answer's own decoding, quadratic)."""
        self.joined = sent
        spans, at = [], 0
        ends = self._ends  # the text only grows, and a prefix's text is its ids': an end once settled stays so
        for i in range(len(ids)):
            if i < len(ends):
                end = ends[i]
            else:
                prefix = self.text.texts_of(ids[: i + 1])[1].rstrip("\ufffd")
                end = len(prefix) if sent.startswith(prefix) else at
                if len(ends) == i and (len(prefix) <= len(sent) or not prefix.startswith(sent)):
                    ends.append(end)  # settled: a prefix of the text for good, or never one
            if end > at:
                spans.append((i, at, end))
                at = end
        if ids and at < len(sent) and self.text.texts_of(ids)[1] == sent:  # the whole text: its last characters
            # (U+FFFD of bytes that no later token completes, each prefix's stripped) are the last token's
            i, s, _ = spans.pop() if spans and spans[-1][0] == len(ids) - 1 else (len(ids) - 1, at, at)
            spans.append((i, s, len(sent)))
        return spans

    def _answer_region(self, ids: list[int]) -> list[int]:
        """The indices of a chat answer's ids outside its thought channel and before its first tool call."""
        tok = self.tok
        from ..tokenizer import CHANNEL_END, CHANNEL_START
        from ..tools import CALL_START

        start, end, call = tok.token_id(CHANNEL_START), tok.token_id(CHANNEL_END), tok.token_id(CALL_START)
        keep = list(range(len(ids)))
        if start is not None and start in ids:
            s = ids.index(start)
            e = ids.index(end, s) if end is not None and end in ids[s:] else len(ids)
            keep = keep[:s] + keep[e + 1 :]
        if self.text.tools and call is not None:
            cut = next((k for k, i in enumerate(keep) if ids[i] == call), len(keep))
            keep = keep[:cut]
        return keep

    def _byte_tokens(self) -> set[int]:
        """The ids of the vocabulary's byte-fallback tokens ("<0x0A>"), as token_bytes reads them."""
        if self._bytes is None:
            from ..tokenizer import _BYTE_TOKEN

            table, inner = self.tok.token_bytes(), self.tok._tokenizer
            self._bytes = {i for i, raw in enumerate(table) if raw is not None and len(raw) == 1
                           and _BYTE_TOKEN.fullmatch(inner.id_to_token(i) or "")}
        return self._bytes

    def _special_ids(self) -> set[int]:
        if self._specials is None:
            raw = self.tok._tokenizer.get_added_tokens_decoder()
            self._specials = {i for i, t in raw.items() if t.special}
        return self._specials

    # ------------------------------------------------------------------ the API's shapes

    def name(self, token: int) -> str:
        name = self._names.get(token)
        if name is None:
            name = self._names[token] = self.tok.decode([token], skip_special_tokens=False)
        return name

    def token_bytes(self, token: int) -> list[int]:
        table = self.tok.token_bytes()
        raw = table[token] if 0 <= token < len(table) else None
        return list(raw if raw is not None else self.name(token).encode())

    def chat(self, entries: list[Entry]) -> list[dict]:
        """Chat completions' `logprobs.content` items."""
        return [{"token": e.piece, "logprob": e.logprob, "bytes": list(e.piece.encode()),
                 "top_logprobs": [{"token": self.name(t), "logprob": v, "bytes": self.token_bytes(t)}
                                  for t, v in e.top]} for e in entries]

    def responses(self, entries: list[Entry]) -> list[dict]:
        """The Responses API's `logprobs` of an output_text."""
        return [{"token": e.piece, "logprob": e.logprob,
                 "top_logprobs": [{"token": self.name(t), "logprob": v} for t, v in e.top]} for e in entries]

    def completion(self, entries: list[Entry]) -> dict:
        """Completions' `logprobs`: tokens, token_logprobs, top_logprobs (the k most likely and the chosen token,
        by text), text_offset (in the completion's text)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            out["tokens"].append(e.piece)
            out["token_logprobs"].append(e.logprob)
            top = {self.name(t): v for t, v in e.top}
            top.setdefault(e.piece, e.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(e.piece)
        return out
