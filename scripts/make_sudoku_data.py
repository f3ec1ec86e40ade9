"""Data for the bundled `demo-sudoku-lora` adapter: 4x4 sudoku as `dgemma tune` reads it (prompt/completion JSONL).

    .venv/bin/python scripts/make_sudoku_data.py --out /tmp/sudoku     # train.jsonl, heldout.jsonl

Puzzles and boards as the sudoku demo makes them (scripts/train_sudoku.py): the 288 solved 4x4 grids shuffled with
a fixed seed, 48 held out; training puzzles come from the other 240, held-out puzzles from the 48, so neither a
held-out puzzle nor its solution is ever trained on. Prompt `sudoku: 1.3./..2./.4../...1`, completion the board's
four rows joined by newlines.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_sudoku import all_grids, answer_text, make_puzzle, prompt_text, split_grids  # noqa: E402


def rows(grids: list[str], everything: list[str], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        board = rng.choice(grids)
        out.append({"prompt": prompt_text(make_puzzle(board, everything, rng)), "completion": answer_text(board)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=20000, help="training puzzles")
    ap.add_argument("--heldout", type=int, default=200, help="held-out puzzles")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    train, held = split_grids()
    everything = all_grids()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, grids, n, seed in (("train", train, a.train, a.seed), ("heldout", held, a.heldout, a.seed + 1)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(grids, everything, n, seed)))
    print(f"{out}/train.jsonl: {a.train} puzzles; {out}/heldout.jsonl: {a.heldout} (boards never trained on)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
