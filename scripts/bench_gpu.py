"""The prepared GPU check (`make bench-gpu`): kernels against the reference, then the benchmark table.

    PYTHONPATH=. python3 scripts/bench_gpu.py [--out DIR] [--quick]

Runs under the machine's own python3 (torch with CUDA, triton, transformers): nothing is installed. In order,
each part printed as soon as it is done and appended to DIR/bench-gpu.json (DIR: $OUT, else the current folder):
1. the kernel tests compiled for the GPU (pytest tests/test_kernels.py: NVFP4, INT8, fused MoE, sampler epilogue
   against the PyTorch reference on dequantized weights, awkward shapes);
2. `dgemma bench` on the real 26B-A4B shapes (random weights made on the GPU), canvas 256, 16 fixed steps:
   NVFP4, INT8 and bf16 at batch 1 with a 512-token prompt; NVFP4 at batch 4; NVFP4 with an 8k-token prompt
   (peak memory); bf16 against transformers (bf16, eager) in the same process;
3. the issue's targets, each marked met or not.
Budgeted to finish in about 6 minutes on an H200 (the 26B reference's random init is the slowest part); --quick
skips the reference comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUNS = [  # (label, bench arguments)
    ("nvfp4 b1 p512", dict(fmt="nvfp4", batch=1, prompt=512)),
    ("int8 b1 p512", dict(fmt="int8", batch=1, prompt=512)),
    ("bf16 b1 p512", dict(fmt="bf16", batch=1, prompt=512)),
    ("nvfp4 b4 p512", dict(fmt="nvfp4", batch=4, prompt=512)),
    ("nvfp4 b1 p8192", dict(fmt="nvfp4", batch=1, prompt=8192)),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--quick", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU at the tiny config (a check "
                    "of this script, no figures)")
    args = ap.parse_args()
    config, device = ("tiny", "cpu") if args.dry_run else ("real", "cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench-gpu.json"
    results: dict = {}

    def save():
        log.write_text(json.dumps(results, indent=1))

    import torch

    if not torch.cuda.is_available() and not args.dry_run:
        print("no CUDA device: nothing to do")
        return 1
    results["device"] = {"name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
                         "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        results["device"]["triton"] = triton.__version__
    except ImportError:
        results["device"]["triton"] = None
    print(json.dumps(results["device"]), flush=True)

    t0 = time.perf_counter()
    if args.dry_run:
        results["kernel_tests"] = {"skipped": "dry run"}
    env = dict(os.environ, PYTHONPATH=str(ROOT), DGEMMA_KERNELS="triton")
    env.pop("TRITON_INTERPRET", None)
    if not args.dry_run:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            str(ROOT / "tests" / "test_kernels.py")], env=env, capture_output=True, text=True,
                           cwd=ROOT, timeout=240)
        tail = (p.stdout + p.stderr).strip().splitlines()[-15:]
        results["kernel_tests"] = {"returncode": p.returncode, "tail": tail, "seconds": time.perf_counter() - t0}
        print("\n".join(tail), flush=True)
    save()

    from dgemma_cli.bench import as_dict, run_bench

    os.environ["DGEMMA_KERNELS"] = "auto"
    for label, kw in RUNS:
        t = time.perf_counter()
        try:
            r = run_bench(config, steps=16, device=device, **kw)
            results[label] = as_dict(r)
            print(f"\n== {label} ({time.perf_counter() - t:.0f} s)\n{r.table()}", flush=True)
        except Exception as e:  # keep going: the other rows are still worth having
            results[label] = {"error": f"{type(e).__name__}: {e}"}
            print(f"\n== {label}: {results[label]['error']}", flush=True)
        torch.cuda.empty_cache()
        save()
    if not args.quick:
        t = time.perf_counter()
        try:
            r = run_bench(config, fmt="bf16", batch=1, prompt=512, steps=16, device=device, compare="transformers")
            results["bf16 vs transformers"] = as_dict(r)
            print(f"\n== bf16 vs transformers ({time.perf_counter() - t:.0f} s)\n{r.table()}", flush=True)
        except Exception as e:
            results["bf16 vs transformers"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"\n== bf16 vs transformers: {results['bf16 vs transformers']['error']}", flush=True)
        save()

    def get(label, key):
        return results.get(label, {}).get(key)

    targets = [
        ("NVFP4 step within 1.3x of its floor", get("nvfp4 b1 p512", "floor_ratio"), lambda v: v <= 1.3),
        ("INT8 step within 1.3x of its floor", get("int8 b1 p512", "floor_ratio"), lambda v: v <= 1.3),
        ("bf16 step within 1.2x of its floor", get("bf16 b1 p512", "floor_ratio"), lambda v: v <= 1.2),
        (">= 3000 tok/s in the canvas, NVFP4", get("nvfp4 b1 p512", "tokens_per_s"), lambda v: v >= 3000),
        (">= 5x transformers (bf16)", get("bf16 vs transformers", "speedup_vs_reference"), lambda v: v >= 5),
        ("batch 4 >= 2.5x batch 1 tok/s", (get("nvfp4 b4 p512", "tokens_per_s") or 0) /
         (get("nvfp4 b1 p512", "tokens_per_s") or float("inf")), lambda v: v >= 2.5),
        ("NVFP4 peak memory at 8k < 20 GB", get("nvfp4 b1 p8192", "peak_memory_gb"), lambda v: v < 20),
    ]
    results["targets"] = {}
    print("\n== targets")
    for name, value, ok in targets:
        met = value is not None and ok(value)
        results["targets"][name] = {"value": value, "met": met}
        print(f"{'met ' if met else 'NOT '} {name}: {value}")
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
