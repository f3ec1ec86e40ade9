"""The live canvas view: renders sampler events, nothing else.

It knows the event types and a function that turns one token id into text; it never reaches into the sampler
or the model. Accepted positions show the model's token in normal text, coloured by confidence (entropy);
positions still being denoised show their current noise token, dim. Redraws are throttled.
"""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .sampler import CanvasDone, Done, Step


def _confidence_style(entropy: float) -> str:
    if entropy < 0.05:
        return "bold green"
    if entropy < 0.5:
        return "yellow"
    return "red"


class CanvasView:
    """Use as a context manager; call with each event. Row 0 of a batch is shown."""

    def __init__(self, piece: Callable[[int], str], console: Console | None = None, max_fps: float = 15.0,
                 skip_ids: set[int] | None = None, decode: Callable[[list[int]], str] | None = None):
        self.piece = piece  # one token -> text, for the canvas being denoised
        self.decode = decode or (lambda ids: "".join(piece(t) for t in ids))  # a finished canvas, decoded whole
        self.console = console or Console(stderr=True)
        self.min_interval = 1.0 / max_fps
        self.skip_ids = skip_ids or set()
        self.finished_text = ""
        self.last_draw = 0.0
        self.started = time.perf_counter()
        self.tokens_done = 0
        self.forwards = 0
        self.live = Live(console=self.console, auto_refresh=False, transient=True)

    def __enter__(self) -> CanvasView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def _token_text(self, token: int) -> str:
        if token in self.skip_ids:
            return "·"
        return self.piece(token).replace("\n", "⏎")

    def render_step(self, ev: Step) -> Text:
        canvas = ev.canvas[0].tolist()
        accepted, entropy = ev.accepted[0].tolist(), ev.entropy[0].tolist()
        body = Text()
        for token, ok, h in zip(canvas, accepted, entropy):
            # an accepted position holds the token sampled there; the others hold fresh noise
            body.append(self._token_text(token), style=_confidence_style(h) if ok else "dim")
        return body

    def header(self, ev: Step) -> Text:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        per_forward = self.tokens_done / self.forwards if self.forwards else 0.0
        return Text(f"canvas {ev.canvas_index + 1} · step {ev.step}/{ev.max_steps} · "
                    f"accepted {int(ev.accepted[0].sum())} · {per_forward:.1f} tok/forward · "
                    f"{self.tokens_done / elapsed:.0f} tok/s", style="bold")

    def __call__(self, ev) -> None:
        if isinstance(ev, Step):
            self.forwards += 1
            now = time.perf_counter()
            if now - self.last_draw < self.min_interval and not bool(ev.finished[0]):
                return
            self.last_draw = now
            self.live.update(Group(Text(self.finished_text), self.header(ev), self.render_step(ev)), refresh=True)
        elif isinstance(ev, CanvasDone):
            tokens = [t for t in ev.tokens[0].tolist() if t not in self.skip_ids]
            self.tokens_done += len(tokens)
            self.finished_text += self.decode(tokens)
            self.live.update(Text(self.finished_text), refresh=True)
        elif isinstance(ev, Done):
            self.live.update(Text(""), refresh=True)
