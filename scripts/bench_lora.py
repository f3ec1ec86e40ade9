"""What a LoRA adapter costs per denoise step (BENCHMARKS.md, "LoRA adapters").

1. This CPU, the bundled demo model: ms per forward on 4x4 sudoku prompts, without and with the bundled
   demo-sudoku-lora adapter (rank 64 on attention, dense MLP and self-conditioning MLP; rank 16 on the experts).
2. The real model's step in the kernel report's terms (dgemma_cli.step_trace, no GPU): the step traced on the meta
   device at DiffusionGemma 26B-A4B's shapes (ModelOpt NVFP4, batch 1, after 256 prompt tokens, as on an H200),
   without an adapter, with a rank-16 adapter on attention and the dense MLP, and with rank-16 experts too: the
   kernels launched and what the torch ops among them read, write and compute, each at its own floor (bytes at
   peak DRAM bandwidth or FLOPs at the bf16 tensor peak). The fused kernels' (Triton) launches are counted, not
   costed here (`make kernel-report` costs them).

    .venv/bin/python scripts/bench_lora.py
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


def cpu_rows() -> list[dict]:
    from eval_sudoku import held_out
    from train_sudoku import prompt_text

    from dgemma_cli.engine import load
    from dgemma_cli.names import resolve_adapter

    prompts = [prompt_text(p) for p, _ in held_out(32)]
    rows = []
    for name, adapters in (("demo alone", []), ("demo + demo-sudoku-lora", [resolve_adapter("demo-sudoku-lora")])):
        engine = load("demo", device="cpu", dtype="float32", adapters=adapters)
        engine.generate(prompts[:4], seed=0, max_denoising_steps=10)  # warm-up
        per = []
        for rep in range(3):
            t0 = time.perf_counter()
            r = engine.generate(prompts, seed=rep, max_denoising_steps=10)
            forwards = max(s for row in r.steps_per_canvas for s in row)  # the batch runs until its slowest row
            per.append(1e3 * (time.perf_counter() - t0) / forwards)
        rows.append(dict(name=name, ms=statistics.median(per)))
    return rows


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


def main() -> None:
    torch.set_num_threads(2)
    print("this CPU, demo model, 32 held-out sudoku prompts in one batch, at most 10 steps, median of 3:")
    print("| model | ms per forward |")
    print("|---|---:|")
    for r in cpu_rows():
        print(f"| {r['name']} | {r['ms']:.1f} |")
    print("\nDiffusionGemma 26B-A4B, NVFP4, batch 1, H200 (sm_90), traced on the meta device:")
    print("| adapter | kernels | torch ops | Triton launches | torch ops' GB | torch ops' GFLOP | torch ops at their "
          "floors (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in trace_rows():
        print(f"| {r['name']} | {r['kernels']:,} | {r['torch_ops']:,} | {r['launches']:,} | {r['gb']:.2f} | "
              f"{r['gflop']:,.0f} | {r['ms']:.2f} |")


if __name__ == "__main__":
    main()
