"""An answer as its canvases finish: what is known for sure so far, and writing it out as it settles.

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


class FinishedCanvases:
    """Row 0's finished canvases. `write` (optional) receives each newly settled piece of the answer's text."""

    def __init__(self, tokenizer, settings, raw: bool = False, write: Callable[[str], None] | None = None):
        self.tok = tokenizer
        self.raw = raw
        self.limit = settings.max_new_tokens
        self.ends = set(settings.eos_token_ids) | ({tokenizer.end_of_turn_id} - {None})
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
        if self.write is None or was_ended:
            return
        if self.ended:  # the answer is complete: no later canvas can change it
            settled = self.answer()
        else:
            settled = self.answer().rstrip()
            while settled.endswith("\ufffd"):  # half a character: its other bytes are in the next canvas
                settled = settled[:-1]
        if len(settled) > len(self.written) and settled.startswith(self.written):
            self.write(settled[len(self.written):])
            self.written = settled

    @property
    def ids(self) -> list[int]:
        """The answer's ids so far: up to the first end id, at most max_new_tokens."""
        kept = self.tokens[: self.limit]
        cut = next((k for k, t in enumerate(kept) if t in self.ends), len(kept))
        return kept[:cut]

    def thought_and_answer(self) -> tuple[str, str]:
        ids = self.ids
        return ("", self.tok.decode(ids)) if self.raw else self.tok.decode_answer(ids)

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
