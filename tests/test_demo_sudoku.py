"""The bundled sudoku demo (`--model demo-sudoku`): a real checkpoint that solves held-out puzzles over many steps,
the live view drawing its canvas as a board with each step's new cells highlighted, `--view-delay`, and `make demo`.
"""

from __future__ import annotations

import io
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import run_main
from rich.console import Console

from dgemma_cli.checkpoint.names import DEMO_SUDOKU
from dgemma_cli.sampler import Step
from dgemma_cli.cli.view import NEW_STYLE, Board, CanvasView, view_for

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from eval_sudoku import eval_dgemma, held_out, order_report  # noqa: E402
from train_sudoku import all_grids, is_solution, parse_answer, prompt_text, solutions, split_grids  # noqa: E402

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
HINT = {"rows": 4, "cols": 4, "box": [2, 2], "row_stride": 5}


@pytest.fixture(scope="module")
def engine():
    from dgemma_cli.engine import load

    return load("demo-sudoku", device="cpu", dtype="float32")


def test_checkpoint_is_small_in_the_real_format_and_names_its_board():
    names = {p.name for p in DEMO_SUDOKU.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "chat_template.jinja"} <= names
    assert sum(p.stat().st_size for p in DEMO_SUDOKU.iterdir()) < 20 * 2**20
    cfg = json.loads((DEMO_SUDOKU / "config.json").read_text())
    assert cfg["model_type"] == "diffusion_gemma" and cfg["architectures"] == ["DiffusionGemmaForBlockDiffusion"]
    hint = json.loads((DEMO_SUDOKU / "dgemma_view.json").read_text())["board"]
    spelled = {"prefix": "sudoku: ", "row_sep": "/", "blank": "."}
    assert Board.from_hint(hint, cfg["canvas_length"]) == Board(4, 4, (2, 2), 5, prompt=spelled)


@pytest.mark.slow
def test_the_reference_loads_it_and_answers_as_dgemma_does():
    """transformers reads the checkpoint (generation_config.json included: it refuses keys it does not know) and,
    for the same seed, returns dgemma's answers."""
    from eval_sudoku import eval_reference

    puzzles = held_out(200)[:8]
    ours, ref = eval_dgemma("demo-sudoku", puzzles, seed=3), eval_reference("demo-sudoku", puzzles, seed=3)
    assert ours["answers"] == ref["answers"]


def test_held_out_puzzles_and_their_solutions_were_never_trained_on():
    grids = all_grids()
    train, held = split_grids()
    assert len(train) + len(held) == len(grids) == 288 and not set(train) & set(held)
    puzzles = held_out(200)
    assert len({p for p, _ in puzzles}) == 200
    for puzzle, grid in puzzles:  # one solution each, on a board never trained on
        assert grid in held and solutions(puzzle, grids) == [grid] and 4 <= 16 - puzzle.count(".") <= 6


def test_solves_held_out_puzzles_over_several_steps_out_of_reading_order():
    """A few held-out puzzles, fixed seed: every answer a valid solution, the canvas taking several steps, and the
    blank cells not settling left to right."""
    puzzles = held_out(200)[:20]
    ours = eval_dgemma("demo-sudoku", puzzles, seed=0)
    for (puzzle, grid), answer in zip(puzzles, ours["answers"]):
        assert is_solution(puzzle, answer) and answer == grid, (puzzle, answer)
    assert ours["mean_steps_per_canvas"] >= 4, ours["mean_steps_per_canvas"]
    order = order_report(puzzles, ours["settle"])
    assert 0 not in order["histogram"]  # every blank cell was accepted by the end
    assert order["mean_distinct_settle_steps"] >= 3, order
    assert order["out_of_reading_order"] >= 0.5, order


# ----------------------------------------------------------------------------- the board in the live view


def _step(canvas, accepted, n, entropy=None):
    c = torch.tensor([canvas])
    e = torch.tensor([entropy or [0.0] * len(canvas)])
    return Step(0, n, 48, c, c, torch.tensor([accepted]), e, torch.tensor([False]))


