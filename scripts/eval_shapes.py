"""Held-out accuracy of the bundled shapes demo through dgemma's engine (and, optionally, the reference's).

    python scripts/eval_shapes.py [--n 200] [--model demo-shapes] [--seed 0] [--reference] [--json FILE]

Pictures come from the test split of train_shapes.py (specs whose hash puts them there; training never draws one),
drawn from a seed of their own, all distinct. Each picture goes alone, with the question `What is in the picture?`,
through dgemma's engine with the checkpoint's sampler settings and its default image budget (70 soft tokens),
seeded with --seed, as `dgemma run --model demo-shapes --image PIC --seed SEED "What is in the picture?"` runs it.
An answer's colour (shape) is right when it names exactly one colour (shape) and that is the picture's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dgemma_cli  # noqa: E402,F401  (before torch: OpenMP threads sleep instead of spinning on a shared CPU)
import torch  # noqa: E402
from train_shapes import COLOURS, QUESTION, SHAPES, Spec, draw, parse_answer, split_specs  # noqa: E402

HELD_OUT_SEED = 4242


def held_out(n: int) -> list[Spec]:
    """The first n held-out pictures' specs (test split, distinct; the same list for every n's prefix)."""
    return split_specs("test", n, HELD_OUT_SEED)


def score(specs: list[Spec], answers: list[str]) -> dict:
    """Colour, shape and both accuracies, and per-shape and per-colour accuracy of both."""
    parsed = [parse_answer(a) for a in answers]
    right = [(c == s.colour, h == s.shape) for s, (c, h) in zip(specs, parsed)]
    n = len(specs)

    def both_of(keep) -> float:
        rows = [c and h for s, (c, h) in zip(specs, right) if keep(s)]
        return sum(rows) / len(rows) if rows else float("nan")

    return {"n": n, "colour": sum(c for c, _ in right) / n, "shape": sum(h for _, h in right) / n,
            "both": sum(c and h for c, h in right) / n,
            "both_by_shape": {x: both_of(lambda s, x=x: s.shape == x) for x in SHAPES},
            "both_by_colour": {x: both_of(lambda s, x=x: s.colour == x) for x in COLOURS}}


def eval_dgemma(model_dir, specs: list[Spec], seed: int = 0) -> dict:
    """Each picture through dgemma's engine, alone, seeded with `seed`: answers and steps per canvas."""
    from dgemma_cli.engine import load

    engine = load(model_dir, device="cpu", dtype="float32")
    answers, steps = [], []
    t0 = time.perf_counter()
    for spec in specs:
        result = engine.generate(QUESTION, images=[draw(spec)], seed=seed)
        answers.append(result.texts[0])
        steps.append(result.steps_per_canvas[0][0])
    return {"answers": answers, "mean_steps_per_canvas": sum(steps) / len(steps),
            "seconds": time.perf_counter() - t0}


def eval_reference(model_dir, specs: list[Spec], seed: int = 0) -> dict:
    """The same pictures and seed through transformers' DiffusionGemmaForBlockDiffusion.generate, its own image
    processor (Gemma4ImageProcessorPil) making the pixel values."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.utils import logging

    from dgemma_cli.engine import resolve_model
    from dgemma_cli.tokenizer import Control, Tokenizer

    path = resolve_model(model_dir)
    tok = Tokenizer.from_dir(path)
    # quiet while loading (the load's progress bar and notices, on stderr), then as before: both switches are
    # process-wide and reach huggingface_hub's own bars, which a caller in the same process may want
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32").eval()
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    cfg = ref.config
    budget = json.loads((path / "config.json").read_text())["vision_soft_tokens_per_image"]
    processor = Gemma4ImageProcessorPil()
    placeholder = tok.decode([cfg.image_token_id], skip_special_tokens=False)
    eos = set(ref.generation_config.eos_token_id)
    answers = []
    for spec in specs:
        px = processor(images=[draw(spec)], max_soft_tokens=budget, return_tensors="pt")
        raw = tok.encode_chat([{"role": "user", "content": [Control(placeholder), QUESTION]}])
        n = int(px["num_soft_tokens_per_image"][0])
        ids = []
        for t in raw:
            ids += [cfg.boi_token_id] + [cfg.image_token_id] * n + [cfg.eoi_token_id] if t == cfg.image_token_id \
                else [t]
        mm = torch.tensor([[int(t == cfg.image_token_id) for t in ids]])
        torch.manual_seed(seed)
        out = ref.generate(torch.tensor([ids]), pixel_values=px["pixel_values"],
                           image_position_ids=px["image_position_ids"], mm_token_type_ids=mm)
        row = out.sequences[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(row) if t in eos), len(row))
        answers.append(tok.decode_answer(row[:cut])[1])
    return {"answers": answers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--model", default="demo-shapes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reference", action="store_true", help="also answer through the reference implementation")
    ap.add_argument("--json", type=Path, help="write every figure (and each answer) to this file")
    args = ap.parse_args()
    torch.set_num_threads(1)

    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    specs = held_out(args.n)
    ours = eval_dgemma(args.model, specs, seed=args.seed)
    s = score(specs, ours["answers"])
    print(f"command:   {command}")
    print(f"dgemma:    {s['n']} held-out pictures: colour {s['colour']:.1%}, shape {s['shape']:.1%}, both "
          f"{s['both']:.1%}; {ours['mean_steps_per_canvas']:.2f} steps per canvas; {ours['seconds']:.1f} s")
    print("both right by shape:  " + ", ".join(f"{k} {v:.1%}" for k, v in s["both_by_shape"].items()))
    print("both right by colour: " + ", ".join(f"{k} {v:.1%}" for k, v in s["both_by_colour"].items()))
    result = {"command": command, "dgemma": dict(s, **ours), "specs": [vars(x) for x in specs]}
    if args.reference:
        ref = eval_reference(args.model, specs, seed=args.seed)
        r = score(specs, ref["answers"])
        same = sum(a == b for a, b in zip(ours["answers"], ref["answers"]))
        print(f"reference: colour {r['colour']:.1%}, shape {r['shape']:.1%}, both {r['both']:.1%}; {same} of "
              f"{len(specs)} answers identical to dgemma's")
        result["reference"] = dict(r, **ref)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
