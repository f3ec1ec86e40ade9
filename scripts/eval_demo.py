"""Held-out accuracy of the bundled demo model, through dgemma and through the reference implementation.

    python scripts/eval_demo.py [--n 200] [--model DIR] [--reference]

Prompts are `upper: <text>` in chat mode, texts drawn like the training data but from another seed; an answer is
correct when it equals the text upper-cased, exactly. Sampler settings are the checkpoint's defaults
(generation_config.json). Prints accuracy, mean denoising steps per canvas and mean tokens per forward.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

HELD_OUT_SEED = 12345


def held_out(n: int) -> list[str]:
    from train_demo import random_text

    rng = random.Random(HELD_OUT_SEED)
    return [random_text(rng) for _ in range(n)]


def eval_dgemma(model_dir, texts: list[str], seed: int = 0, batch: int = 50) -> dict:
    from dgemma_cli.engine import load

    engine = load(model_dir, device="cpu", dtype="float32")
    correct, steps, tpf = 0, [], []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        r = engine.generate([f"upper: {t}" for t in chunk], seed=seed + i)
        for t, answer, s, f in zip(chunk, r.texts, r.steps_per_canvas, r.tokens_per_forward):
            correct += answer == t.upper()
            steps.extend(s)
            tpf.append(f)
    return {"accuracy": correct / len(texts), "mean_steps_per_canvas": sum(steps) / len(steps),
            "max_steps": engine.settings.max_denoising_steps, "tokens_per_forward": sum(tpf) / len(tpf),
            "seconds": time.perf_counter() - t0, "n": len(texts)}


def eval_infill(model_dir, n: int, methods=("held",), seed: int = 0) -> dict:
    """Fill a random hole inside the answer line of `upper: <text>\n<TEXT>\n` with each `dgemma fim` method;
    a fill is correct when the filled file equals the original exactly. Returns {method: accuracy}."""
    from dgemma_cli.engine import load
    from dgemma_cli.cli.fim import DEFAULT_MARKER, Hole, fill_holes

    engine = load(model_dir, device="cpu", dtype="float32")
    rng = random.Random(HELD_OUT_SEED + 1)
    cases = []
    for text in held_out(n):
        full = f"upper: {text}\n{text.upper()}\n"
        start = len(f"upper: {text}\n")
        i = rng.randint(start, start + len(text) - 1)
        j = rng.randint(i + 1, start + len(text))
        cases.append((full, full[:i] + DEFAULT_MARKER + full[j:], i))
    scores = {}
    for method in methods:
        correct = 0
        for k, (full, holed, i) in enumerate(cases):
            hole = [Hole(i, i + len(DEFAULT_MARKER))]
            correct += fill_holes(engine, holed, hole, method=method, seed=seed + k) == full
        scores[method] = correct / n
    return scores


def eval_reference(model_dir, texts: list[str], seed: int = 0, batch: int = 50) -> dict:
    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma_cli.engine import resolve_model
    from dgemma_cli.tokenizer import Tokenizer

    path = resolve_model(model_dir)
    tok = Tokenizer.from_dir(path)
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32").eval()
    correct = 0
    for i in range(0, len(texts), batch):
        chunk = texts[i : i + batch]
        ids = [tok.encode_chat([{"role": "user", "content": f"upper: {t}"}]) for t in chunk]
        T = max(map(len, ids))
        input_ids = torch.tensor([[0] * (T - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (T - len(x)) + [1] * len(x) for x in ids])
        torch.manual_seed(seed + i)
        out = ref.generate(input_ids, attention_mask=mask)
        for t, row in zip(chunk, out.sequences[:, T:].tolist()):
            cut = next((j for j, x in enumerate(row) if x in (1, 106, 50)), len(row))
            correct += tok.decode_answer(row[:cut])[1] == t.upper()
    return {"accuracy": correct / len(texts), "n": len(texts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--reference", action="store_true", help="also score the reference implementation")
    ap.add_argument("--infill", action="store_true", help="also score the infill methods of dgemma fim")
    args = ap.parse_args()
    texts = held_out(args.n)
    ours = eval_dgemma(args.model, texts)
    print(f"dgemma:    accuracy {ours['accuracy']:.1%} on {ours['n']} held-out prompts; "
          f"{ours['mean_steps_per_canvas']:.2f} steps per canvas (max {ours['max_steps']}); "
          f"{ours['tokens_per_forward']:.2f} tokens per forward; {ours['seconds']:.1f} s")
    if args.reference:
        ref = eval_reference(args.model, texts)
        print(f"reference: accuracy {ref['accuracy']:.1%} on {ref['n']} held-out prompts")
    if args.infill:
        for method, acc in eval_infill(args.model, args.n, methods=("held", "prefix", "instruct")).items():
            print(f"fim --method {method:8}: {acc:.1%} exact fills on {args.n} held-out holes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
