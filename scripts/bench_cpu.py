"""`make bench`: dgemma against the reference implementation on this CPU, in one run, with identical tokens.

Config (from the engine issue): hidden 256, 6 layers (5 sliding : 1 full), 16 experts top-4, vocab 32768,
canvas 256, prompt 64 tokens, 16 fixed denoising steps per canvas (adaptive stopping disabled), float32.
Both sides run after `torch.manual_seed(seed)` and must return the same token ids, or the script fails.
Prints per-run seconds, ms per denoise step, and the speed ratio; `--json FILE` also writes the figures.
torch is imported before dgemma_cli, so OpenMP keeps its own wait policy (dgemma_cli/device.py sets PASSIVE only
when it is imported first): set OMP_WAIT_POLICY to measure another.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = dict(vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, global_head_dim=128,
            num_global_key_value_heads=1, sliding_window=128, num_experts=16, top_k_experts=4,
            moe_intermediate_size=128)
CANVAS, PROMPT, STEPS = 256, 64, 16
# Adaptive stopping off (random weights would not converge anyway): the step count is fixed.
SETTINGS = dict(max_new_tokens=CANVAS, max_denoising_steps=STEPS, confidence_threshold=1e-12)


def build(directory: Path) -> None:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=vision, canvas_length=CANVAS)
    torch.manual_seed(0)
    DiffusionGemmaForBlockDiffusion(cfg).save_pretrained(directory)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import DiffusionGemmaForBlockDiffusion

    from dgemma_cli.engine import load

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench-model"
        build(path)
        ref = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32").eval()
        engine = load(path, device="cpu", dtype="float32")
        prompt = torch.randint(107, TEXT["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1))

        def run_reference(seed):
            torch.manual_seed(seed)
            out = ref.generate(prompt[None], eos_token_id=[1, 106, 50], pad_token_id=0, t_min=0.4, t_max=0.8,
                               stability_threshold=1, **SETTINGS)
            return out.sequences[0, PROMPT:].tolist()

        def run_dgemma(seed):
            r = engine.generate([prompt.tolist()], seed=seed, eos_token_ids=(1, 106, 50), **SETTINGS)
            return r.token_ids[0]

        run_reference(0), run_dgemma(0)  # warm up both (allocator, thread pools)
        times = {"reference": [], "dgemma": []}
        for rep in range(args.repeats):
            for name, fn in (("reference", run_reference), ("dgemma", run_dgemma)):
                t0 = time.perf_counter()
                tokens = fn(100 + rep)
                times[name].append(time.perf_counter() - t0)
                if name == "reference":
                    expected = tokens
            eos = next((i for i, t in enumerate(expected) if t in (1, 106, 50)), len(expected))
            if tokens != expected[:eos]:
                print(f"FAIL: tokens differ on repeat {rep}", file=sys.stderr)
                return 1

    ref_s, dg_s = statistics.median(times["reference"]), statistics.median(times["dgemma"])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}, OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}",
        "config": {**TEXT, "canvas": CANVAS, "prompt": PROMPT, "steps": STEPS, "dtype": "float32"},
        "reference_s": ref_s, "dgemma_s": dg_s,
        "reference_ms_per_step": 1000 * ref_s / STEPS, "dgemma_ms_per_step": 1000 * dg_s / STEPS,
        "speedup": ref_s / dg_s, "identical_tokens": True, "repeats": args.repeats,
    }
    print(f"config: hidden 256, 6 layers, 16 experts top-4, vocab 32768, canvas {CANVAS}, prompt {PROMPT}, "
          f"{STEPS} fixed steps, float32, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"{'':12}{'s/run (median)':>16}{'ms/step':>10}   runs")
    for name, s in (("reference", ref_s), ("dgemma", dg_s)):
        runs = " ".join(f"{t:.3f}" for t in times[name])
        print(f"{name:12}{s:16.3f}{1000 * s / STEPS:10.1f}   {runs}")
    print(f"tokens identical on every run; dgemma is {result['speedup']:.2f}x the reference's speed")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
