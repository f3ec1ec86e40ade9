"""An answer as its canvases finish: what is known for sure so far, and writing it out as it settles. The one
place that turns finished canvases into text (AnswerText), for `dgemma run`, the server and Ollama's API.

A block-diffusion answer grows one whole canvas at a time, so a pipe can receive it canvas by canvas
(`dgemma run ... | cat` sees text before generation ends), and an interrupted run still has every finished
canvas. Both need the same thing: the finished canvases' ids cut as a whole answer is cut (at the first
end-of-sequence id, and at max_new_tokens) and decoded as a whole answer is decoded (thought split off, special
tokens removed, surrounding whitespace stripped).

Writing is append-only, so only text that later canvases cannot change is written: trailing whitespace (the
whole answer is stripped; the next canvas may continue it or not) and a trailing incomplete character (a byte
token whose partner is in the next canvas decodes as U+FFFD) wait for the next canvas. Decoding more ids only
appends to what fewer ids decoded to, apart from those two cases, so what is streamed is a prefix of the final
answer, and `finish` completes it.
"""

from __future__ import annotations

from typing import Callable


class AnswerText:
    """The answer of finished canvases, handed out as deltas that only ever append: the one place that turns
    canvases into text, for `dgemma run` (FinishedCanvases), the server and Ollama's API.

    The ids are cut at the first of `ends` and at `limit`. chat: decoded as a chat answer (thought channel apart,
    special tokens removed, stripped), else as its bytes (raw prompts, completions, infill, structured answers).
    tools: tool calls are not content (the text stops where one starts; `tool_calls` reads them). Text a later
    canvas may still change waits: trailing whitespace (chat: the answer is stripped), an incomplete character, and
    the start of a possible stop string (`stops`: the answer ends before the first one found).
    """

    def __init__(self, tok, *, limit: int, ends, chat: bool, tools: bool = False, stops=()):
        self.tok, self.chat, self.stops, self.tools = tok, chat, list(stops), tools
        self.ends = set(ends)
        self.limit = limit
        self.ids: list[int] = []
        self.sent, self.sent_thought = "", ""
        self.stopped = False

    def cut(self, ids: list[int]) -> list[int]:
        """The answer's ids: up to the first end id, at most `limit`."""
        end = next((i for i, t in enumerate(ids) if t in self.ends), len(ids))
        return ids[: min(end, self.limit)]

    def texts(self, ids: list[int], final: bool) -> tuple[str, str]:
        thought, answer = self.texts_of(self.cut(ids))
        hits = [i for i in (answer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return thought, answer[: min(hits)]
        if not final:
            answer = answer.rstrip("\ufffd")
            for s in self.stops:  # the longest end of the text that could begin a stop string
                for k in range(min(len(s) - 1, len(answer)), 0, -1):
                    if answer.endswith(s[:k]):
                        answer = answer[:-k]
                        break
            thought = thought.rstrip("\ufffd")
        return thought, answer

    def returned_tokens(self) -> int:
        """Tokens behind the text returned: up to the end token or the limit, and after a stop string's cut only
        those needed for the text before it (the fewest whose answer reaches its length, trailing whitespace
        aside: a decoded answer is stripped)."""
        ids = self.cut(self.ids)
        if not self.stopped:
            return len(ids)
        want = len(self.sent.rstrip()) + len(self.sent_thought.rstrip())
        lo, hi = 0, len(ids)  # the answer's length grows with the tokens decoded: the first prefix long enough
        while lo < hi:
            mid = (lo + hi) // 2
            thought, answer = self.texts_of(ids[:mid])
            if len(thought) + len(answer) >= want:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def texts_of(self, ids: list[int]) -> tuple[str, str]:
        if self.tools:  # as decode_answer, the answer cut where a tool call starts (calls are not content)
            from .tools import CALL_START

            text, restore = self.tok.decode_marked(ids)  # a call starts at its token, never at text spelling it
            thought, answer = self.tok.split_thought(text)
            cut = answer.find(CALL_START)
            answer = answer if cut < 0 else answer[:cut]
            return self.tok.strip_special(restore(thought)).strip(), self.tok.strip_special(restore(answer)).strip()
        return self.tok.decode_answer(ids) if self.chat else ("", self.tok.decode(ids))

    def tool_calls(self, ids: list[int]) -> list[dict]:
        """The calls in the answer's ids (cut as its text is), as OpenAI's message.tool_calls."""
        if not self.tools:
            return []
        from .tools import openai_calls, parse_tool_calls

        text, restore = self.tok.decode_marked(self.cut(ids))  # calls between the call tokens, not text spelling them
        _, answer = self.tok.split_thought(text)

        def restored(v):
            if isinstance(v, str):
                return restore(v)
            if isinstance(v, dict):
                return {restored(k): restored(x) for k, x in v.items()}
            return [restored(x) for x in v] if isinstance(v, list) else v

        return openai_calls([restored(c) for c in parse_tool_calls(answer)[1]])

    def add(self, canvas: list[int]) -> tuple[str, str]:
        """One more finished canvas -> the (answer, thought) text it settles."""
        return self.advance(self.ids + canvas, final=False)

    def advance(self, ids: list[int], final: bool) -> tuple[str, str]:
        """All the finished canvases' ids so far (final: the answer is complete, nothing waits) -> the new text."""
        self.ids = list(ids)
        return self._delta(*self.texts(self.ids, final=final))

    def finish(self, token_ids: list[int]) -> tuple[str, str]:
        return self._delta(*self.texts(token_ids, final=True))

    def _delta(self, thought: str, answer: str) -> tuple[str, str]:
        da = answer[len(self.sent) :] if answer.startswith(self.sent) else ""
        dt = thought[len(self.sent_thought) :] if thought.startswith(self.sent_thought) else ""
        self.sent += da
        self.sent_thought += dt
        return da, dt



class FinishedCanvases:
    """Row 0's finished canvases in `dgemma run`: their AnswerText, and `write` (optional) receiving each newly
    settled piece of the answer's text."""

    def __init__(self, tokenizer, settings, raw: bool = False, write: Callable[[str], None] | None = None):
        self.tok = tokenizer
        self.raw = raw
        self.limit = settings.max_new_tokens
        self.ends = set(settings.eos_token_ids) | ({tokenizer.end_of_turn_id} - {None})
        self.text = AnswerText(tokenizer, limit=self.limit, ends=self.ends, chat=not raw)
        self.write = write
        self.tokens: list[int] = []  # every finished canvas's ids, pads included
        self.steps: list[int] = []  # forward passes each finished canvas took
        self.kept_tokens = 0  # tokens the answer keeps: the numerator of sampler.tokens_per_forward
        self.ended = False  # an end id was seen: no later canvas adds to the answer
        self.written = ""  # the answer text written so far

    def add(self, tokens: list[int], steps: int, kept: int) -> None:
        """One finished canvas of row 0: its ids [C], the steps it took and the tokens the answer keeps of it
        (sampler.CanvasDone's fields)."""
        self.tokens += tokens
        self.kept_tokens += kept
        if steps:
            self.steps.append(steps)
        was_ended = self.ended
        self.ended = len(self.tokens) >= self.limit or any(t in self.ends for t in self.tokens[: self.limit])
        delta, _ = self.text.advance(self.tokens, final=self.ended)  # an ended answer: nothing waits
        if self.write is None or was_ended or not delta:
            return
        self.write(delta)
        self.written += delta

    @property
    def ids(self) -> list[int]:
        """The answer's ids so far: up to the first end id, at most max_new_tokens."""
        return self.text.cut(self.tokens)

    def thought_and_answer(self) -> tuple[str, str]:
        return self.text.texts_of(self.ids)

    def answer(self) -> str:
        return self.thought_and_answer()[1]

    def finish(self, answer: str) -> None:
        """Write the rest of the final `answer` and its newline: stdout then holds what `_answer_line` would have
        written at once."""
        if self.write is None:
            return
        line = answer if answer.endswith("\n") else answer + "\n"
        common = 0  # what was written is a prefix of the answer (the module's docstring); were it ever not, the
        while common < min(len(line), len(self.written)) and line[common] == self.written[common]:
            common += 1  # rest would continue from where the two agree
        if line[common:]:
            self.write(line[common:])
        self.written = line
