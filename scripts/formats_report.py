"""KL and agreement per published format on tiny checkpoints: the producers' files and dgemma's, from the same source.

    python scripts/formats_report.py [--n 24]

For each fixture under tests/fixtures (written by llmcompressor and nvidia-modelopt, see scripts/make_ct_fixtures.py
and scripts/make_modelopt_fixture.py) the bfloat16 source it was made from is rebuilt (same spec and seed), quantized
by dgemma in the same format with its default settings, and both are compared with the source: mean KL(p_src ||
p_quant) of the decoder's first-step distribution on a fixed random canvas, and argmax agreement there, over `n`
random prompts of 12 tokens. Everything runs in float32 on the CPU (weight-only: the activations stay float32).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import checkpoints  # noqa: E402
from make_ct_fixtures import FIXTURES as CT, SPEC, VISION  # noqa: E402

from dgemma_cli.engine import load  # noqa: E402
from dgemma_cli.store.quantize import quantize_checkpoint  # noqa: E402

CASES = {"ct_fp8_dynamic": ("fp8", "llmcompressor FP8_DYNAMIC", CT["ct_fp8_dynamic"][2]),
         "ct_int8_dynamic": ("int8", "llmcompressor W8A8", CT["ct_int8_dynamic"][2]),
         "modelopt_nvfp4": ("nvfp4", "nvidia-modelopt nvfp4_experts_only", 13)}


def log_probs(path: Path, prompts) -> torch.Tensor:
    """log softmax of the first step [B, C, V] of the checkpoint at `path` (checkpoints.first_step_logits)."""
    m = load(path, device="cpu", dtype="float32").model
    return torch.cat([torch.log_softmax(checkpoints.first_step_logits(m, ids), -1) for ids in prompts])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=24)
    args = p.parse_args()
    g = torch.Generator().manual_seed(9)
    prompts = [[2] + torch.randint(107, 512, (12,), generator=g).tolist() for _ in range(args.n)]
    checkpoints.TINY_VISION = VISION
    print("| format | written by | KL(src ‖ quant), first step | argmax agreement |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fmt, producer, seed) in CASES.items():
            src = checkpoints.build_checkpoint(Path(tmp) / f"src-{name}", SPEC, seed=seed,
                                               tweak=lambda m: m.to(torch.bfloat16))
            ref = log_probs(src, prompts)
            ours = Path(tmp) / f"dgemma-{name}"
            quantize_checkpoint(src, ours, fmt)
            for who, path in ((producer, ROOT / "tests" / "fixtures" / name), ("dgemma", ours)):
                lp = log_probs(path, prompts)
                kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
                agree = (ref.argmax(-1) == lp.argmax(-1)).float().mean().item()
                print(f"| {fmt} | {who} | {kl:.2e} | {100 * agree:.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
