"""The live canvas view rendered from a fixed event sequence, at two terminal widths; its figures against the
sampler's on a real generation; a terminal that re-wraps on shrinking; which view a run gets; the plain lines."""

from __future__ import annotations

import io
import json
import re
import sys

import pyte
import wcwidth
import pytest
import torch
from cli_helpers import run_main
from rich.console import Console

from dgemma_cli.sampler import CanvasDone, Done, Step
from dgemma_cli.cli.view import NOISE_GLYPHS, CanvasView, PlainProgress, choose_view, view_for

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


def test_newly_accepted_counts_only_what_the_step_before_had_not():
    # step 2 accepts positions 0..5; positions 0 and 3 were accepted at step 1 already: 4 are new, 6 in all
    _, frames = render(80, EVENTS)
    assert "+4 accepted (6/12)" in ANSI.sub("", plain(frames[1], 80))
    # a new canvas starts afresh: all 18 of its first step are new
    assert "+18 accepted (18/18)" in ANSI.sub("", plain(frames[2], 80))


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


def terminal_console(buf: io.StringIO, width: int, height: int = 50) -> Console:
    return Console(file=buf, width=width, height=height, force_terminal=True, color_system="truecolor",
                   legacy_windows=False)


@pytest.fixture(scope="module")
def demo_engine():
    from dgemma_cli.engine import load

    return load("demo", device="cpu", dtype="float32")


@pytest.mark.parametrize("prompt,max_new_tokens,canvases", [
    ("upper: hello diffusions", None, 1),  # the demo's answer: one canvas of 2 steps, "HELLO DIFFUSIONS"
    ("upper: hello diffusions and more words here", 128, 4),  # 4 canvases of 2 to 37 steps
])
def test_header_figures_are_the_samplers_on_a_real_generation(monkeypatch, demo_engine, prompt, max_new_tokens,
                                                              canvases):
    """Every step drawn: "+N accepted" is the positions accepted now and not at the step before, and the last
    tok/forward shown is Done's (what --json reports), by the sampler's definition."""
    monkeypatch.setenv("TERM", "xterm-256color")
    engine = demo_engine
    buf = io.StringIO()
    view = view_for(engine.tokenizer, console=terminal_console(buf, 200, height=80), max_fps=1e9)
    before, done, steps, differs = None, None, 0, False
    with view:
        for ev in engine.events(prompt, seed=3, max_new_tokens=max_new_tokens or engine.settings.max_new_tokens):
            mark = len(buf.getvalue())
            view(ev)
            drawn = ANSI.sub("", buf.getvalue()[mark:])
            if isinstance(ev, Step):
                accepted = ev.accepted[0]
                new = int((accepted & ~before).sum()) if before is not None and ev.step > 1 else int(accepted.sum())
                before = accepted
                shown = re.search(r"step (\d+)/\d+ · \+(\d+) accepted", drawn)
                assert shown and int(shown[1]) == ev.step, drawn
                assert int(shown[2]) == new, drawn
                assert f"accepted ({int(accepted.sum())}/32)" in drawn  # and how many in all, of the canvas's 32
                differs |= new != int(accepted.sum())
                steps += 1
            elif isinstance(ev, Done):
                done = ev
    assert done is not None and steps >= 2 and len(done.steps_per_canvas[0]) == canvases
    assert differs  # some step re-accepted positions: "new" was tested apart from "all"
    figures = re.findall(r"([0-9.]+) tok/forward", ANSI.sub("", buf.getvalue()))
    assert figures[-1] == f"{done.tokens_per_forward[0]:.1f}"
    from dgemma_cli.sampler import tokens_per_forward

    assert tokens_per_forward(view.kept, view.forwards_done) == done.tokens_per_forward[0]


def tty(text: str) -> str:
    """What reaches the terminal: the tty driver turns each newline into carriage return + newline."""
    return text.replace("\n", "\r\n")


