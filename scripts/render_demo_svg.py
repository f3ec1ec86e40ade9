"""Render the README's picture: the live view's frames of one real run of the sudoku demo, side by side, as SVG.

    python scripts/render_demo_svg.py --prompt "sudoku: ..." --out docs/demo.svg     # `make demo-picture`

The run is `dgemma run --model demo-sudoku --seed 0 PROMPT` (the engine, the checkpoint's sampler settings); every
step of its canvas is drawn by the live view itself (view.CanvasView.render, the frame a terminal shows at that
step, at a width of --width cells), then the answer as stdout gets it. The frames are laid out in a grid on a Rich
console that records, and exported with Console.export_svg: nothing is drawn by hand. The tokens per second in the
headers are this run's, so they change from one rendering to the next; the frames do not (same seed, same steps).
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def frames(model: str, prompt: str, seed: int, width: int):
    """(the live view's frame after each step of the first canvas, the answer text, steps taken)."""
    from rich.console import Console

    from dgemma_cli.engine import load
    from dgemma_cli.sampler import Done, Step
    from dgemma_cli.cli.view import Board, view_for

    engine = load(model, device="cpu", dtype="float32")
    board = Board.from_hint(engine.view_hints.get("board"), engine.config.canvas_length)
    # The view draws into a console nobody sees; each frame is taken from it as the terminal would get it.
    hidden = Console(file=io.StringIO(), width=width, height=40, force_terminal=True, color_system="truecolor")
    view = view_for(engine.tokenizer, console=hidden, max_fps=1e9, board=board)
    out, done = [], None
    with view:
        for ev in engine.events(prompt, seed=seed):
            view(ev)
            if isinstance(ev, Step) and ev.canvas_index == 0:
                out.append(view.render(ev))
            elif isinstance(ev, Done):
                done = ev
    answer = engine.tokenizer.decode_answer(done.token_ids[0])[1]
    return out, answer, done.steps_per_canvas[0][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--model", default="demo-sudoku")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=40, help="terminal cells of one frame")
    ap.add_argument("--per-row", type=int, default=4, help="frames per row of the picture")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "demo.svg")
    args = ap.parse_args()

    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    shown, answer, steps = frames(args.model, args.prompt, args.seed, args.width)
    cells = [Panel(f, width=args.width + 4, border_style="grey37") for f in shown]
    cells.append(Panel(Group(Text("stdout", style="bold"), Text(""), Text(answer)), width=args.width + 4,
                       border_style="grey37"))
    grid = Table.grid(padding=(0, 1))
    for _ in range(min(args.per_row, len(cells))):
        grid.add_column()
    for i in range(0, len(cells), args.per_row):
        grid.add_row(*cells[i : i + args.per_row])
    command = f'dgemma run --model {args.model} --seed {args.seed} "{args.prompt}"'
    console = Console(record=True, file=io.StringIO(), width=min(args.per_row, len(cells)) * (args.width + 5),
                      force_terminal=True, color_system="truecolor")
    console.print(Text(f"$ {command}", style="bold"))
    console.print(grid)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(console.export_svg(title=f"{args.model}: {steps} steps", unique_id="dgemma-demo"))
    print(f"{args.out}: {len(shown)} frames ({steps} steps), answer {answer!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
