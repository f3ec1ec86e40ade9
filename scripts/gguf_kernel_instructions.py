"""The GGUF expert kernels' thread-instructions per weight, from their compiled code, at the real 26B-A4B shapes: each
gate-up / down block-type pair given is recorded through `quant.ggml_modules.gguf_experts` as a GPU of the target
would launch it (quant/kernels/aot.py), compiled with Triton's bundled ptxas and its SASS loop counted
(quant/kernels/roofline.py), as the kernel report does, without a GPU.

    .venv/bin/python scripts/gguf_kernel_instructions.py [--targets 89] [--pairs Q4_K/Q5_0,Q8_0/Q8_0] [--batch 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels, not the interpreter: before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="89")
    ap.add_argument("--pairs", default="Q4_K/Q5_0,Q6_K/Q8_0,Q8_0/Q8_0,Q3_K/Q8_0")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    import torch

    from quant.ggml_modules import GGUFStack, gguf_experts
    from quant.kernels import aot, roofline

    rows = args.batch * aot.CANVAS
    top_w, top_i = aot.random_routing(rows, args.batch)
    x = torch.empty(rows, aot.HIDDEN, dtype=torch.bfloat16)
    root = Path(tempfile.mkdtemp(prefix="gguf-sass-"))
    for cc in (int(t) for t in args.targets.split(",")):
        for pair in args.pairs.split(","):
            gk, dk = pair.split("/")
            gu = GGUFStack(aot.EXPERTS, 2 * aot.EXPERT, aot.HIDDEN, gk, device="meta")
            dn = GGUFStack(aot.EXPERTS, aot.HIDDEN, aot.EXPERT, dk, device="meta")
            for launch in aot.record(lambda: gguf_experts(gu, dn, x, top_i, top_w), "gguf experts", cc):
                if launch.kernel not in ("moe_gate_up_kernel", "moe_down_kernel"):
                    continue
                job = aot.specialise(launch, cc)
                res = aot.compile_job(job, root / job.tag)
                if not res["ok"]:
                    print(f"sm_{cc} {pair} {launch.kernel}: did not compile: {res['error']}")
                    continue
                _, per = roofline.warp_instructions(launch.kernel, roofline.declaration(launch.kernel),
                                                    aot.routed(launch.named(), rows, args.batch), launch.grid,
                                                    res["num_warps"], res["loops"], res["straight"])
                kind = gk if "gate_up" in launch.kernel else dk
                print(f"sm_{cc} {launch.kernel} {kind}: {per:.1f} thread-instructions a weight, "
                      f"{res['spill_stores']} B spilled ({job.config})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
