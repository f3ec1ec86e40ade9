"""What a person sees while an answer is generated: the live canvas view, the plain progress lines, and which of
them (`choose_view`). Both render sampler events, nothing else.

They know the event types and two functions from token ids to text; they never reach into the sampler or the model.

Layout (redrawn in place on a terminal, gone when generation ends):
- the answer so far: finished canvases, decoded whole (so characters split across canvases come out right); a
  thought channel (`<|channel>thought ... <channel|>`) shows dimmed and apart, under a "thinking" label; only the
  last lines that fit the terminal are kept, so the view never scrolls;
- a header: canvas number, step n of N, tokens newly accepted at this step (accepted now, not at the previous step)
  and accepted in all, tokens per forward pass and tokens per second, both by `sampler.tokens_per_forward`'s
  definition: the finished canvases' kept tokens (`CanvasDone.kept`) plus the non-pad tokens accepted on the canvas
  being denoised, over the forward passes so far; when a canvas finishes the header gives its exact figures, so the
  last one shown equals `Done.tokens_per_forward` (and `--json`'s);
- the canvas being denoised, every position in order: the positions accepted this step show their token,
  coloured by confidence (entropy: green sure, yellow, red unsure); the others are still noise and show as one dim
  scrambled glyph each, a different one every step. With a board layout (`Board`, from a hint a checkpoint gives in
  its `dgemma_view.json`, `{"board": {...}}`, which the caller reads), the cells are drawn as a grid instead, one
  fixed-width cell per position, boxes ruled, and the cells accepted at this step and not at the one before are
  highlighted (reverse video): the order in which the model settles cells shows, anywhere on the board.
Redraws are throttled (`max_fps`); between redraws a step event costs a counter increment and keeping a reference
to its `accepted` tensor (to tell what is new at the next redraw); no tensor is read, so a GPU is never synchronised
for the view. With a delay (`--view-delay`) every step is drawn and the view then pauses: generation waits for it, so
a fast model's real steps can be followed by eye (the time paused is left out of the tokens per second).
The width follows the terminal at every redraw. When the terminal gets narrower, terminals that re-wrap what they
show (most do) turn each row of the last frame into several; the region (`_Region`) counts the rows the last frame
takes at the new width, wrapping double-width characters as a terminal does, and erases them all before drawing, so
no stale header is left on the screen.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, TextIO

from rich.cells import cell_len, set_cell_size
from rich.console import Console, Group
from rich.control import Control
from rich.live import Live
from rich.live_render import LiveRender
from rich.segment import ControlType, Segment
from rich.text import Text

from ..sampler import CanvasDone, Done, Step, tokens_per_forward
from ..tokenizer import split_thought

NOISE_GLYPHS = "░▒▓▖▗▘▝▚▞■□▪▫◇◆◊"
DEFAULT_FPS = 8.0  # redraws per second at most: a full 256-token frame costs a few ms (BENCHMARKS.md)


def is_dumb(term: str | None) -> bool:
    """A terminal that cannot move the cursor (Rich's test: TERM dumb or unknown); an unset TERM is not one."""
    return (term or "").strip().lower() in ("dumb", "unknown")


def choose_view(requested: str | None, *, stdout_tty: bool, stderr_tty: bool, term: str | None,
                as_json: bool = False, quiet: bool = False) -> str:
    """What `dgemma run` shows on stderr while it generates: "live", "plain" or "none".

    requested: --view, None for the default. The default: nothing with --quiet or when stderr is not a terminal
    (nobody watches it); the live view when stdout and stderr are both a terminal; plain lines otherwise (stdout
    redirected, or --json, whose object then arrives on a clean stdout). The live view needs a terminal that moves
    the cursor: asked for on a dumb one (TERM=dumb) or with stderr not a terminal, it falls back to plain lines.
    """
    if quiet or requested == "none":
        return "none"
    live_ok = stderr_tty and not is_dumb(term)
    if requested == "live":
        return "live" if live_ok else "plain"
    if requested == "plain":
        return "plain"
    if not stderr_tty:
        return "none"
    return "live" if live_ok and stdout_tty and not as_json else "plain"


class PlainProgress:
    """--view plain: one line per finished canvas on `stream` (stderr), with the figures the live header gives."""

    def __init__(self, stream: TextIO | None = None, mid_line: Callable[[], bool] | None = None):
        """mid_line: whether the screen's cursor is in the middle of a line someone else wrote (the answer, on
        the same terminal): a progress line then starts on a line of its own, never after the answer's text."""
        self.stream = stream
        self.mid_line = mid_line
        self.started = time.perf_counter()
        self.kept = 0  # row 0's tokens kept so far (CanvasDone.kept summed)
        self.forwards = 0  # row 0's forward passes so far (CanvasDone.steps summed)

    def __call__(self, ev) -> None:
        if not isinstance(ev, CanvasDone):
            return
        self.kept += ev.kept[0] if ev.kept else 0
        self.forwards += ev.steps[0]
        rate = self.kept / max(time.perf_counter() - self.started, 1e-9)
        stream = self.stream or sys.stderr
        if self.mid_line is not None and self.mid_line():
            stream.write("\n")
        stream.write(f"dgemma: canvas {ev.canvas_index + 1} done in {ev.steps[0]} steps "
                     f"({tokens_per_forward(self.kept, self.forwards):.1f} tok/forward, {rate:,.0f} tok/s)\n")
        stream.flush()


def wrapped_rows(text: str, width: int) -> int:
    """Rows a terminal `width` cells wide shows one line of `text` in: cells fill each row in turn, and a character
    wider than what is left of a row starts the next one."""
    rows, col = 1, 0
    for ch in text:
        cells = cell_len(ch)
        if col + cells > width:
            rows, col = rows + 1, 0
        col += cells
    return rows


class _Region(LiveRender):
    """Rich's live region, aware that a terminal re-wraps the rows it shows when it gets narrower.

    Rich moves the cursor up by the row count of the last frame to erase it. A frame drawn at width W has rows of up
    to W cells; after the terminal shrinks to w < W, a re-wrapping terminal shows each row as several, so moving up by
    the old count left the frame's upper rows (the header among them) on the screen. Here the count is taken at the
    current width, cell by cell as a terminal wraps: a double-width character (CJK, most emoji) that does not fit in
    a row's last cell starts the next row, so a row can take more than ceil(cells / w) rows. The cursor stays on the
    frame's last row, which a terminal keeps on the screen when it re-wraps (tmux pushes the rows a narrower width
    adds above the cursor into its scrollback: they are erased when still on the screen, and no program can reach
    them there). A terminal that truncates instead of re-wrapping, such as xterm, then has those extra rows erased
    above the frame: lines that were already on the screen, never the scrollback.
    """

    def __init__(self, console: Console):
        super().__init__(Text(""), vertical_overflow="crop")
        self.console = console
        self._rows: list[str] = []  # the text of each row of the last frame
        self._drawn_at = 0  # the terminal width it was drawn at

    def rows_on_screen(self) -> int:
        width = self.console.width
        if width >= self._drawn_at:  # rows are separate lines (Rich ends each with a newline): wider joins none
            return len(self._rows)
        return sum(wrapped_rows(row, width) for row in self._rows)

    def __rich_console__(self, console, options):
        segments = list(super().__rich_console__(console, options))
        self._rows = ["".join(seg.text for seg in row if not seg.control) for row in Segment.split_lines(segments)]
        self._drawn_at = options.max_width
        yield from segments

    def _erase(self, up: int) -> Control:
        return Control(ControlType.CARRIAGE_RETURN, (ControlType.ERASE_IN_LINE, 2),
                       *(((ControlType.CURSOR_UP, 1), (ControlType.ERASE_IN_LINE, 2)) * up))

    def position_cursor(self) -> Control:
        """Erase the last frame, every row it now takes, leaving the cursor at its first row."""
        return Control() if self._shape is None else self._erase(self.rows_on_screen() - 1)

    def restore_cursor(self) -> Control:
        """Erase the last frame when the view closes (the cursor is on the line below it)."""
        return Control() if self._shape is None else self._erase(self.rows_on_screen())


@dataclass(frozen=True)
class Board:
    """Where a board's cells sit in the canvas: row r, column c is canvas position `r * row_stride + c`.

    rows x cols cells, ruled into boxes of box[0] x box[1] cells (a sudoku's); each cell is `cell_width` terminal
    cells wide, so every cell lines up whatever token it shows. Positions outside the board (separators, the end
    token, padding) are not drawn, but count in the header as every position does.
    """

    rows: int
    cols: int
    box: tuple[int, int]  # (box rows, box columns); the whole board is one box when the hint gives none
    row_stride: int
    cell_width: int = 1
    prompt: dict | None = None  # how a prompt spells a board: {"prefix", "row_sep", "blank"} (the hint's "prompt")
    givens: frozenset = frozenset()  # (row, column) of the cells the prompt gave: drawn apart from the filled ones

    @classmethod
    def from_hint(cls, hint, canvas_length: int) -> Board | None:
        """A checkpoint's `board` hint (a dict) -> a Board, or None when there is none or it does not describe a
        board that fits the canvas (the view then draws the canvas as text: a bad hint never stops generation)."""
        if not isinstance(hint, dict):
            return None
        try:
            rows, cols = int(hint["rows"]), int(hint["cols"])
            box = tuple(int(x) for x in hint.get("box", (rows, cols)))
            stride = int(hint.get("row_stride", cols))
            width = int(hint.get("cell_width", 1))
        except (KeyError, TypeError, ValueError):
            return None
        if rows < 1 or cols < 1 or stride < cols or not 1 <= width <= 8 or len(box) != 2:
            return None
        if min(box) < 1 or rows % box[0] or cols % box[1]:
            return None
        if (rows - 1) * stride + cols > canvas_length:
            return None
        prompt = hint.get("prompt")
        ok = isinstance(prompt, dict) and all(isinstance(prompt.get(k), str) for k in ("prefix", "row_sep", "blank"))
        return cls(rows, cols, box, stride, width, prompt if ok else None)

    def read_prompt(self, text: str) -> tuple[Board, str | None]:
        """The board with the cells `text` gives marked, and a warning when `text` does not spell a board as the
        hint says (the model was trained on boards spelled one way; another may not be solved): (board, None)
        when it does, or when the hint says nothing of prompts."""
        p = self.prompt
        if p is None or not text.startswith(p["prefix"]):
            return self, None
        rows = text[len(p["prefix"]):].strip().split(p["row_sep"])
        shape = (f"{self.rows} rows of {self.cols} cells joined by '{p['row_sep']}', '{p['blank']}' for a blank, "
                 f"after '{p['prefix']}'")
        if len(rows) != self.rows or any(len(r) != self.cols for r in rows):
            return self, f"the prompt is not a {self.rows} x {self.cols} board ({shape}): it may not be solved"
        givens = frozenset((r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch != p["blank"])
        odd = sorted({ch for row in rows for ch in row if ch != p["blank"] and not ch.isalnum()})
        if odd:
            return self, f"the prompt's board holds {' '.join(odd)}, neither a symbol nor a blank ({shape})"
        return replace(self, givens=givens), None

    def position(self, r: int, c: int) -> int:
        return r * self.row_stride + c

    def rule(self, left: str, mid: str, right: str) -> str:
        """A horizontal rule, `┌─────┬─────┐` for 2 x 2 boxes: a box is a space before each cell, and one after."""
        span = "─" * (self.box[1] * (self.cell_width + 1) + 1)
        return left + mid.join([span] * (self.cols // self.box[1])) + right


NEW_STYLE = "reverse bold"  # a cell accepted at this step and not at the one before
GIVEN_STYLE = "bold bright_white underline"  # a board cell the prompt gave (the rest: by the model's confidence)


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
                 strip: Callable[[str], str] | None = None, pad_id: int | None = None, board: Board | None = None,
                 delay: float = 0.0):
        if not (math.isfinite(delay) and delay >= 0):
            raise ValueError(f"the view's delay must be a finite number of seconds >= 0 (got {delay})")
        self.piece = piece  # one token -> text, for the canvas being denoised
        self.board = board  # draw the canvas as this board (None: as text, every position in order)
        self.delay = delay  # seconds to pause after drawing each step (0: none, and redraws are throttled)
        self.paused = 0.0  # seconds paused so far, left out of the tokens per second
        self.decode = decode or (lambda ids: "".join(piece(t) for t in ids))  # finished canvases, decoded whole
        self.strip = strip or (lambda s: s)  # removes special-token strings from finished text
        self.console = console or Console(stderr=True)
        self.min_interval = 1.0 / max_fps
        self.skip_ids = skip_ids or set()
        self.pad_id = pad_id  # accepted pad and end tokens are not counted as kept (the sampler does not count them)
        self.finished_ids: list[int] = []
        self._answer = None  # (key, the answer so far as laid out)
        self._pieces: dict[int, str] = {}
        self.last_draw = 0.0
        self.started = time.perf_counter()
        self.forwards = 0  # step events seen
        self.kept = 0  # row 0's tokens kept by finished canvases (CanvasDone.kept summed)
        self.forwards_done = 0  # row 0's forward passes on finished canvases (CanvasDone.steps summed)
        self._canvas_steps: list[int] = []  # steps of each finished canvas
        self._accepted = None  # [B, C] bool: the last step's accepted positions (a reference: never read between draws)
        self._before = None  # the same for the step before it on this canvas (None at a canvas's first step)
        self.draws = 0
        self.draw_seconds = 0.0  # time spent rendering, for the overhead measurement
        self.live = Live(console=self.console, auto_refresh=False, transient=True, redirect_stdout=False,
                         redirect_stderr=False, vertical_overflow="crop")
        self.live._live_render = _Region(self.console)  # Rich's region, counting rows the terminal re-wrapped

    def __enter__(self) -> CanvasView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.update(Text(""))  # Live draws once more on closing, uncropped: nothing left to overflow the screen
        self.live.__exit__(*exc)
        if self.forwards_done:  # what was seen, in one line that stays when the view is gone
            self.console.print(self.summary(), style="dim", highlight=False, soft_wrap=True)

    def summary(self) -> str:
        """`dgemma: 3 canvases, 41 steps · 1.7 tok/forward · 240 tok/s` over the canvases finished."""
        canvases = len(self._canvas_steps)
        return (f"dgemma: {canvases} canvas{'es' if canvases != 1 else ''}, {self.forwards_done} steps · "
                f"{self.rates(self.kept, self.forwards_done)}")

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

    def rates(self, kept: int, forwards: int) -> str:
        """Tokens per forward pass (the sampler's definition) and per second, for `kept` tokens so far."""
        per_second = kept / max(time.perf_counter() - self.started - self.paused, 1e-9)
        return f"{tokens_per_forward(kept, forwards):.1f} tok/forward · {per_second:,.0f} tok/s"

    def header(self, ev: Step, counts: tuple[int, int, int]) -> Text:
        """counts: (positions newly accepted at this step, accepted in all, accepted non-pad tokens)."""
        new, accepted, kept = counts
        return Text(f"canvas {ev.canvas_index + 1} · step {ev.step}/{ev.max_steps} · +{new} accepted "
                    f"({accepted}/{ev.canvas.shape[-1]}) · "
                    f"{self.rates(self.kept + kept, self.forwards_done + ev.step)}", style="bold")

    def done_header(self, ev: CanvasDone) -> Text:
        """After a canvas: its steps, and the exact figures so far (the last ones equal Done's)."""
        return Text(f"canvas {ev.canvas_index + 1} done in {ev.steps[0]} steps · "
                    f"{self.rates(self.kept, self.forwards_done)}", style="bold")

    def cells(self, ev: Step) -> tuple[list[tuple[str, str, bool]], tuple[int, int, int]]:
        """Per canvas position (text, style, accepted at this step and not at the one before), and the counts
        (positions newly accepted at this step, accepted in all, accepted non-pad)."""
        canvas = ev.canvas[0].tolist()
        accepted, entropy = ev.accepted[0].tolist(), ev.entropy[0].tolist()
        before = self._before[0].tolist() if self._before is not None else [False] * len(accepted)
        out: list[tuple[str, str, bool]] = []
        new = n = kept = 0
        for i, (token, ok, was, h) in enumerate(zip(canvas, accepted, before, entropy)):
            if ok:
                n += 1
                new += not was
                kept += token != self.pad_id and token not in self.skip_ids  # as the sampler: no pad, no end id
                out.append((self.token_text(token), confidence_style(h), not was))
            else:  # still noise: one scrambled glyph
                out.append((NOISE_GLYPHS[(i * 7 + ev.step * 13) % len(NOISE_GLYPHS)], "dim", False))
        return out, (new, n, kept)

    def canvas_text(self, ev: Step) -> tuple[Text, tuple[int, int, int]]:
        """(the canvas as text, or as the board when there is one; the counts, as `cells` gives them)."""
        cells, counts = self.cells(ev)
        if self.board is not None:
            return self.board_text(cells), counts
        runs: list[tuple[str, str]] = []  # (text, style), neighbours of one style merged: fewer spans to lay out
        for text, style, _ in cells:
            if runs and runs[-1][1] == style:
                runs[-1] = (runs[-1][0] + text, style)
            else:
                runs.append((text, style))
        return Text.assemble(*runs), counts

    def board_text(self, cells: list[tuple[str, str, bool]]) -> Text:
        """The board's cells as a ruled grid, each cell `cell_width` wide; new cells highlighted (NEW_STYLE)."""
        b = self.board
        lines = [Text(b.rule("┌", "┬", "┐"), style="dim")]
        for r in range(b.rows):
            if r and r % b.box[0] == 0:
                lines.append(Text(b.rule("├", "┼", "┤"), style="dim"))
            line = Text()  # no base style: a cell's style is its own
            line.append("│", style="dim")
            for c in range(b.cols):
                if c and c % b.box[1] == 0:
                    line.append(" │", style="dim")
                text, style, new = cells[b.position(r, c)]
                if (r, c) in b.givens and style != "dim":  # the prompt's own cell: not the model's to fill
                    style = GIVEN_STYLE
                line.append(" ")
                line.append(set_cell_size(text, b.cell_width), style=f"{style} {NEW_STYLE}" if new else style)
            line.append(" │", style="dim")
            lines.append(line)
        lines.append(Text(b.rule("└", "┴", "┘"), style="dim"))
        return Text("\n").join(lines)

    def token_text(self, token: int) -> str:
        """How one accepted token shows (cached: the same ids come back every step)."""
        text = self._pieces.get(token)
        if text is None:
            text = "·" if token in self.skip_ids else self.piece(token).replace("\n", "⏎")
            self._pieces[token] = text
        return text

    def render(self, ev: Step) -> Group:
        """The frame for the last step event seen (its accepted positions compared with the step's before)."""
        body, counts = self.canvas_text(ev)
        return Group(self.answer_so_far(), self.header(ev, counts), body)

    # -- events ------------------------------------------------------------------------------------------

    def __call__(self, ev) -> None:
        if isinstance(ev, Step):
            self.forwards += 1
            self._before, self._accepted = (self._accepted if ev.step > 1 else None), ev.accepted
            now = time.perf_counter()
            if not self.delay and now - self.last_draw < self.min_interval:
                return
            self.live.update(self.render(ev), refresh=True)
            self.last_draw = time.perf_counter()
            self.draws += 1
            self.draw_seconds += self.last_draw - now
            if self.delay:  # generation waits here: the real steps, at a pace a person can follow
                time.sleep(self.delay)
                self.paused += time.perf_counter() - self.last_draw
        elif isinstance(ev, CanvasDone):
            t = time.perf_counter()
            self.finished_ids += [int(x) for x in ev.tokens[0].tolist() if int(x) not in self.skip_ids]
            self.kept += ev.kept[0] if ev.kept else 0
            self.forwards_done += ev.steps[0]
            self._canvas_steps.append(ev.steps[0])
            self._accepted = self._before = None
            self.live.update(Group(self.answer_so_far(), self.done_header(ev)), refresh=True)
            self.draw_seconds += time.perf_counter() - t
        elif isinstance(ev, Done):
            self.live.update(Text(""), refresh=True)


def view_for(tok, console: Console | None = None, max_fps: float = DEFAULT_FPS, board: Board | None = None,
             delay: float = 0.0) -> CanvasView:
    """The view for a tokenizer (dgemma_cli.tokenizer.Tokenizer): pad, end-of-sequence and end-of-turn tokens are
    not shown, special-token strings are stripped from finished text. board: the canvas's layout (Board.from_hint
    on the checkpoint's hint), delay: seconds to pause after each step drawn."""
    skip = {i for i in (tok.pad_id, tok.eos_id, tok.end_of_turn_id) if i is not None}
    return CanvasView(lambda t: tok.decode([t], skip_special_tokens=False), console=console, max_fps=max_fps,
                      skip_ids=skip, decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
                      strip=tok.strip_special, pad_id=tok.pad_id, board=board, delay=delay)
