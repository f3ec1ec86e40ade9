"""What quantization costs in accuracy: weight error, logit KL, token agreement and task accuracy.

    python scripts/quant_report.py [--n 200] [--skip-task]

1. Weight error: relative RMS error ||W - deq(W)|| / ||W|| per format, scale choice (absmax, search) and tensor kind
   (routed experts, attention, dense MLP), on the bundled demo model's trained weights and on Gaussian and
   heavy-tailed (Student t, 3 degrees of freedom) matrices at the real model's expert shape [704, 2816].
2. Model: the demo model quantized with `dgemma quantize` per format and policy, against the unquantized one on
   held-out prompts: mean KL(p_ref || p_quant) of the decoder's first-step distribution over the canvas, argmax
   agreement there, and the share of generated tokens equal to the unquantized run's with the same seed.
3. Task: held-out exact-match accuracy of each quantized demo model with default sampler settings.
Prints Markdown tables for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from dgemma_cli.engine import DEMO_MODEL, load  # noqa: E402
from dgemma_cli.store.quantize import quantize_checkpoint  # noqa: E402
from dgemma_cli.checkpoint.weights import load_model  # noqa: E402
from quant import int8, nvfp4  # noqa: E402

CASES = [("int8", "experts"), ("int8", "all"), ("nvfp4", "experts"), ("nvfp4", "all")]


def rel_rms(w: torch.Tensor, fmt: str, search: bool) -> tuple[float, float]:
    """(sum of squared errors, sum of squares) of one matrix [N, K]."""
    w = w.float()
    if fmt == "nvfp4":
        deq = nvfp4.dequantize(nvfp4.quantize(w, search=search))
    else:
        deq = int8.dequantize(int8.quantize(w, search=search))
    return (deq - w).pow(2).sum().item(), w.pow(2).sum().item()


def weight_error_table() -> str:
    model, _ = load_model(DEMO_MODEL, dtype=torch.float32)
    kinds = {"experts": [], "attention": [], "dense MLP": []}
    for layer in model.layers:
        for e in range(layer.experts.num_experts):
            kinds["experts"] += [layer.experts.gate_up_proj[e], layer.experts.down_proj[e]]
        a = layer.self_attn
        kinds["attention"] += [p.weight for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj) if p is not None]
        kinds["dense MLP"] += [layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight, layer.mlp.down_proj.weight]
    g = torch.Generator().manual_seed(0)
    synthetic = {
        "Gaussian [704, 2816]": [torch.randn(704, 2816, generator=g)],
        "Student t3 [704, 2816]": [torch.distributions.StudentT(3.0).sample((704, 2816))],
    }
    rows = ["| weights | INT8 absmax | INT8 search | NVFP4 absmax | NVFP4 search |", "|---|---|---|---|---|"]
    for name, mats in [*(("demo " + k, v) for k, v in kinds.items()), *synthetic.items()]:
        cells = []
        for fmt in ("int8", "nvfp4"):
            for search in (False, True):
                err = tot = 0.0
                for w in mats:
                    a, b = rel_rms(w, fmt, search)
                    err, tot = err + a, tot + b
                cells.append(f"{100 * (err / tot) ** 0.5:.3f}%")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def first_step_distribution(engine, prompts: list[str]) -> torch.Tensor:
    """log-probabilities [B, C, V] of the decoder's first step on a fixed random canvas, at the first step's
    temperature (t_max), for chat prompts."""
    ids = engine.batch_ids(prompts)
    m = engine.model
    T = max(map(len, ids))
    batch = torch.tensor([[0] * (T - len(p)) + p for p in ids])
    valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in ids])
    C = m.cfg.canvas_length
    with torch.no_grad():
        cache = m.new_cache(len(ids), T + C)
        m.encode(batch, cache, valid)
        canvas = torch.randint(0, m.cfg.text.vocab_size, (len(ids), C), generator=torch.Generator().manual_seed(1))
        logits = m.denoise(canvas, cache, m.denoise_context(cache, len(ids)))
    return F.log_softmax(logits / engine.settings.t_max, dim=-1)


def model_table(n: int, task: bool, work: Path, model_dir: Path = DEMO_MODEL) -> str:
    """Rows per format and policy for one model (the demo's task accuracy only for the demo)."""
    from eval_demo import eval_dgemma, held_out

    texts = held_out(n)
    prompts = [f"upper: {t}" for t in texts]
    task = task and model_dir == DEMO_MODEL
    base = load(model_dir, device="cpu", dtype="float32")
    ref_lp = first_step_distribution(base, prompts)
    # the demo model converges in 2 steps; random weights never converge, so their runs are bounded
    gen = {} if model_dir == DEMO_MODEL else {"max_new_tokens": 2 * base.config.canvas_length,
                                              "max_denoising_steps": 8}
    ref_tokens = base.generate(prompts, seed=0, **gen).token_ids
    rows = ["| format | policy | size on disk | KL(ref ‖ quant), first step | argmax agreement | "
            "generated tokens equal | task exact-match |", "|---|---|---|---|---|---|---|"]
    base_acc = eval_dgemma(model_dir, texts)["accuracy"] if task else None
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    rows.append(f"| float32 (reference) | - | {size / 1e6:.2f} MB | 0 | 100% | 100% | "
                f"{'' if base_acc is None else f'{100 * base_acc:.1f}%'} |")
    for fmt, policy in CASES:
        out = work / f"{model_dir.name}-{fmt}-{policy}"
        quantize_checkpoint(model_dir, out, fmt, policy)
        q = load(out, device="cpu", dtype="float32")
        lp = first_step_distribution(q, prompts)
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        agree = (ref_lp.argmax(-1) == lp.argmax(-1)).float().mean().item()
        toks = q.generate(prompts, seed=0, **gen).token_ids
        same = sum(a == b for x, y in zip(ref_tokens, toks) for a, b in zip(x, y))
        total = sum(max(len(x), len(y)) for x, y in zip(ref_tokens, toks))
        acc = eval_dgemma(out, texts)["accuracy"] if task else None
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        rows.append(f"| {fmt} | {policy} | {size / 1e6:.2f} MB | {kl:.2e} | {100 * agree:.2f}% | "
                    f"{100 * same / total:.2f}% | {'' if acc is None else f'{100 * acc:.1f}%'} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=200, help="held-out prompts")
    p.add_argument("--skip-task", action="store_true", help="no task accuracy (faster)")
    args = p.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    print("Relative RMS weight error, ||W - deq(W)|| / ||W||:\n")
    print(weight_error_table())
    with tempfile.TemporaryDirectory() as tmp:
        print(f"\nDemo model quantized, {args.n} held-out prompts (dgemma, float32 compute, CPU):\n")
        print(model_table(args.n, not args.skip_task, Path(tmp)))
        # A random checkpoint in the real layout (transformers' save_pretrained): its distributions are spread,
        # so KL and agreement show the quantization error that the confident demo model hides.
        sys.path.insert(0, str(ROOT / "tests"))
        from checkpoints import SPECS, build_checkpoint

        rand = build_checkpoint(Path(tmp) / "random", SPECS["five_to_one"], seed=0)
        print(f"\nRandom tiny checkpoint (tests' five_to_one spec, vocab 512), same prompts:\n")
        print(model_table(args.n, False, Path(tmp), rand))
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
