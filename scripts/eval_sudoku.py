"""Held-out accuracy of the bundled sudoku demo, through dgemma and through the reference implementation, and the
order in which the sampler settles the cells.

    python scripts/eval_sudoku.py [--n 200] [--model demo-sudoku] [--reference] [--json FILE]
    python scripts/eval_sudoku.py --puzzles validation --entropy-bound 0.03     # choosing the sampler's settings
    python scripts/eval_sudoku.py --first-taking 7      # make demo's puzzle: the first held-out one run alone that
                                                        # takes 7 steps or more with --seed 0

Puzzles come from the 48 grids train_sudoku.py never trains on (so neither a puzzle nor its solution board was
seen in training), drawn like the training puzzles (4 to 6 givens, one solution each) from another seed, all
distinct. A puzzle counts as solved when the answer is a valid board keeping every given (then it is the solution:
there is only one). Sampler settings are the checkpoint's (generation_config.json), or --entropy-bound's. The
checkpoint's settings were chosen on other puzzles (`--puzzles validation`: train_sudoku.py's validation puzzles,
also on held-out grids, but none of them a held-out puzzle), never on the held-out ones.

Acceptance order: a cell's settle step is the step from which it stayed accepted until its canvas stopped (the
sampler re-decides every position at every step, so a cell may be accepted, dropped, and accepted again). Printed:
mean steps per canvas, the blank cells settled at each step, each cell's mean settle step as a board, and in how
many puzzles the blank cells did not settle in reading order (left to right, top to bottom).
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
from train_sudoku import (N, ROW_STRIDE, all_grids, is_solution, make_puzzle, parse_answer,  # noqa: E402
                          prompt_text, split_grids)

HELD_OUT_SEED = 12345
CELLS = [r * ROW_STRIDE + c for r in range(N) for c in range(N)]  # canvas position of each cell, row-major


def held_out(n: int) -> list[tuple[str, str]]:
    """n distinct (puzzle, solution) pairs whose solutions are held-out grids."""
    _, held = split_grids()
    grids = all_grids()
    rng = random.Random(HELD_OUT_SEED)
    out, seen = [], set()
    while len(out) < n:
        grid = rng.choice(held)
        puzzle = make_puzzle(grid, grids, rng)
        if puzzle not in seen:
            seen.add(puzzle)
            out.append((puzzle, grid))
    return out


def settle_steps(events) -> tuple[torch.Tensor, list]:
    """Run a batch's events; returns (settle step per row and canvas position [B, C], 0 where never accepted, of the
    first canvas) and the Done event."""
    from dgemma_cli.sampler import CanvasDone, Done, Step

    settle = prev = stopped = done = None
    for ev in events:
        if isinstance(ev, Step) and ev.canvas_index == 0:
            acc = ev.accepted.cpu()
            if settle is None:
                settle = torch.zeros(acc.shape, dtype=torch.long)
                prev = torch.zeros_like(acc)
                stopped = torch.zeros(acc.shape[0], dtype=torch.bool)
            live = ~stopped[:, None]  # rows that had not stopped before this step
            settle[acc & ~prev & live] = ev.step
            settle[~acc & live] = 0
            prev = torch.where(live, acc, prev)
            stopped = ev.finished.cpu().clone()
        elif isinstance(ev, CanvasDone) and ev.canvas_index == 0:
            stopped = torch.ones_like(stopped)
        elif isinstance(ev, Done):
            done = ev
    return settle, done


def validation(n: int) -> list[tuple[str, str]]:
    """train_sudoku.py's validation puzzles (its seed 0), the first n, without any that is also a held-out one."""
    from train_sudoku import validation_puzzles

    held = {p for p, _ in held_out(200)}
    return [x for x in validation_puzzles(0, max(n, 64)) if x[0] not in held][:n]


