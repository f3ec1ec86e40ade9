"""What one image costs: time and memory to turn it into soft tokens, at each budget, on this machine.

    .venv/bin/python scripts/bench_image.py                      # the real tower's shapes, random weights
    .venv/bin/python scripts/bench_image.py --tower tiny         # the test checkpoints' tiny tower
    .venv/bin/python scripts/bench_image.py --budgets 70,280 --device cuda --dtype bfloat16

The image is a 1600 x 1200 random photo-sized RGB picture (4:3, so every budget pads a few patches, as most
photos do). For each budget, in a fresh process (so that the peak memory is that budget's own): `patchify`
(resize, rescale, patches) and the vision tower with its projection (`VisionTower.forward`), best of --repeat
runs after one warm-up run (the real tower on a CPU: one run, no warm-up, as a run takes from a minute to many);
the process's resident memory with the tower loaded, and its peak rise while the image is encoded (activations
and temporaries; sampled every 5 ms). Speed does not depend on the weights' values, so random weights at the real
shapes time the real tower.
Prints a Markdown table and the tower's size per format.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The published google/diffusiongemma-26B-A4B-it's vision_config (and text hidden size), for the real shapes.
REAL_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                   num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
                   position_embedding_size=10240, rope_theta=100.0, standardize=True)
REAL_TEXT_HIDDEN = 2816
TINY_VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, position_embedding_size=1024, standardize=True)
TINY_TEXT_HIDDEN = 64


def rss_mb() -> float:
    """The process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


class PeakRSS:
    """The highest resident memory seen while the block runs, sampled every 5 ms by a thread."""

    def __enter__(self):
        import threading

        self.peak, self.stop = rss_mb(), threading.Event()

        def sample():
            while not self.stop.wait(0.005):
                self.peak = max(self.peak, rss_mb())

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_mb())


def build(tower: str, device: str, dtype):
    import torch

    from dgemma_cli.config import VisionConfig
    from dgemma_cli.vision import VisionTower

    cfg = VisionConfig(**(REAL_VISION if tower == "real" else TINY_VISION))
    with torch.device("meta"):
        net = VisionTower(cfg, REAL_TEXT_HIDDEN if tower == "real" else TINY_TEXT_HIDDEN)
    net = net.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "norm" in name or name == "std_scale":
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * 0.02)
    return net.eval().requires_grad_(False)


def one(args) -> dict:
    """One budget, in this process: {budget, soft_tokens, patches, patchify_s, tower_s, peak_mb, rise_mb}."""
    import torch
    from PIL import Image

    from dgemma_cli.device import fit_cpu_threads
    from dgemma_cli.image import patchify
    from dgemma_cli.vision import encode_images

    if args.device == "cpu":
        fit_cpu_threads(small=False)
    dtype = getattr(torch, args.dtype)
    net = build(args.tower, args.device, dtype)
    g = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (1200, 1600, 3), dtype=torch.uint8, generator=g)
    img = Image.frombytes("RGB", (1600, 1200), bytes(pixels.flatten().tolist()))
    slow = args.tower == "real" and args.device == "cpu"
    reps = 1 if slow else args.repeat

    def timed(fn):
        best = float("inf")
        out = None
        for _ in range(reps + (0 if slow else 1)):  # the first of several is a warm-up
            t = time.perf_counter()
            out = fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return out, best

    patches, t_patch = timed(lambda: patchify(img, args.budget))
    base = rss_mb()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as peak:
        feats, t_tower = timed(lambda: encode_images(net, [patches]))
    out = dict(budget=args.budget, soft_tokens=patches.soft_tokens, patches=int((patches.position_ids[:, 0] >= 0).sum()),
               size=list(patches.size), patchify_s=t_patch, tower_s=t_tower, runs=reps, loaded_mb=base,
               rise_mb=peak.peak - base, threads=torch.get_num_threads())
    if args.device == "cuda":
        out["gpu_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    assert feats.shape[0] == patches.soft_tokens
    return out


def sizes() -> list[tuple[str, int]]:
    """(part, parameters) of the real tower at the published shapes."""
    import torch

    from dgemma_cli.config import VisionConfig
    from dgemma_cli.vision import VisionTower

    with torch.device("meta"):
        net = VisionTower(VisionConfig(**REAL_VISION), REAL_TEXT_HIDDEN)
    parts = {"layers": 0, "patch embedding + position table": 0, "projection (embed_vision)": 0, "standardize": 0}
    for name, p in net.named_parameters():
        key = ("layers" if name.startswith("layers.") else "projection (embed_vision)" if name.startswith("embed_")
               else "standardize" if name.startswith("std_") else "patch embedding + position table")
        parts[key] += p.numel()
    return list(parts.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tower", choices=("real", "tiny"), default="real")
    ap.add_argument("--budgets", default="70,140,280,560,1120")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)  # internal: one budget in this process
    args = ap.parse_args()
    if args.budget:
        print(json.dumps(one(args)))
        return
    rows = []
    for b in (int(x) for x in args.budgets.split(",")):
        cmd = [sys.executable, __file__, "--tower", args.tower, "--device", args.device, "--dtype", args.dtype,
               "--repeat", str(args.repeat), "--budget", str(b)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        if res.returncode:
            sys.exit(f"budget {b}: {res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    print(f"{args.tower} tower, {args.device}, {args.dtype}, {rows[0]['threads']} threads; image 1600 x 1200\n")
    print("| budget | resized to | patches | soft tokens | patchify | tower + projection | RSS, tower loaded | "
          "peak rise while encoding |" + (" GPU peak |" if args.device == "cuda" else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.device == "cuda" else ""))
    for r in rows:
        runs = "" if r["runs"] > 1 else " (1 run)"
        gpu = f" {r['gpu_peak_mb']:.0f} MB |" if "gpu_peak_mb" in r else ""
        print(f"| {r['budget']} | {r['size'][1]} x {r['size'][0]} | {r['patches']} | {r['soft_tokens']} | "
              f"{r['patchify_s'] * 1000:.0f} ms | {r['tower_s']:.2f} s{runs} | {r['loaded_mb']:.0f} MB | "
              f"{r['rise_mb']:.0f} MB |{gpu}")
    if args.tower == "real":
        print("\n| part | parameters | bf16 (published) | float32 (CPU) |\n|---|---|---|---|")
        total = 0
        for part, n in sizes():
            total += n
            print(f"| {part} | {n / 1e6:.1f} M | {2 * n / 1e9:.3f} GB | {4 * n / 1e9:.3f} GB |")
        print(f"| total | {total / 1e6:.1f} M | {2 * total / 1e9:.3f} GB | {4 * total / 1e9:.3f} GB |")


if __name__ == "__main__":
    main()