def _render(view: CanvasView, ev: Step, width: int = 40) -> tuple[str, list]:
    """(the frame's text, its segments) as a terminal of `width` cells gets them."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True, color_system="truecolor")
    segments = list(console.render(view.render(ev)))
    return "".join(s.text for s in segments), segments


PIECES = {i: str(i % 10) for i in range(40)} | {35: "WIDE"}


def test_board_cells_line_up_and_new_cells_are_highlighted():
    board = Board.from_hint(HINT, 32)
    view = CanvasView(lambda t: PIECES[t], console=Console(file=io.StringIO()), max_fps=1e9, board=board)
    canvas = list(range(32))
    canvas[6] = 35  # a multi-character piece still takes one cell
    first = [i in (0, 6, 12) for i in range(32)]
    second = [i in (0, 6, 12, 1, 18) for i in range(32)]
    view(_step(canvas, first, 1))
    view(ev := _step(canvas, second, 2))
    text, segments = _render(view, ev)
    rows = [line for line in text.splitlines() if line.startswith(("│", "┌", "├", "└"))]
    assert len(rows) == 4 + 3 and len({len(r) for r in rows}) == 1, rows  # 4 rows, 3 rules, one width
    assert rows[0] == "┌─────┬─────┐" and rows[3] == "├─────┼─────┤"
    cells = [r for r in rows if r.startswith("│")]
    columns = [[i for i, ch in enumerate(r) if ch not in " │"] for r in cells]
    assert all(cols == [2, 4, 8, 10] for cols in columns), cells  # each cell at the same column on every row
    assert cells[0][2] == "0" and cells[0][4] == "1" and cells[1][4] == "W" and cells[3][10] == "8"
    # highlighted: accepted at this step and not at the one before (positions 1 and 18), and nothing else
    new = {s.text for s in segments if s.style and s.style.reverse}
    assert new == {"1", "8"}, new
    assert NEW_STYLE == "reverse bold"


@pytest.mark.parametrize("hint", [None, {"rows": 4}, {"rows": 4, "cols": 4, "row_stride": 10},
                                  {"rows": 4, "cols": 4, "box": [3, 2]}, {"rows": "x", "cols": 4}])
def test_a_hint_that_is_not_a_board_of_this_canvas_draws_text(hint):
    assert Board.from_hint(hint, 32) is None


def test_view_delay_draws_every_step_and_pauses_after_each(engine, monkeypatch):
    import dgemma_cli.cli.view as view_mod

    paused = []
    monkeypatch.setattr(view_mod.time, "sleep", lambda s: paused.append(s))
    board = Board.from_hint(engine.view_hints["board"], engine.config.canvas_length)
    console = Console(file=io.StringIO(), width=60, height=30, force_terminal=True, color_system="truecolor")
    view = view_for(engine.tokenizer, console=console, board=board, delay=0.25)  # default fps: would skip steps
    puzzle, _ = held_out(1)[0]
    with view:
        result = engine.generate(prompt_text(puzzle), seed=0, on_event=view)
    steps = sum(result.steps_per_canvas[0])
    assert view.draws == steps and paused == [0.25] * steps
    assert "┌─────┬─────┐" in console.file.getvalue()
    with pytest.raises(ValueError):
        CanvasView(str, delay=-1)


@pytest.mark.parametrize("args,message", [
    (["--view-delay", "-1"], "--view-delay must be between 0 and 60"),
    (["--view-delay", "nan"], "--view-delay must be between 0 and 60"),
    (["--view-delay", "0.5", "--view", "plain"], "cannot be combined with --view plain"),
    (["--view-delay", "0.5", "--quiet"], "cannot be combined with --quiet"),
])
def test_view_delay_is_checked_before_the_model_loads(capsys, args, message):
    assert run_main(["run", "--model", "/nonexistent", "sudoku: 1.../..../..../....", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_run_with_view_delay_draws_the_board_live(capsys, monkeypatch):
    """On a terminal, `--view-delay` paces the live view, which draws the board; stdout gets the solved board."""
    import dgemma_cli.cli.view as view_mod

    paused = []
    monkeypatch.setattr(view_mod.time, "sleep", lambda s: paused.append(s))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("TERM", "xterm-256color")
    puzzle, _ = held_out(1)[0]
    assert run_main(["run", "--model", "demo-sudoku", "--device", "cpu", "--seed", "0", "--view-delay", "0.1",
                     prompt_text(puzzle)]) == 0
    out, err = capsys.readouterr()
    assert is_solution(puzzle, parse_answer(out)), out
    assert len(paused) >= 5 and set(paused) == {0.1}
    shown = ANSI.sub("", err)
    assert shown.count("┌─────┬─────┐") == len(paused)  # one board per step drawn
    assert f"step {len(paused)}/24" in shown and f"canvas 1 done in {len(paused)} steps" in shown


@pytest.mark.slow
def test_make_demo_runs_the_sudoku_and_prints_a_solution():
    """`make demo`'s command (as `make -n` prints it), run without a terminal: exit 0, a valid solution on stdout."""
    made = subprocess.run(["make", "-s", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, check=True)
    line = next(x for x in made.stdout.splitlines() if "dgemma run" in x)
    argv = shlex.split(line)
    assert argv[0].endswith("/dgemma") and "--view-delay" in argv
    prompt = argv[-1]
    puzzle = "".join(prompt.removeprefix("sudoku: ").split("/"))
    proc = subprocess.run([sys.executable, "-m", "dgemma_cli", *argv[1:]], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert is_solution(puzzle, parse_answer(proc.stdout)), proc.stdout
    assert math.isfinite(float(argv[argv.index("--view-delay") + 1]))


def test_the_board_draws_given_cells_apart_and_a_malformed_puzzle_is_said(capsys):
    from dgemma_cli.cli.view import GIVEN_STYLE, Board, CanvasView

    hint = json.loads((DEMO_SUDOKU / "dgemma_view.json").read_text())["board"]
    board = Board.from_hint(hint, 32)
    read, warning = board.read_prompt("sudoku: ..4./..../.2.1/3...")
    assert warning is None and read.givens == {(0, 2), (2, 1), (2, 3), (3, 0)}
    for bad in ("sudoku: ..4./.../.2.1/3...", "sudoku: ..4./..../.2.1", "sudoku: ..4./..#./.2.1/3..."):
        assert board.read_prompt(bad)[1], bad
    assert board.read_prompt("upper: hello diffusions") == (board, None)  # not a puzzle at all: nothing to say
    # Drawn: every accepted cell, the given ones in their own style, the filled ones by confidence.
    view = CanvasView(lambda t: str(t), board=read)
    cells = [(str(i % 4 + 1), "green", False) for i in range(32)]
    text = view.board_text(cells)
    styles = {span.style for span in text.spans}
    assert GIVEN_STYLE in styles and "green" in styles
    assert sum(span.style == GIVEN_STYLE for span in text.spans) == 4
    assert run_main(["run", "--model", "demo-sudoku", "--device", "cpu", "--seed", "0",
                     "sudoku: ..4./.../.2.1/3..."]) == 0
    assert "is not a 4 x 4 board" in capsys.readouterr().err


def test_the_9x9_data_holds_valid_grids_and_keeps_held_out_grids_apart(tmp_path):
    """scripts/sudoku9.py (the 9x9 LoRA feasibility run): every grid a valid sudoku, a changed cell is caught, the
    puzzles keep their givens, and no held-out grid is a training grid."""
    import json
    import random

    import sudoku9

    rng = random.Random(3)
    grids = [sudoku9.random_grid(rng) for _ in range(300)]
    assert all(sudoku9.is_solution(g, "." * 81) for g in grids) and len(set(grids)) > 290
    g = grids[0]
    assert not sudoku9.is_solution(g[:40] + g[41] + g[40] + g[42:], "." * 81) or g[40] == g[41]
    puzzle = sudoku9.puzzle_of(g, 45, rng)
    assert puzzle.count(".") == 36 and sudoku9.is_solution(g, puzzle)
    sudoku9.data(tmp_path, 200, 30, 45, seed=1)
    rows = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "heldout")}
    grid_of = lambda r: r["completion"].replace("\n", "")  # noqa: E731
    assert len(rows["train"]) == 200 and {grid_of(r) for r in rows["train"]}.isdisjoint(map(grid_of, rows["heldout"]))
    for r in rows["train"][:20]:
        assert sudoku9.is_solution(grid_of(r), r["prompt"][len("sudoku: "):].replace("/", ""))