def eval_dgemma(model_dir, puzzles: list[tuple[str, str]], seed: int = 0, batch: int = 50, adapters=(),
                **overrides) -> dict:
    """Solve the puzzles through dgemma's engine (batches of `batch`, batch i seeded with seed + i); overrides are
    GenerationSettings fields (entropy_bound, ...); adapters: (directory, scale) of LoRA adapters."""
    from dgemma_cli.engine import load

    engine = load(model_dir, device="cpu", dtype="float32", adapters=adapters)
    solved, steps, settles, answers = 0, [], [], []
    t0 = time.perf_counter()
    for i in range(0, len(puzzles), batch):
        chunk = puzzles[i : i + batch]
        settle, done = settle_steps(engine.events([prompt_text(p) for p, _ in chunk], seed=seed + i, **overrides))
        for (puzzle, _), ids, s, row in zip(chunk, done.token_ids, done.steps_per_canvas, settle.tolist()):
            answer = parse_answer(engine.tokenizer.decode_answer(ids)[1])
            answers.append(answer)
            solved += is_solution(puzzle, answer)
            steps.extend(s)
            settles.append([row[p] for p in CELLS])
    return {"accuracy": solved / len(puzzles), "n": len(puzzles), "answers": answers, "settle": settles,
            "mean_steps_per_canvas": sum(steps) / len(steps),
            "max_steps": engine.settings.override(**overrides).max_denoising_steps,
            "seconds": time.perf_counter() - t0}


