"""The held row's kernels compiled for real NVIDIA targets, no GPU needed: the class pass (quant/kernels/class_pass.py),
the dynamic programme (automaton_dp.py, with and without the head's keys reset, greedy and drawn) and the fused
head's logits kernel with held rows (head.py `_held_classes`), recorded at the real sizes (canvas 256, vocabulary
262,144) as a GPU of each compute capability would launch them, compiled with Triton's bundled ptxas (quant.kernels.aot)
and inspected: registers, spilled bytes, straight-line SASS instructions. Prints one JSON line per kernel and target.

    .venv/bin/python scripts/compile_held.py [--targets 89,90,120]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: the kernels are compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from quant.kernels import aot  # noqa: E402

V, C, H = 262_144, 256, 2816


def launches(cc: int) -> list:
    from dgemma_cli.structured.classes import class_tables
    from dgemma_cli.structured.constrain import TokenAutomaton
    from quant.kernels.class_pass import KEY_MIN
    from quant.kernels.head import HeadBuffers, HeldRows, fused_head

    words = [None] * 3 + [bytes([c]) for c in range(32, 127)]
    words += [b"%c%c" % (a, b) for a in range(97, 123) for b in range(97, 123)]
    words += [None] * (V - len(words))  # ids no structure spells: the sizes are the real ones
    auto = TokenAutomaton(class_tables('\\{"a":"[a-z]{0,8}"\\}', words, V))
    row = auto.row(C, [1], 2, generator=torch.Generator().manual_seed(0), device_search=True)
    searcher = row._searcher(torch.device("cpu"), C)
    keys = torch.full((2, C, searcher.t.classes), KEY_MIN)
    a, b = torch.zeros(C, dtype=torch.long), torch.zeros(C, dtype=torch.long)
    out = aot.record(lambda: row.step(torch.zeros(C, V), a, b, greedy=False), "class pass", cc)
    out += aot.record(lambda: row.step_keys(keys, a, b, greedy=False), "programme on the head's keys", cc)
    meta = dict(device="meta")
    buf = HeadBuffers(C, V, H, torch.bfloat16, "meta")
    buf.held = HeldRows(torch.empty(C, dtype=torch.int32, **meta), torch.empty(1, V, dtype=torch.int32, **meta),
                        torch.empty(1, V, dtype=torch.int32, **meta), torch.empty(2, C, 200, dtype=torch.int64, **meta))
    head = aot.record(lambda: fused_head(torch.empty(C, H, dtype=torch.bfloat16, **meta),
                                         torch.empty(V, H, dtype=torch.bfloat16, **meta), 30.0, H**0.5,
                                         torch.empty(C, **meta), torch.empty(C, 2, **meta), buf), "head", cc)
    return out + [x for x in head if x.kernel == "head_logits_kernel"][:1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="89,90,120")
    args = ap.parse_args()
    why = aot.missing_tools()
    if why:
        print(json.dumps({"error": why}))
        return 2
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for cc in (int(t) for t in args.targets.split(",")):
            for launch in launches(cc):
                job = aot.specialise(launch, cc)
                r = aot.compile_job(job, Path(tmp) / job.tag)
                failed += not r["ok"]
                print(json.dumps({"kernel": launch.kernel, "cc": cc, "ok": r["ok"], "error": r.get("error"),
                                  "registers": r.get("regs"), "spilled": r.get("spill_stores"),
                                  "straight": r.get("straight")}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
