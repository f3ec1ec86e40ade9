"""The live canvas view rendered from a fixed event sequence, at two terminal widths."""

from __future__ import annotations

import io
import re

import torch
from rich.console import Console

from dgemma_cli.sampler import CanvasDone, Done, Step
from dgemma_cli.view import NOISE_GLYPHS, CanvasView

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# a character-level toy vocabulary: ids 10.. are letters; 1 is an end token, 0 pad; 100/101 open and close thought
PIECES = {0: "<pad>", 1: "<eos>", 36: " ", 37: "\n", 100: "<|channel>", 101: "<channel|>"}


def piece(t: int) -> str:
    return PIECES.get(t, chr(ord("a") + (t - 10) % 26))


def decode(ids) -> str:
    return "".join(piece(t) for t in ids)


def strip(s: str) -> str:
    return re.sub(r"<pad>|<eos>", "", s)


def step(canvas, accepted, entropy, n, index=0, max_steps=8):
    return Step(index, n, max_steps, torch.tensor([canvas]), torch.tensor([canvas]), torch.tensor([accepted]),
                torch.tensor([entropy]), torch.tensor([False]))


def render(width: int, events, height: int = 24) -> tuple[CanvasView, list[str]]:
    buf = io.StringIO()
    console = Console(file=buf, width=width, height=height, force_terminal=True, color_system="truecolor",
                      legacy_windows=False)
    view = CanvasView(piece, console=console, max_fps=1e9, skip_ids={0, 1}, decode=decode, strip=strip)
    frames = []
    with view:
        for ev in events:
            view(ev)
            if isinstance(ev, Step):
                frames.append(view.render(ev))
    return view, frames


def plain(console_renderable, width: int) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=True, color_system="truecolor").print(console_renderable)
    return buf.getvalue()


CANVAS_1 = [17, 14, 21, 21, 24, 36, 32, 24, 27, 21, 13, 1]  # "hello world" then <eos>
THOUGHT = [100, 29, 17, 24, 30, 16, 17, 29, 37, 17, 22, 22, 101, 10, 11, 12, 0, 0]  # <|channel>thought\nhmm<channel|>abc
EVENTS = [
    step(CANVAS_1, [True, False, False, True, False, False, False, False, False, False, False, False],
         [0.01, 2.0, 2.0, 0.3, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0], 1),
    step(CANVAS_1, [True] * 6 + [False] * 6, [0.01] * 5 + [0.9] + [2.0] * 6, 2),
    CanvasDone(0, torch.tensor([CANVAS_1]), [3], torch.tensor([True])),
    step(THOUGHT, [True] * len(THOUGHT), [0.0] * len(THOUGHT), 1, index=1),
    CanvasDone(1, torch.tensor([THOUGHT]), [1], torch.tensor([True])),
    Done([[]], [[3, 1]], [5.0], 0.1),
]


def test_step_frame_shows_accepted_tokens_in_colour_and_noise_dim():
    _, frames = render(80, EVENTS)
    out = plain(frames[0], 80)
    text = ANSI.sub("", out)
    assert "canvas 1 · step 1/8 · +2 accepted" in text
    # accepted positions show their token; the other ten positions show one noise glyph each
    body = text.strip().splitlines()[-1]
    assert body[0] == "h" and body[3] == "l"
    assert sum(ch in NOISE_GLYPHS for ch in body) == 10
    assert "\x1b[2m" in out  # noise is dim
    assert "\x1b[32m" in out or "38;2;0;128;0" in out or "\x1b[92m" in out  # a confident token is green


def test_finished_canvases_flow_into_the_answer_and_thought_is_apart():
    view, frames = render(80, EVENTS)
    second = ANSI.sub("", plain(frames[2], 80))
    assert second.splitlines()[0] == "hello world"  # the finished first canvas, above the header
    assert "canvas 2" in second
    final = ANSI.sub("", plain(view.answer_so_far(), 80))
    assert "thinking ▸ hmm" in final and final.rstrip().endswith("abc") and "<|channel>" not in final
    dimmed = plain(view.answer_so_far(), 80)
    assert "\x1b[2;3m" in dimmed or "\x1b[3;2m" in dimmed or "\x1b[2m" in dimmed  # the thought is dimmed


def test_fits_the_width_and_rewraps_when_it_shrinks():
    long_canvas = list(range(10, 10 + 26)) * 4  # 104 positions
    ev = step(long_canvas, [True] * 104, [0.0] * 104, 3)
    for width in (80, 40):
        _, frames = render(width, [ev])
        lines = ANSI.sub("", plain(frames[0], width)).rstrip("\n").splitlines()
        assert max(len(line) for line in lines) <= width
        assert len(lines) >= (104 // width) + 1


def test_long_answers_keep_only_the_last_lines_that_fit():
    canvas = [10 + (i % 26) for i in range(40)] + [36]  # letters then a space
    events = [CanvasDone(i, torch.tensor([canvas * 2]), [1], torch.tensor([False])) for i in range(20)]
    events.append(step(canvas, [True] * len(canvas), [0.0] * len(canvas), 1, index=20))
    view, frames = render(40, events, height=12)
    lines = ANSI.sub("", plain(frames[-1], 40)).rstrip("\n").splitlines()
    assert len(lines) <= 12


def test_throttle_skips_redraws_without_touching_tensors():
    buf = io.StringIO()
    view = CanvasView(piece, console=Console(file=buf, width=80, force_terminal=True), max_fps=1.0, decode=decode)

    class Untouchable:
        def __getitem__(self, i):
            raise AssertionError("the view read a tensor between redraws")

    with view:
        view(EVENTS[0])  # drawn
        skipped = Step(0, 2, 8, Untouchable(), Untouchable(), Untouchable(), Untouchable(), Untouchable())
        for _ in range(50):
            view(skipped)
    assert view.draws == 1 and view.forwards == 51
