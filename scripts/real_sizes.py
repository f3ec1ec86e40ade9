"""Sizes of the real DiffusionGemma 26B-A4B per format and policy, computed from its config's shapes.

    python scripts/real_sizes.py

Weights (what dgemma holds; on disk the same plus safetensors headers and the small files), split by part, and the
estimated GPU memory of a run at 2k, 8k and 32k tokens of context (dgemma_cli/checkpoint/footprint.py: weights, bf16 KV cache,
a request's step memory on the GPU path, one layer's experts dequantized by the PyTorch path for a quantized format,
512 MiB of slack). These are computed, not measured. Decimal units: 1 GB = 1e9 bytes. BENCHMARKS.md prints the table
(tests/test_real_sizes.py checks it is this output).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B, ModelConfig  # noqa: E402
from dgemma_cli.checkpoint.footprint import runtime_bytes, weight_bytes  # noqa: E402

cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
GB = 1e9
print("| format | policy | experts | attention + dense MLP | embedding | other | weights | GPU @2k | GPU @8k | GPU @32k |")
print("|---|---|---|---|---|---|---|---|---|---|")
for fmt, policy in (("bf16", "-"), ("fp8", "all"), ("int8", "all"), ("int8", "experts"), ("nvfp4", "experts"),
                    ("nvfp4", "all")):
    pol = "experts" if policy == "-" else policy
    w = weight_bytes(cfg, fmt, pol)
    gpu = [runtime_bytes(cfg, fmt, pol, context=c) / GB for c in (2048, 8192, 32768)]
    print(f"| {fmt} | {policy} | {w['experts'] / GB:.2f} | {w['dense'] / GB:.2f} | {w['embedding'] / GB:.2f} | "
          f"{w['other'] / GB:.3f} | {sum(w.values()) / GB:.2f} | " + " | ".join(f"{g:.1f}" for g in gpu) + " |")
