"""Train dgemma's second bundled demo: a tiny DiffusionGemma that solves 4x4 sudoku, in the real checkpoint format.

    python scripts/train_sudoku.py --out dgemma_cli/demo_sudoku      # fixed seed; see BENCHMARKS.md for the time

The task: `sudoku: 1.3./..2./.4../...1` (four rows of four cells, `.` blank, rows joined by `/`) -> the solved board,
four rows of four digits joined by newlines. Every puzzle has exactly one solution, with 4 to 6 givens (10 to 12
blank cells), so an answer is checkable and the canvas has many cells to settle. The canvas (32 tokens) is the
board, `<turn|>`, then `<pad>`: row r, column c of the board is canvas position 5r + c (the newline after each row
takes the fifth place), which the checkpoint's `dgemma_view.json` tells the live view.

Held out: the 288 4x4 sudoku grids are shuffled with a fixed seed and 48 of them are never trained on. Held-out
puzzles (scripts/eval_sudoku.py) have their solutions among those 48, so neither a held-out puzzle nor its solution
board is ever seen in training: solving one takes the rules, not a memory of boards.

The model, tokenizer (character level) and objective are the upper-casing demo's (scripts/train_demo.py, whose
functions are imported): the prompt through the causal encoder into the KV cache; each canvas position replaced by a
uniformly random token with probability t ~ U(0, 1); the bidirectional decoder predicts the clean canvas; in half the
batches it is self-conditioned on its own first prediction. A partly noised canvas is exactly what the sampler shows
the model mid-generation (cells accepted so far, noise elsewhere), so the model learns to fill the cells that the
accepted ones and the givens decide, and the sampler's entropy bound accepts those first, anywhere on the board.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dgemma_cli  # noqa: E402,F401  (before torch: OpenMP threads sleep instead of spinning on a shared CPU)
import torch  # noqa: E402

from train_demo import TEXT_CONFIG, build_model, chat_prompt, encode, learning_rate, loss_on, save  # noqa: E402

N = 4  # board side
BOX = (2, 2)  # box rows, box columns
DIGITS = "1234"
CANVAS = 32  # N rows of N digits + (N - 1) newlines + <turn|> = 20 tokens, then <pad>
ROW_STRIDE = N + 1  # canvas position of row r, column c: r * ROW_STRIDE + c
GIVENS = (4, 5, 6)  # givens per puzzle: 4 is the fewest any 4x4 puzzle with one solution has
HELD_OUT_GRIDS = 48  # of the 288 grids, never trained on
GRID_SEED = 2024  # shuffles the grids before the held-out ones are set apart

SUDOKU_TEXT_CONFIG = dict(TEXT_CONFIG, num_hidden_layers=6,
                          layer_types=["sliding_attention"] * 5 + ["full_attention"],
                          per_layer_config={"5": {"head_dim": 64, "num_key_value_heads": 1}})
# The sampler's settings, chosen on validation puzzles (scripts/eval_sudoku.py --puzzles validation; BENCHMARKS.md):
# with the real checkpoint's (entropy bound 0.1, temperature 0.8 to 0.4 over 48 steps) the trained model is sure of
# most cells at the first step and a canvas takes 2.5 steps; a hotter start (1.5, cooling to 0.4 over 24 steps) and a
# bound of 0.2 keep the same accuracy and let the cells settle over several steps, surest first, as the demo shows.
GENERATION_CONFIG = {"max_new_tokens": CANVAS, "max_denoising_steps": 24,
                     "sampler_config": {"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"},
                     "t_min": 0.4, "t_max": 1.5, "stability_threshold": 1, "confidence_threshold": 0.005,
                     "eos_token_id": [1, 106, 50], "pad_token_id": 0, "bos_token_id": 2}
# dgemma's live view draws the canvas as this board (a file of its own: other runtimes never read it)
VIEW_HINTS = {"board": {"rows": N, "cols": N, "box": list(BOX), "row_stride": ROW_STRIDE}}


# ----------------------------------------------------------------------------- sudoku


def peers(i: int) -> set[int]:
    """Cells sharing a row, column or box with cell i (row-major index), i excluded."""
    r, c = divmod(i, N)
    br, bc = r // BOX[0] * BOX[0], c // BOX[1] * BOX[1]
    out = {r * N + k for k in range(N)} | {k * N + c for k in range(N)}
    out |= {(br + a) * N + bc + b for a in range(BOX[0]) for b in range(BOX[1])}
    return out - {i}


PEERS = [peers(i) for i in range(N * N)]


def all_grids() -> list[str]:
    """Every solved N x N board as a string of N*N digits, in lexicographic order (288 for 4x4)."""
    out, cells = [], [""] * (N * N)

    def fill(i: int) -> None:
        if i == N * N:
            out.append("".join(cells))
            return
        for d in DIGITS:
            if all(cells[j] != d for j in PEERS[i] if j < i):
                cells[i] = d
                fill(i + 1)
        cells[i] = ""

    fill(0)
    return out


def is_solution(puzzle: str, board: str) -> bool:
    """board (N*N digits) obeys the rules and keeps every given of puzzle (N*N characters, '.' blank)."""
    if len(board) != N * N or any(ch not in DIGITS for ch in board):
        return False
    if any(p != "." and p != b for p, b in zip(puzzle, board)):
        return False
    return all(board[i] != board[j] for i in range(N * N) for j in PEERS[i])


def solutions(puzzle: str, grids: list[str]) -> list[str]:
    return [g for g in grids if all(p == "." or p == g[i] for i, p in enumerate(puzzle))]


def make_puzzle(grid: str, grids: list[str], rng: random.Random) -> str:
    """Blank cells of grid in a random order while the puzzle keeps one solution, down to a number of givens drawn
    from GIVENS (or fewer blanks, when no further cell can go)."""
    target = rng.choice(GIVENS)
    cells = list(grid)
    order = list(range(N * N))
    rng.shuffle(order)
    for i in order:
        if N * N - cells.count(".") <= target:
            break
        keep, cells[i] = cells[i], "."
        if len(solutions("".join(cells), grids)) != 1:
            cells[i] = keep
    return "".join(cells)


def split_grids() -> tuple[list[str], list[str]]:
    """(grids trained on, held-out grids): a fixed shuffle of all grids, the first HELD_OUT_GRIDS held out."""
    grids = all_grids()
    shuffled = list(grids)
    random.Random(GRID_SEED).shuffle(shuffled)
    return shuffled[HELD_OUT_GRIDS:], shuffled[:HELD_OUT_GRIDS]


def prompt_text(puzzle: str) -> str:
    """N*N cells -> the prompt a person types: `sudoku: 1.3./..2./.4../...1`."""
    return "sudoku: " + "/".join(puzzle[r * N : (r + 1) * N] for r in range(N))


def answer_text(board: str) -> str:
    """N*N digits -> the answer the model writes: N rows joined by newlines."""
    return "\n".join(board[r * N : (r + 1) * N] for r in range(N))


def parse_answer(text: str) -> str:
    """The model's answer -> N*N characters (whatever the rows hold; checked by is_solution)."""
    return "".join(text.split())


