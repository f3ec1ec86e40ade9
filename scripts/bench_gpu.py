"""The prepared GPU check (`make bench-gpu`): kernels against the reference, then the benchmark table.

    PYTHONPATH=. python3 scripts/bench_gpu.py [--out DIR] [--quick] [--dry-run]

Runs under the machine's own python3 (torch with CUDA, triton, transformers; written for Python 3.12, torch 2.11,
triton 3.6, transformers 5.17, huggingface_hub 1.33 and later): nothing is installed, and nothing on its path imports
the Hub client (dgemma_cli/store/hub.py needs huggingface_hub 2). In order, each part printed as soon as it is done and
appended to DIR/bench-gpu.json (DIR: $OUT, else the current folder):
1. the kernel tests compiled for the GPU (pytest tests/test_kernels.py, tests/test_fused_head.py and
   tests/test_routing_kernels.py: NVFP4, INT8, fused MoE, the fused head, the router (its split programs meeting on
   a counter, for real in parallel) against the PyTorch reference on dequantized weights, awkward shapes);
2. every gpu-marked test (pytest -m gpu over the test files that carry the marker: the CUDA graph captured and
   replayed, the Triton path's tokens against the torch path's), pass or fail;
3. the same Triton-against-torch check with its figures (dgemma_cli/bench.py `compare_kernel_paths`: bf16 weights,
   tokens identical; NVFP4 and INT8 with every projection quantized, first-step logits within a tolerance and most
   tokens equal; the same random draws on both sides);
4. `dgemma bench` on the real 26B-A4B shapes (random weights made on the GPU), canvas 256, 16 fixed steps:
   NVFP4, INT8 and bf16 at batch 1 with a 512-token prompt; NVFP4 at batch 4; NVFP4 with an 8k-token prompt
   (peak memory); NVFP4 planned for a 12 GB card (--gpu-memory: the experts that do not fit stream from pinned host
   memory), beside its copies at the measured host-to-device rate; bf16 against transformers (its compiled
   static-cache path where it has one) in the same process;
5. the issue's targets, each marked met or not.
Budgeted to finish in about 7 minutes on an H200 (the reference's random init and compilation are the slowest
part); --quick skips the reference comparison. --dry-run: the same script on the CPU at the tiny config (the
Triton kernels in Triton's interpreter, the gpu-marked tests skipped): a check of this script, no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
    # planned for a 12 GB card (the RTX 3060's): the experts that do not fit stream from pinned host memory
    ("nvfp4 b1 p512 in 12 GB", dict(fmt="nvfp4", batch=1, prompt=512, gpu_memory=12 * 10**9)),
]
KERNEL_PATHS = [("bf16", "experts"), ("nvfp4", "all"), ("int8", "all")]  # (format, policy) compared


def pytest_run(args: list[str], env: dict, timeout: int) -> dict:
    """Run pytest in a subprocess: its exit code, pass/fail, the last lines of its output, seconds."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], env=env,
                           capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = None, f"timed out after {timeout} s\n" + (e.stdout or b"").decode(errors="replace")
    tail = out.strip().splitlines()[-15:]
    print("\n".join(tail), flush=True)
    return {"returncode": rc, "passed": rc == 0, "tail": tail, "seconds": round(time.perf_counter() - t0, 1)}


