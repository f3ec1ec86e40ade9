"""The live canvas view: renders sampler events, nothing else.

It knows the event types and two functions from token ids to text; it never reaches into the sampler or the model.

Layout (redrawn in place on a terminal, gone when generation ends):
- the answer so far: finished canvases, decoded whole (so characters split across canvases come out right); a
  thought channel (`<|channel>thought ... <channel|>`) shows dimmed and apart, under a "thinking" label; only the
  last lines that fit the terminal are kept, so the view never scrolls;
- a header: canvas number, step n of N, tokens accepted this step, tokens per forward pass, tokens per second;
- the canvas being denoised, every position in order: the positions accepted this step show their token,
  coloured by confidence (entropy: green sure, yellow, red unsure); the others are still noise and show as one dim
  scrambled glyph each, a different one every step.
Redraws are throttled (`max_fps`); between redraws an event costs a counter increment and touches no tensor, so
a GPU is never synchronised for the view. The width follows the terminal at every redraw (resizing works).
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .sampler import CanvasDone, Done, Step
from .tokenizer import split_thought

NOISE_GLYPHS = "░▒▓▖▗▘▝▚▞■□▪▫◇◆◊"
DEFAULT_FPS = 8.0  # redraws per second at most: a full 256-token frame costs a few ms (BENCHMARKS.md)


def confidence_style(entropy: float) -> str:
    if entropy < 0.05:
        return "green"
    if entropy < 0.5:
        return "yellow"
    return "red"


class CanvasView:
    """Use as a context manager; call with each event. Row 0 of a batch is shown."""

    def __init__(self, piece: Callable[[int], str], console: Console | None = None, max_fps: float = DEFAULT_FPS,
                 skip_ids: set[int] | None = None, decode: Callable[[list[int]], str] | None = None,
                 strip: Callable[[str], str] | None = None):
        self.piece = piece  # one token -> text, for the canvas being denoised
        self.decode = decode or (lambda ids: "".join(piece(t) for t in ids))  # finished canvases, decoded whole
        self.strip = strip or (lambda s: s)  # removes special-token strings from finished text
        self.console = console or Console(stderr=True)
        self.min_interval = 1.0 / max_fps
        self.skip_ids = skip_ids or set()
        self.finished_ids: list[int] = []
        self._answer = None  # (key, the answer so far as laid out)
        self._pieces: dict[int, str] = {}
        self.last_draw = 0.0
        self.started = time.perf_counter()
        self.forwards = 0
        self.draws = 0
        self.draw_seconds = 0.0  # time spent rendering, for the overhead measurement
        self.live = Live(console=self.console, auto_refresh=False, transient=True, redirect_stdout=False,
                         redirect_stderr=False, vertical_overflow="crop")

    def __enter__(self) -> CanvasView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    # -- pieces ------------------------------------------------------------------------------------------

    def answer_so_far(self) -> Text:
        """Finished canvases: the thought dimmed under a label, then the answer; the last lines that fit. Made
        again only when a canvas finishes or the terminal changes size."""
        key = (len(self.finished_ids), self.console.size)
        if self._answer is not None and self._answer[0] == key:
            return self._answer[1]
        text = self.decode(self.finished_ids)
        thought, answer = split_thought(text)
        out = Text()
        thought = self.strip(thought).strip()
        if thought or "<|channel>" in text and "<channel|>" not in text:
            out.append("thinking ▸ ", style="dim italic")
            out.append(thought + "\n", style="dim italic")
        out.append(self.strip(answer).lstrip("\n"))
        room = max(1, self.console.size.height - 8)
        lines = out.wrap(self.console, self.console.size.width)
        if len(lines) > room:
            lines = lines[-room:]
        answer = Text("\n").join(lines)
        self._answer = (key, answer)
        return answer

    def header(self, ev: Step, accepted_now: int) -> Text:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        done = len(self.finished_ids)
        per_forward = (done + accepted_now) / self.forwards if self.forwards else 0.0
        return Text(f"canvas {ev.canvas_index + 1} · step {ev.step}/{ev.max_steps} · +{accepted_now} accepted · "
                    f"{per_forward:.1f} tok/forward · {(done + accepted_now) / elapsed:,.0f} tok/s", style="bold")

    def canvas_text(self, ev: Step) -> tuple[Text, int]:
        """(the canvas as text, positions accepted this step)."""
        canvas = ev.canvas[0].tolist()
        accepted, entropy = ev.accepted[0].tolist(), ev.entropy[0].tolist()
        runs: list[tuple[str, str]] = []  # (text, style), neighbours of one style merged: fewer spans to lay out
        n = 0
        for i, (token, ok, h) in enumerate(zip(canvas, accepted, entropy)):
            if ok:
                n += 1
                text, style = self.token_text(token), confidence_style(h)
            else:  # still noise: one scrambled glyph
                text, style = NOISE_GLYPHS[(i * 7 + ev.step * 13) % len(NOISE_GLYPHS)], "dim"
            if runs and runs[-1][1] == style:
                runs[-1] = (runs[-1][0] + text, style)
            else:
                runs.append((text, style))
        return Text.assemble(*runs), n

    def token_text(self, token: int) -> str:
        """How one accepted token shows (cached: the same ids come back every step)."""
        text = self._pieces.get(token)
        if text is None:
            text = "·" if token in self.skip_ids else self.piece(token).replace("\n", "⏎")
            self._pieces[token] = text
        return text

    def render(self, ev: Step) -> Group:
        body, n = self.canvas_text(ev)
        return Group(self.answer_so_far(), self.header(ev, n), body)

    # -- events ------------------------------------------------------------------------------------------

    def __call__(self, ev) -> None:
        if isinstance(ev, Step):
            self.forwards += 1
            now = time.perf_counter()
            if now - self.last_draw < self.min_interval:
                return
            self.live.update(self.render(ev), refresh=True)
            self.last_draw = time.perf_counter()
            self.draws += 1
            self.draw_seconds += self.last_draw - now
        elif isinstance(ev, CanvasDone):
            t = time.perf_counter()
            self.finished_ids += [int(x) for x in ev.tokens[0].tolist() if int(x) not in self.skip_ids]
            self.live.update(self.answer_so_far(), refresh=True)
            self.draw_seconds += time.perf_counter() - t
        elif isinstance(ev, Done):
            self.live.update(Text(""), refresh=True)


def view_for(tok, console: Console | None = None, max_fps: float = DEFAULT_FPS) -> CanvasView:
    """The view for a tokenizer (dgemma_cli.tokenizer.Tokenizer): pad, end-of-sequence and end-of-turn tokens are
    not shown, special-token strings are stripped from finished text."""
    skip = {i for i in (tok.pad_id, tok.eos_id, tok.end_of_turn_id) if i is not None}
    return CanvasView(lambda t: tok.decode([t], skip_special_tokens=False), console=console, max_fps=max_fps,
                      skip_ids=skip, decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
                      strip=tok.strip_special)