# ----------------------------------------------------------------------------- data


def example(puzzle: str, board: str) -> tuple[list[int], list[int]]:
    """(prompt ids, canvas ids): the chat prompt around the puzzle; the board, <turn|>, then <pad>."""
    answer = encode(answer_text(board)) + [106]
    return encode(chat_prompt(prompt_text(puzzle))), answer + [0] * (CANVAS - len(answer))


def make_batch(rng: random.Random, grids: list[str], all_: list[str], size: int):
    """Prompts [B, T] (one length: every puzzle has N*N cells), all valid; clean canvases [B, C]; held [B, C] (none)."""
    rows = []
    for _ in range(size):
        grid = rng.choice(grids)
        rows.append(example(make_puzzle(grid, all_, rng), grid))
    prompt = torch.tensor([p for p, _ in rows])
    canvas = torch.tensor([c for _, c in rows])
    return prompt, torch.ones_like(prompt, dtype=torch.bool), canvas, torch.zeros_like(canvas, dtype=torch.bool)


# ----------------------------------------------------------------------------- validation while training


def validation_puzzles(seed: int, n: int = 64) -> list[tuple[str, str]]:
    """(puzzle, solution) pairs on held-out grids, from a seed of their own, for watching training (and for choosing
    the sampler's settings: scripts/eval_sudoku.py --puzzles validation)."""
    _, held_grids = split_grids()
    grids = all_grids()
    vrng = random.Random(seed + 777)
    return [(make_puzzle(g, grids, vrng), g) for g in (vrng.choice(held_grids) for _ in range(n))]


def validate(out: Path, puzzles: list[tuple[str, str]], seed: int = 0) -> float:
    """Exact solutions through dgemma's engine on the checkpoint just saved (checkpoint's sampler settings)."""
    from dgemma_cli.engine import load

    engine = load(out, device="cpu", dtype="float32")
    r = engine.generate([prompt_text(p) for p, _ in puzzles], seed=seed)
    return sum(is_solution(p, parse_answer(t)) for (p, _), t in zip(puzzles, r.texts)) / len(puzzles)


def save_all(model, config: dict, out: Path) -> None:
    """The checkpoint (train_demo.save: weights, configs, tokenizer) and the view's layout hint."""
    save(model, config, out, GENERATION_CONFIG)
    (out / "dgemma_view.json").write_text(json.dumps(VIEW_HINTS, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description="Train the bundled 4x4 sudoku demo model.")
    ap.add_argument("--out", type=Path, default=ROOT / "dgemma_cli" / "demo_sudoku")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=55.0, help="stop early (and save) after this long")
    ap.add_argument("--validate-every", type=int, default=500, help="steps between validations (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    train_grids, _ = split_grids()
    grids = all_grids()
    model, config = build_model(args.seed, canvas=CANVAS, text_config=SUDOKU_TEXT_CONFIG)
    model.train()
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    val = validation_puzzles(args.seed)  # on held-out grids, from a seed the held-out evaluation does not use
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = 100
    start = time.time()
    avg = None
    for step in range(1, args.steps + 1):
        lr = learning_rate(step, args.lr, warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        prompt, valid, canvas, held = make_batch(rng, train_grids, grids, args.batch)
        loss = loss_on(model, prompt, valid, canvas, held, gen, self_condition=step % 2 == 0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        avg = loss.item() if avg is None else 0.98 * avg + 0.02 * loss.item()
        if step % 50 == 0:
            print(f"step {step:5d}  loss {avg:.4f}  lr {lr:.2e}  {time.time() - start:6.0f}s", flush=True)
        if args.validate_every and step % args.validate_every == 0:
            save_all(model, config, args.out)
            model.eval()
            acc = validate(args.out, val)
            model.train()
            print(f"step {step:5d}  validation: {acc:.1%} of {len(val)} held-out-grid puzzles solved", flush=True)
        if time.time() - start > args.minutes * 60:
            print(f"time limit reached at step {step}", flush=True)
            break
    save_all(model, config, args.out)
    print(f"saved {args.out} after {time.time() - start:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
