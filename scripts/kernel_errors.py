"""Per-format error table of the Triton kernels against the PyTorch reference on dequantized weights.

    python scripts/kernel_errors.py          # on the CPU: Triton's interpreter (set here); on CUDA: compiled

Max relative error max|kernel - reference| / max|reference| over the awkward row counts 1, 17, 33, 255, 256, for the
NVFP4 and INT8 linear kernels ([80, 96] weights) and the fused MoE (6 experts, hidden 64, expert width 48, top-2,
one expert never routed to), in float32 and bfloat16; W4A4 (NVFP4 activations x NVFP4 weights) against its PyTorch
emulation, and what W4A4 costs: the emulation against the same weights with 16-bit activations; both with per-token
activation scales and with a calibrated static one (ModelOpt's input_scale, here the batch's amax / (6 * 448)).
"""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["DGEMMA_KERNELS"] = "triton"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from quant import int8, nvfp4  # noqa: E402
from quant.kernels.int8_linear import int8_linear  # noqa: E402
from quant.kernels.nvfp4_linear import nvfp4_linear  # noqa: E402
from quant.kernels.nvfp4_w4a4 import nvfp4_w4a4, reference as w4a4_reference  # noqa: E402
from quant.modules import fused_experts  # noqa: E402
from test_kernels import DEVICE, build_stacks, reference_experts, rel  # noqa: E402

ROWS = (1, 17, 33, 255, 256)


def main() -> int:
    g = torch.Generator().manual_seed(0)
    errors = {}
    N, K = 80, 96
    w = torch.randn(N, K, generator=g)
    qn, qi = nvfp4.quantize(w, search=True), int8.quantize(w)
    E, H, I, TOPK = 6, 64, 48, 2
    stacks = {f: build_stacks(f, E, H, I, g) for f in ("nvfp4", "int8")}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            x = torch.randn(rows, K, generator=g).to(dtype).to(DEVICE)
            got = nvfp4_linear(x, qn.weight.to(DEVICE), qn.weight_scale.to(DEVICE), qn.weight_scale_2.expand(N).to(DEVICE))
            errors.setdefault(("nvfp4", "linear", dtype), []).append(rel(got, x @ nvfp4.dequantize(qn, dtype).to(DEVICE).T))
            got = int8_linear(x, qi.weight.to(DEVICE), qi.weight_scale.to(DEVICE))
            errors.setdefault(("int8", "linear", dtype), []).append(rel(got, x @ int8.dequantize(qi, dtype).to(DEVICE).T))
            args = (qn.weight, qn.weight_scale, qn.weight_scale_2.expand(N))
            emulated = w4a4_reference(x.cpu(), *args)
            got = nvfp4_w4a4(x, *(a.to(DEVICE) for a in args))
            errors.setdefault(("nvfp4 W4A4", "linear", dtype), []).append(rel(got.cpu(), emulated))
            sixteen = (x.cpu().double() @ nvfp4.dequantize(qn).double().T)
            errors.setdefault(("W4A4 emulation vs 16-bit activations", "linear", dtype), []).append(
                rel(emulated, sixteen))
            # with a calibrated static scale (ModelOpt's input_scale), as a calibration on this batch would set it
            static = (x.cpu().float().abs().max() / 2688).reshape(1)
            emulated = w4a4_reference(x.cpu(), *args, static)
            got = nvfp4_w4a4(x, *(a.to(DEVICE) for a in args), static.to(DEVICE))
            errors.setdefault(("nvfp4 W4A4, input_scale", "linear", dtype), []).append(rel(got.cpu(), emulated))
            errors.setdefault(("W4A4 (input_scale) emulation vs 16-bit activations", "linear", dtype), []).append(
                rel(emulated, sixteen))
            xe = torch.randn(rows, H, generator=g).to(dtype).to(DEVICE)
            index = torch.stack([torch.randperm(E - 1, generator=g)[:TOPK] for _ in range(rows)]).to(DEVICE)
            weights = torch.rand(rows, TOPK, generator=g).to(DEVICE)
            for fmt, (gu, dn) in stacks.items():
                got = fused_experts(gu, dn, xe, index, weights)
                errors.setdefault((fmt, "fused MoE", dtype), []).append(rel(got, reference_experts(gu, dn, xe, index, weights)))
    print(f"device: {DEVICE}{' (Triton interpreter)' if DEVICE == 'cpu' else ''}\n")
    print("| format | kernel | " + " | ".join(f"{r} rows, fp32" for r in ROWS) + " | max, bf16 |")
    print("|---|---|" + "---|" * (len(ROWS) + 1))
    for fmt, kernel in (("nvfp4", "linear"), ("nvfp4", "fused MoE"), ("int8", "linear"), ("int8", "fused MoE"),
                        ("nvfp4 W4A4", "linear"), ("W4A4 emulation vs 16-bit activations", "linear"),
                        ("nvfp4 W4A4, input_scale", "linear"),
                        ("W4A4 (input_scale) emulation vs 16-bit activations", "linear")):
        if True:
            f32 = errors[(fmt, kernel, torch.float32)]
            b16 = errors[(fmt, kernel, torch.bfloat16)]
            print(f"| {fmt} | {kernel} | " + " | ".join(f"{e:.1e}" for e in f32) + f" | {max(b16):.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