def gpu_test_files() -> list[str]:
    """The test files that carry the gpu marker (collecting only them keeps unrelated imports out of the run)."""
    return sorted(str(p) for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def streamed_ratio(results: dict) -> float | None:
    """The streamed run's ms a step over max(the resident run's, its copies over the measured host link)."""
    streamed, resident = results.get("nvfp4 b1 p512 in 12 GB", {}), results.get("nvfp4 b1 p512", {})
    if not streamed.get("host_to_device_gbs") or not resident.get("ms_per_step") or not streamed.get("ms_per_step"):
        return None
    copies = 1000 * streamed["streamed_bytes_per_step"] / (streamed["host_to_device_gbs"] * 1e9)
    return streamed["ms_per_step"] / max(resident["ms_per_step"], copies)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--quick", action="store_true", help="skip the transformers comparison")
    ap.add_argument("--dry-run", action="store_true", help="the same script on the CPU at the tiny config (a check "
                    "of this script, no figures)")
    args = ap.parse_args()
    config, device = ("tiny", "cpu") if args.dry_run else ("real", "cuda")
    if args.dry_run:  # the Triton kernels on the CPU: the interpreter, chosen before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
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
                         "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for module in ("triton", "transformers", "huggingface_hub"):
        try:
            results["device"][module] = __import__(module).__version__
        except ImportError:
            results["device"][module] = None
    print(json.dumps(results["device"]), flush=True)

    env = dict(os.environ, PYTHONPATH=str(ROOT), DGEMMA_KERNELS="triton")
    if not args.dry_run:
        env.pop("TRITON_INTERPRET", None)
        print("\n== kernel tests", flush=True)
        results["kernel_tests"] = pytest_run(["-x", str(ROOT / "tests" / "test_kernels.py"),
                                              str(ROOT / "tests" / "test_fused_head.py"),
                                              str(ROOT / "tests" / "test_routing_kernels.py")], env, 240)
    else:
        results["kernel_tests"] = {"skipped": "dry run"}
    save()

    print("\n== gpu-marked tests", flush=True)
    env.pop("DGEMMA_KERNELS")  # each test chooses its path
    results["gpu_tests"] = pytest_run(["-m", "gpu", *gpu_test_files()], env, 240)
    save()

    from dgemma_cli.bench import as_dict, compare_kernel_paths, run_bench

    results["kernel_paths"] = {}
    for fmt, policy in KERNEL_PATHS:
        label = fmt if fmt == "bf16" else f"{fmt} {policy}"
        t = time.perf_counter()
        try:
            r = compare_kernel_paths(fmt, policy, device=device, dtype="bfloat16")
        except Exception as e:  # keep going: the other checks are still worth having
            r = {"passed": False, "failures": [f"{type(e).__name__}: {e}"]}
        results["kernel_paths"][label] = r
        shown = {k: r.get(k) for k in ("passed", "tokens_equal", "token_agreement", "first_step_logit_rel_diff",
                                       "failures")}
        print(f"\n== triton vs torch path, {label} ({time.perf_counter() - t:.0f} s): {json.dumps(shown)}", flush=True)
        save()
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
        if device == "cuda":
            torch.cuda.empty_cache()
        save()

    def write_targets():
        def get(label, key):
            return results.get(label, {}).get(key)

        paths = results["kernel_paths"]
        targets = [
            ("kernel tests pass", get("kernel_tests", "passed"), lambda v: v),
            ("gpu-marked tests pass", get("gpu_tests", "passed"), lambda v: v),
            ("Triton path gives the torch path's tokens", all(r.get("passed") for r in paths.values()), lambda v: v),
            ("CUDA graph replayed in the bf16 row", get("bf16 b1 p512", "graph_replays"), lambda v: v > 0),
            ("NVFP4 step within 1.3x of its floor", get("nvfp4 b1 p512", "floor_ratio"), lambda v: v <= 1.3),
            ("INT8 step within 1.3x of its floor", get("int8 b1 p512", "floor_ratio"), lambda v: v <= 1.3),
            ("bf16 step within 1.2x of its floor", get("bf16 b1 p512", "floor_ratio"), lambda v: v <= 1.2),
            (">= 3000 tok/s in the canvas, NVFP4", get("nvfp4 b1 p512", "tokens_per_s"), lambda v: v >= 3000),
            (">= 5x transformers (bf16)", get("bf16 vs transformers", "speedup_vs_reference"), lambda v: v >= 5),
            ("batch 4 >= 2.5x batch 1 tok/s", (get("nvfp4 b4 p512", "tokens_per_s") or 0) /
             (get("nvfp4 b1 p512", "tokens_per_s") or float("inf")), lambda v: v >= 2.5),
            ("NVFP4 peak memory at 8k < 20 GB", get("nvfp4 b1 p8192", "peak_memory_gb"), lambda v: v < 20),
            ("streamed step (12 GB plan) within 1.25x of max(resident step, its copies at the measured link)",
             streamed_ratio(results), lambda v: v <= 1.25),
        ]
        results["targets"] = {}
        for name, value, ok in targets:
            results["targets"][name] = {"value": value, "met": value is not None and bool(ok(value))}
        save()

    write_targets()  # the reference comes last: if it runs out of time the rest is saved
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

    write_targets()
    print("\n== targets")
    for name, t in results["targets"].items():
        print(f"{'met ' if t['met'] else 'NOT '} {name}: {t['value']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
