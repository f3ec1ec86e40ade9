"""9x9 sudoku for the LoRA feasibility run on the bundled demo model (BENCHMARKS.md, "LoRA adapters"): data as
`dgemma tune` reads it, and held-out accuracy.

    .venv/bin/python scripts/sudoku9.py data --out /tmp/sudoku9                # train.jsonl, heldout.jsonl
    .venv/bin/python scripts/sudoku9.py eval /tmp/sudoku9/heldout.jsonl --adapter /tmp/tune9 [--steps 10]

Grids: the canonical pattern relabelled and shuffled by sudoku's symmetries (digits, rows within bands, bands,
columns within stacks, stacks, transpose), seeded; a held-out grid never equals a training grid. A puzzle keeps
`--givens` cells of its grid. Prompt `sudoku: 53..7..../6..195.../...` (rows joined by /), completion the nine rows
joined by newlines (89 characters: three of the demo's 32-token canvases). Solved: the answer is a valid board that
keeps every given (a puzzle may have other solutions than its grid; any counts); cells: the share of blank cells
equal to the puzzle's grid.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def random_grid(rng: random.Random) -> str:
    """A solved 9x9 grid, 81 digits row by row."""
    digits = rng.sample(range(1, 10), 9)
    bands, stacks = rng.sample(range(3), 3), rng.sample(range(3), 3)
    rows = [3 * b + r for b in bands for r in rng.sample(range(3), 3)]
    cols = [3 * s + c for s in stacks for c in rng.sample(range(3), 3)]
    cell = (lambda r, c: (r, c)) if rng.random() < 0.5 else (lambda r, c: (c, r))
    out = []
    for r in rows:
        for c in cols:
            i, j = cell(r, c)
            out.append(str(digits[(3 * (i % 3) + i // 3 + j) % 9]))
    return "".join(out)


def is_solution(board: str, puzzle: str) -> bool:
    """81 digits forming a valid sudoku that keeps every given of `puzzle` (81 characters, '.' for a blank)."""
    if len(board) != 81 or not board.isdigit() or any(p != "." and p != b for p, b in zip(puzzle, board)):
        return False
    full = set("123456789")
    units = [[9 * r + c for c in range(9)] for r in range(9)] + [[9 * r + c for r in range(9)] for c in range(9)]
    units += [[9 * (3 * br + r) + 3 * bc + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
    return all({board[i] for i in u} == full for u in units)


def prompt_text(puzzle: str) -> str:
    return "sudoku: " + "/".join(puzzle[9 * r : 9 * r + 9] for r in range(9))


def answer_text(board: str) -> str:
    return "\n".join(board[9 * r : 9 * r + 9] for r in range(9))


def puzzle_of(board: str, givens: int, rng: random.Random) -> str:
    keep = set(rng.sample(range(81), givens))
    return "".join(ch if i in keep else "." for i, ch in enumerate(board))


def data(out: Path, train: int, heldout: int, givens: int, seed: int) -> None:
    rng = random.Random(seed)
    held_grids = {random_grid(rng) for _ in range(heldout)}
    rows = {"train": [], "heldout": []}
    while len(rows["train"]) < train:
        board = random_grid(rng)
        if board not in held_grids:
            rows["train"].append({"prompt": prompt_text(puzzle_of(board, givens, rng)), "completion": answer_text(board)})
    for board in sorted(held_grids):
        rows["heldout"].append({"prompt": prompt_text(puzzle_of(board, givens, rng)), "completion": answer_text(board)})
    out.mkdir(parents=True, exist_ok=True)
    for name, items in rows.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    print(f"{out}/train.jsonl: {train} puzzles; {out}/heldout.jsonl: {len(held_grids)} (grids never trained on)")


def evaluate(path: Path, adapter: str | None, steps: int, n: int, seed: int) -> dict:
    from dgemma_cli.engine import load
    from dgemma_cli.checkpoint.names import resolve_adapter

    items = [json.loads(line) for line in path.read_text().splitlines()][:n]
    engine = load("demo", device="cpu", dtype="float32", adapters=[resolve_adapter(adapter)] if adapter else [])
    r = engine.generate([it["prompt"] for it in items], seed=seed, max_denoising_steps=steps, max_new_tokens=96)
    solved = cells = blanks = 0
    for it, text in zip(items, r.texts):
        puzzle = it["prompt"][len("sudoku: "):].replace("/", "")
        board = "".join(ch for ch in text if ch.isdigit())[:81]
        grid = it["completion"].replace("\n", "")
        solved += is_solution(board, puzzle)
        for i, p in enumerate(puzzle):
            if p == ".":
                blanks += 1
                cells += i < len(board) and board[i] == grid[i]
    return dict(n=len(items), solved=solved / len(items), cells=cells / blanks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--train", type=int, default=20000)
    d.add_argument("--heldout", type=int, default=100)
    d.add_argument("--givens", type=int, default=45)
    d.add_argument("--seed", type=int, default=0)
    e = sub.add_parser("eval")
    e.add_argument("heldout", type=Path)
    e.add_argument("--adapter")
    e.add_argument("--steps", type=int, default=10)
    e.add_argument("--n", type=int, default=50)
    e.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from dgemma_cli.errors import DgemmaError

    try:
        if a.cmd == "data":
            data(a.out, a.train, a.heldout, a.givens, a.seed)
        else:
            print(json.dumps(evaluate(a.heldout, a.adapter, a.steps, a.n, a.seed)))
    except (OSError, ValueError, DgemmaError) as e:  # a missing file, a bad line or adapter: one line, no traceback
        print(f"sudoku9: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