def reflowed(screen: pyte.Screen, width: int) -> tuple[pyte.Screen, pyte.Stream]:
    """The screen a terminal that re-wraps (as most do) shows after shrinking to `width` columns: each row of n
    characters becomes ceil(n / width) rows; the cursor stays after the same character."""
    rows = [line.rstrip() for line in screen.display]
    new = pyte.Screen(width, screen.lines)
    stream = pyte.Stream(new)
    out, cursor = [], (0, 0)
    for y, row in enumerate(rows):
        chunks = [row[i:i + width] for i in range(0, len(row), width)] or [""]
        if y == screen.cursor.y:
            line = min(screen.cursor.x // width, len(chunks) - 1)
            cursor = (len(out) + line, screen.cursor.x - line * width)
        out += chunks
    while out and not out[-1] and len(out) > cursor[0] + 1:
        out.pop()
    assert len(out) <= screen.lines, "the test keeps everything on the screen"
    stream.feed("\r\n".join(out))
    stream.feed(f"\x1b[{cursor[0] + 1};{cursor[1] + 1}H")
    return new, stream


def test_shrinking_a_rewrapping_terminal_leaves_one_header(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    canvas = list(range(10, 10 + 26)) * 8  # 208 positions: rows of 100 cells that re-wrap at 60
    screen = pyte.Screen(100, 40)
    stream = pyte.Stream(screen)
    stream.feed("$ dgemma run hello\r\n")  # what was on the terminal before
    buf = io.StringIO()
    console = terminal_console(buf, 100, height=40)
    view = CanvasView(piece, console=console, max_fps=1e9, skip_ids={0, 1}, decode=decode, strip=strip)
    with view:
        view(step(canvas, [True] * 100 + [False] * 108, [0.0] * 208, 1))
        stream.feed(tty(buf.getvalue()))
        assert sum("step 1/8" in row for row in screen.display) == 1
        console.width = 60
        screen, stream = reflowed(screen, 60)
        assert sum("step 1/8" in row for row in screen.display) == 1  # re-wrapped, not yet redrawn
        mark = len(buf.getvalue())
        view(step(canvas, [True] * 150 + [False] * 58, [0.0] * 208, 2))
        stream.feed(tty(buf.getvalue()[mark:]))
    headers = [row for row in screen.display if "canvas 1 · step" in row]
    assert len(headers) == 1 and "step 2/8" in headers[0], screen.display
    assert screen.display[0].startswith("$ dgemma run hello")  # nothing above the view was erased
    assert max(len(row.rstrip()) for row in screen.display) <= 60


def test_closing_the_view_leaves_what_was_there_and_a_summary(monkeypatch):
    monkeypatch.setenv("TERM", "xterm-256color")
    screen = pyte.Screen(80, 30)
    stream = pyte.Stream(screen)
    stream.feed("$ dgemma run hello\r\n")
    buf = io.StringIO()
    view = CanvasView(piece, console=terminal_console(buf, 80, height=30), max_fps=1e9, skip_ids={0, 1},
                      decode=decode, strip=strip)
    with view:
        for ev in EVENTS[:4]:  # interrupted in the middle of a canvas: no Done event clears the view
            view(ev)
    stream.feed(tty(buf.getvalue()))
    rows = [row.rstrip() for row in screen.display if row.strip()]
    assert rows[0] == "$ dgemma run hello" and len(rows) == 2
    assert rows[1].startswith(f"dgemma: 1 canvas, {view.forwards_done} steps · ")  # the finished canvas's figures


@pytest.mark.parametrize("requested,stdout_tty,stderr_tty,term,as_json,quiet,expected", [
    (None, True, True, "xterm-256color", False, False, "live"),
    (None, True, True, "dumb", False, False, "plain"),  # no cursor movement: lines instead
    (None, False, True, "xterm", False, False, "plain"),  # stdout redirected, a person watches stderr
    (None, True, True, "xterm", True, False, "plain"),  # --json: the object comes on a clean stdout
    (None, True, False, "xterm", False, False, "none"),  # stderr redirected: nobody watches it
    (None, False, False, "xterm", False, False, "none"),
    (None, True, True, "xterm", False, True, "none"),  # --quiet
    (None, True, True, None, False, False, "live"),  # TERM unset (Windows terminals) is not dumb
    ("live", True, True, "dumb", False, False, "plain"),  # asked for, cannot be drawn: plain, no error
    ("live", True, False, "xterm", False, False, "plain"),
    ("live", False, True, "xterm", True, False, "live"),
    ("plain", False, False, "xterm", False, False, "plain"),
    ("none", True, True, "xterm", False, False, "none"),
])
def test_choose_view(requested, stdout_tty, stderr_tty, term, as_json, quiet, expected):
    assert choose_view(requested, stdout_tty=stdout_tty, stderr_tty=stderr_tty, term=term, as_json=as_json,
                       quiet=quiet) == expected


def test_plain_progress_says_each_canvas_with_the_samplers_figures():
    out = io.StringIO()
    progress = PlainProgress(out)
    for ev in EVENTS[:2]:
        progress(ev)  # steps say nothing
    assert out.getvalue() == ""
    progress(CanvasDone(0, torch.tensor([CANVAS_1]), [3], torch.tensor([False]), [12]))
    progress(CanvasDone(1, torch.tensor([THOUGHT]), [5], torch.tensor([True]), [16]))
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"dgemma: canvas 1 done in 3 steps \(4\.0 tok/forward, [0-9,]+ tok/s\)", lines[0])
    assert lines[1].startswith("dgemma: canvas 2 done in 5 steps (3.5 tok/forward, ")  # 28 tokens / 8 forwards


PLAIN_LINE = r"dgemma: canvas 1 done in \d+ steps \(([0-9.]+) tok/forward, [0-9,]+ tok/s\)"


@pytest.mark.parametrize("stderr_tty,term,args,progress", [
    (True, "xterm-256color", [], True),  # stdout redirected, stderr a terminal: plain lines by default
    (True, "dumb", ["--view", "live"], True),  # live asked for where it cannot be drawn: plain lines, no error
    (False, "xterm-256color", [], False),  # nobody watches stderr
])
def test_run_shows_progress_where_a_person_watches_stderr(capsys, monkeypatch, stderr_tty, term, args, progress):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: stderr_tty)
    monkeypatch.setenv("TERM", term)
    code = run_main(["run", "upper: hello diffusions", "--model", "demo", "--device", "cpu", "--seed", "0",
                     "--json", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    answer = json.loads(out)  # stdout: the object alone
    if progress:
        shown = re.fullmatch(PLAIN_LINE + "\n", err)
        assert shown, err
        assert shown[1] == f"{answer['tokens_per_forward']:.1f}"  # the figure --json gives
    else:
        assert err == ""


def cells(text: str) -> int:
    return sum(max(0, wcwidth.wcwidth(ch)) for ch in text)


def wrap_cells(line: str, width: int) -> list[tuple[str, int]]:
    """A line split into rows as a terminal does (a wide character that does not fit starts the next row): each
    row's text and the cell it starts at."""
    rows, text, col, start = [], "", 0, 0
    for ch in line:
        w = max(0, wcwidth.wcwidth(ch))
        if col + w > width:
            rows.append((text, start))
            text, start, col = "", start + col, 0
        text, col = text + ch, col + w
    return rows + [(text, start)]


class BottomAnchoredTerminal:
    """A terminal that re-wraps as tmux 3.3 does: on a width change every logical line (rows joined where the
    terminal itself wrapped them) is split again at the new width, cell by cell; the screen shows the last `height`
    rows of history + screen (so rows a narrower width adds push the top rows into the scrollback); the cursor keeps
    its place in the text, clamped to the screen's first row when that place went into the scrollback."""

    def __init__(self, width: int, height: int):
        self.height = height
        self.history: list[tuple[str, bool]] = []  # (text, wrapped: continues on the next row)
        self.screen = pyte.Screen(width, height)
        self.stream = pyte.Stream(self.screen)
        self.wrapped = [False] * height

    def feed(self, text: str) -> None:
        self.screen.dirty.clear()
        self.stream.feed(tty(text))
        for y in self.screen.dirty:  # rows the program wrote or erased are its own lines again
            self.wrapped[y] = False

    def resize(self, width: int) -> None:
        rows = self.history + [(line.rstrip(), w) for line, w in zip(self.screen.display, self.wrapped)]
        cy = len(self.history) + self.screen.cursor.y
        lines, cursor = [], None  # logical lines; the cursor as (line, cell offset)
        for i, (text, _) in enumerate(rows):
            if i and rows[i - 1][1]:
                lines[-1] += text
            else:
                lines.append(text)
            if i == cy:
                cursor = (len(lines) - 1, cells(lines[-1]) - cells(text) + self.screen.cursor.x)
        out, at = [], (0, 0)
        for n, line in enumerate(lines):
            chunks = wrap_cells(line, width)
            if n == cursor[0]:
                k = max(j for j, (_, start) in enumerate(chunks) if start <= cursor[1] or j == 0)
                at = (len(out) + k, cursor[1] - chunks[k][1])
            out += [(text, j < len(chunks) - 1) for j, (text, _) in enumerate(chunks)]
        hsize = max(0, len(out) - self.height)
        self.history, shown = out[:hsize], out[hsize:]
        shown += [("", False)] * (self.height - len(shown))
        self.screen = pyte.Screen(width, self.height)
        self.stream = pyte.Stream(self.screen)
        self.stream.feed("\r\n".join(text for text, _ in shown))
        self.wrapped = [w for _, w in shown]
        self.stream.feed(f"\x1b[{max(0, at[0] - hsize) + 1};{min(at[1], width - 1) + 1}H")


@pytest.mark.parametrize("draw_between", [True, False])
def test_resizing_100_50_100_leaves_no_stale_row_with_wide_characters(monkeypatch, draw_between):
    """A terminal that re-wraps as tmux does, a frame whose rows hold a double-width character (which starts a new
    row where it does not fit, so a 100-cell row takes three rows at 50, not two): after shrinking and widening,
    with a frame drawn at the narrow width or not, the screen shows one frame, and closing leaves none."""
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setitem(PIECES, 102, "中")
    canvas = ([10] * 49 + [102] + [11] * 49) * 2 + [12] * 10  # 208 positions: rows of 49 + 2 + 49 = 100 cells
    term = BottomAnchoredTerminal(100, 30)
    term.feed("".join(f"earlier output {i}\n" for i in range(20)) + "$ dgemma run hello\n")  # the frame low down
    buf = io.StringIO()
    console = terminal_console(buf, 100, height=30)
    view = CanvasView(piece, console=console, max_fps=1e9, skip_ids={0, 1}, decode=decode, strip=strip)
    widths = [100, 50, 100] if draw_between else [100, 100]
    with view:
        for n, width in enumerate(widths, start=1):
            if width != console.width or (n == 2 and not draw_between):
                for w in ([width] if draw_between else [50, 100]):
                    console.width = w
                    term.resize(w)
            mark = len(buf.getvalue())
            view(step(canvas, [True] * 208, [0.0] * 208, n))
            term.feed(buf.getvalue()[mark:])
            headers = [row for row in term.screen.display if "canvas 1 · step" in row]
            assert len(headers) == 1 and f"step {n}/8" in headers[0], term.screen.display
            assert sum("中" in row for row in term.screen.display) == 2, term.screen.display
        mark = len(buf.getvalue())
    term.feed(buf.getvalue()[mark:])
    assert not any("canvas 1 · step" in row for row in term.screen.display)  # closed: the frame is gone
    assert any(row.startswith("$ dgemma run hello") for row in term.screen.display)