def eval_reference(model_dir, puzzles: list[tuple[str, str]], seed: int = 0, batch: int = 50) -> dict:
    """The same puzzles, batches and seeds through transformers' DiffusionGemmaForBlockDiffusion.generate."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging

    from dgemma_cli.engine import resolve_model
    from dgemma_cli.tokenizer import Tokenizer

    logging.set_verbosity_error()  # not the load report listing the vision tower, which the checkpoint never has
    path = resolve_model(model_dir)
    tok = Tokenizer.from_dir(path)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32").eval()
    solved, answers = 0, []
    for i in range(0, len(puzzles), batch):
        chunk = puzzles[i : i + batch]
        ids = [tok.encode_chat([{"role": "user", "content": prompt_text(p)}]) for p, _ in chunk]
        T = max(map(len, ids))
        input_ids = torch.tensor([[0] * (T - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in ids])
        torch.manual_seed(seed + i)
        out = ref.generate(input_ids, attention_mask=mask)
        for (puzzle, _), row in zip(chunk, out.sequences[:, T:].tolist()):
            cut = next((j for j, x in enumerate(row) if x in (1, 106, 50)), len(row))
            answer = parse_answer(tok.decode_answer(row[:cut])[1])
            answers.append(answer)
            solved += is_solution(puzzle, answer)
    return {"accuracy": solved / len(puzzles), "n": len(puzzles), "answers": answers}


def order_report(puzzles: list[tuple[str, str]], settles: list[list[int]]) -> dict:
    """The blank cells' settle steps: a histogram over steps, each cell's mean as a board, and how often the blank
    cells did not settle in reading order (some cell settled at an earlier step than a cell before it)."""
    hist: dict[int, int] = {}
    per_cell = [[] for _ in range(N * N)]
    out_of_order = spread = 0
    for (puzzle, _), steps in zip(puzzles, settles):
        blank = [s for p, s in zip(puzzle, steps) if p == "."]
        for i, (p, s) in enumerate(zip(puzzle, steps)):
            if p == ".":
                hist[s] = hist.get(s, 0) + 1
                per_cell[i].append(s)
        out_of_order += any(b < a for a, b in zip(blank, blank[1:]))
        spread += len(set(blank))
    means = [sum(x) / len(x) if x else float("nan") for x in per_cell]
    return {"histogram": dict(sorted(hist.items())), "mean_settle_step_per_cell": means,
            "out_of_reading_order": out_of_order / len(puzzles),
            "mean_distinct_settle_steps": spread / len(puzzles)}


def first_taking(model_dir, steps: int, seed: int, n: int) -> int:
    """The first of the n held-out puzzles whose run alone (as `dgemma run --seed SEED` runs it) takes `steps` steps
    or more and solves it: its prompt, steps, and the step at which each blank cell settled."""
    from dgemma_cli.engine import load

    engine = load(model_dir, device="cpu", dtype="float32")
    for k, (puzzle, _) in enumerate(held_out(n)):
        settle, done = settle_steps(engine.events(prompt_text(puzzle), seed=seed))
        answer = parse_answer(engine.tokenizer.decode_answer(done.token_ids[0])[1])
        if done.steps_per_canvas[0][0] >= steps and is_solution(puzzle, answer):
            row = settle[0].tolist()
            print(f"held-out puzzle {k}: {prompt_text(puzzle)!r}, {done.steps_per_canvas[0][0]} steps; blank cells "
                  f"(reading order) settled at steps {[row[c] for c, p in zip(CELLS, puzzle) if p == '.']}")
            return 0
    print(f"none of the first {n} held-out puzzles takes {steps} steps or more", file=sys.stderr)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--model", default="demo-sudoku")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapter", action="append", default=[], metavar="DIR[:SCALE]",
                    help="a LoRA adapter on the model (a directory or a bundled adapter's name), as --adapter does")
    ap.add_argument("--reference", action="store_true", help="also score the reference implementation")
    ap.add_argument("--puzzles", choices=("held-out", "validation"), default="held-out")
    ap.add_argument("--entropy-bound", type=float, help="instead of the checkpoint's (this and the next three: "
                    "not with --reference)")
    ap.add_argument("--steps", type=int, help="most steps per canvas, instead of the checkpoint's")
    ap.add_argument("--t-max", type=float, help="first step's temperature, instead of the checkpoint's")
    ap.add_argument("--t-min", type=float, help="last step's temperature, instead of the checkpoint's")
    ap.add_argument("--builtin-sampler", action="store_true",
                    help="dgemma's built-in sampler settings (the real checkpoint's: 48 steps, entropy bound 0.1, "
                         "temperature 0.8 to 0.4) instead of the checkpoint's (not with --reference)")
    ap.add_argument("--json", type=Path, help="write every figure (and each answer) to this file")
    ap.add_argument("--first-taking", type=int, metavar="STEPS",
                    help="print the first held-out puzzle that, run alone with --seed, takes STEPS steps or more")
    args = ap.parse_args()
    if args.first_taking is not None:
        return first_taking(args.model, args.first_taking, args.seed, args.n)
    overrides = {"entropy_bound": args.entropy_bound, "max_denoising_steps": args.steps, "t_max": args.t_max,
                 "t_min": args.t_min}
    if args.reference and (any(v is not None for v in overrides.values()) or args.builtin_sampler):
        ap.error("the sampler's settings apply to dgemma only; the reference reads the checkpoint's")
    if args.builtin_sampler:
        from dgemma_cli.config import GenerationSettings as G

        overrides = {"max_denoising_steps": G.max_denoising_steps, "t_max": G.t_max, "t_min": G.t_min,
                     "entropy_bound": args.entropy_bound or G.entropy_bound}
    puzzles = held_out(args.n) if args.puzzles == "held-out" else validation(args.n)
    from dgemma_cli.checkpoint.names import resolve_adapter

    if args.adapter and args.reference:
        ap.error("--adapter applies to dgemma only")
    ours = eval_dgemma(args.model, puzzles, seed=args.seed, adapters=[resolve_adapter(a) for a in args.adapter],
                       **overrides)
    order = order_report(puzzles, ours["settle"])
    blanks = sum(p.count(".") for p, _ in puzzles) / len(puzzles)
    print(f"dgemma:    {ours['accuracy']:.1%} solved of {ours['n']} {args.puzzles} puzzles ({blanks:.1f} blank cells "
          f"on average); {ours['mean_steps_per_canvas']:.2f} steps per canvas (max {ours['max_steps']}); "
          f"{ours['seconds']:.1f} s")
    print("blank cells settled at step: " + ", ".join(f"{s}: {c}" for s, c in order["histogram"].items()))
    print(f"blank cells of a puzzle settle over {order['mean_distinct_settle_steps']:.2f} distinct steps on average;"
          f" not in reading order in {order['out_of_reading_order']:.1%} of puzzles")
    print("mean settle step of each cell (when blank):")
    for r in range(N):
        print("   " + " ".join(f"{m:5.2f}" for m in order["mean_settle_step_per_cell"][r * N : (r + 1) * N]))
    result = {"dgemma": {k: v for k, v in ours.items() if k != "settle"}, "order": order,
              "puzzles": [p for p, _ in puzzles]}
    if args.reference:
        ref = eval_reference(args.model, puzzles, seed=args.seed)
        same = sum(a == b for a, b in zip(ours["answers"], ref["answers"]))
        print(f"reference: {ref['accuracy']:.1%} solved of {ref['n']} held-out puzzles; "
              f"{same} of {len(puzzles)} answers identical to dgemma's")
        result["reference"] = ref
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
