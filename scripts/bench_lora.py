"""What a LoRA adapter costs per denoise step (BENCHMARKS.md, "LoRA adapters").

1. This CPU, the bundled demo model: ms per forward on 4x4 sudoku prompts, without and with the bundled
   demo-sudoku-lora adapter (rank 64 on attention, dense MLP and self-conditioning MLP; rank 16 on the experts).
2. The real model's step in the kernel report's terms (dgemma_cli.step_trace, no GPU): the step traced on the meta
   device at DiffusionGemma 26B-A4B's shapes (ModelOpt NVFP4, batch 1, after 256 prompt tokens, as on an H200),
   without an adapter, with a rank-16 adapter on attention and the dense MLP, and with rank-16 experts too: the
   kernels launched and what the torch ops among them read, write and compute, each at its own floor (bytes at
   peak DRAM bandwidth or FLOPs at the bf16 tensor peak). The fused kernels' (Triton) launches are counted, not
   costed here (`make kernel-report` costs them).

    .venv/bin/python scripts/bench_lora.py [--trace-only]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import dgemma_cli  # noqa: E402,F401  (before torch: OpenMP threads sleep instead of spinning)
import torch  # noqa: E402


def cpu_rows(reps: int = 7) -> list[dict]:
    """ms per forward of each model, the two timed in turn (this machine's speed drifts: alternating keeps the
    drift out of the ratio), median of `reps` each; and the median of the per-turn ratios."""
    from eval_sudoku import held_out
    from train_sudoku import prompt_text

    from dgemma_cli.engine import load
    from dgemma_cli.checkpoint.names import resolve_adapter

    prompts = [prompt_text(p) for p, _ in held_out(32)]
    models = {"demo alone": load("demo", device="cpu", dtype="float32"),
              "demo + demo-sudoku-lora": load("demo", device="cpu", dtype="float32",
                                              adapters=[resolve_adapter("demo-sudoku-lora")])}
    per: dict[str, list[float]] = {name: [] for name in models}
    for engine in models.values():
        engine.generate(prompts[:4], seed=0, max_denoising_steps=10)  # warm-up
    for rep in range(reps):
        for name, engine in models.items():
            t0 = time.perf_counter()
            r = engine.generate(prompts, seed=rep, max_denoising_steps=10)
            forwards = max(s for row in r.steps_per_canvas for s in row)  # the batch runs until its slowest row
            per[name].append(1e3 * (time.perf_counter() - t0) / forwards)
    a, b = per.values()
    ratio = statistics.median(y / x for x, y in zip(a, b))
    return [dict(name=name, ms=statistics.median(v), ratio=ratio if name != "demo alone" else 1.0)
            for name, v in per.items()]


def trace_rows() -> list[dict]:
    from dgemma_cli.step_trace import TorchOp, trace_step
    from quant.kernels.roofline import GPUS, dram_us

    gpu = GPUS[90]
    rows = []
    for name, adapter in (("no adapter", None),
                          ("rank 16: attention + dense MLP", dict(rank=16, alpha=32, targets=("attention", "mlp"))),
                          ("rank 16: attention + dense MLP + experts", dict(rank=16, alpha=32,
                                                                            targets=("attention", "mlp"),
                                                                            expert_rank=16))):
        t = trace_step(batch=1, prompt=256, target=90, fmt="nvfp4", adapter=adapter)
        ops = [o for o in t.ops if isinstance(o, TorchOp)]
        us = sum(max(dram_us(gpu, o.bytes), o.flops / (gpu.tensor_tflops * 1e6)) for o in ops)
        rows.append(dict(name=name, kernels=t.kernels, torch_ops=len(ops), launches=len(t.launches),
                         gb=sum(o.bytes for o in ops) / 1e9, gflop=sum(o.flops for o in ops) / 1e9, ms=us / 1e3))
    return rows


def main(argv: list[str]) -> None:
    torch.set_num_threads(2)
    if "--trace-only" not in argv:
        cpu_table()
    print("\nDiffusionGemma 26B-A4B, NVFP4, batch 1, H200 (sm_90), traced on the meta device:")
    print("| adapter | kernels | torch ops | Triton launches | torch ops' GB | torch ops' GFLOP | torch ops at their "
          "floors (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in trace_rows():
        print(f"| {r['name']} | {r['kernels']:,} | {r['torch_ops']:,} | {r['launches']:,} | {r['gb']:.2f} | "
              f"{r['gflop']:,.0f} | {r['ms']:.2f} |")


def cpu_table() -> None:
    print("this CPU, demo model, 32 held-out sudoku prompts in one batch, at most 10 steps, the two in turn, "
          "median of 7:")
    print("| model | ms per forward | against demo alone (median of the turns' ratios) |")
    print("|---|---:|---:|")
    for r in cpu_rows():
        print(f"| {r['name']} | {r['ms']:.1f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
