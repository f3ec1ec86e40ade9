"""The doctor's report: the machine, the checks, the verdicts kept, as one JSON-able dict (no paths, prompts or
user data: what a user can attach to an issue as it is), and `diagnose`, which runs everything in order."""

from __future__ import annotations

import time
from typing import Callable

from .checks import Check, families_for, kernel_checks
from .cuda import cuda_checks
from .inventory import inventory
from .sizes import sized_checks

SCHEMA = 2  # the report's layout version (2: at_sizes, failed, each check's timings)


def diagnose(device, *, fmt: str | None = None, adapters: bool = False, devices: list[int] | None = None,
             progress: Callable[[str], None] | None = None, sizes: tuple | None = None,
             sizes_skipped: str | None = None) -> dict:
    """Run the doctor on `device` (torch.device): every family (fmt None), or those a model of `fmt` uses (the quick
    form); sizes: (label, quant.probes.Sizes) to run the families that scale at a model's sizes too, timed on a card
    against their bounds (sizes.py); else sizes_skipped says why not. The report's "ok" is False when a family was
    turned off or a check of the machinery failed."""
    import torch

    from quant.kernels.verdicts import card_key, card_name

    started = time.time()
    machine = inventory(devices)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's numbers: float32
    families = families_for(fmt, adapters)
    kernels = kernel_checks(device, dtype, families, progress)
    if sizes is not None:
        label, at = sizes
        sized = sized_checks(device, dtype, families, at, label, progress)
    else:
        label, sized = None, [Check("model_sizes", "the kernels at the real model's sizes", "not run", sizes_skipped
                                    or "not asked")]
    cuda = cuda_checks(device, len(machine["cards"]), progress)
    off = sorted({c.name for c in kernels + sized if c.status == "off"}, key=[c.name for c in kernels].index)
    failed = [c.name for c in cuda if c.status == "fail"]
    shapes = "small shapes" + (f" and {label}'s sizes" if label else "")
    return {
        "schema": SCHEMA, "ok": not off and not failed, "card": card_name(device), "card_key": card_key(device),
        "mode": f"interpreter ({shapes})" if device.type != "cuda" else f"compiled ({shapes})",
        "compute_dtype": str(dtype).removeprefix("torch."), "quick": fmt is not None, "sizes": label,
        "machine": machine, "kernels": [c.as_dict() for c in kernels], "at_sizes": [c.as_dict() for c in sized],
        "cuda": [c.as_dict() for c in cuda], "turned_off": off, "failed": failed, "not_done": NOT_DONE,
        "seconds": round(time.time() - started, 2),
    }


# What the full doctor asks for that this one does not do: said in every report, never implied.
NOT_DONE = [
    "the W8A8 and W4A4 experts and the three LoRA families at a model's sizes (their references loop over every "
    "token in Python: small shapes only)",
    "the whole step against the kernel report's bound: `make bench-gpu` times the step beside it (BENCHMARKS.md)",
]


def summary(report: dict) -> str:
    """One line: how many families passed, which were turned off, which checks of the machinery failed."""
    kernels = [k for k in report["kernels"] if k["status"] != "not run"]  # not for this card: nothing to agree
    passed = sum(k["status"] == "pass" for k in kernels)
    line = f"{passed} of {len(kernels)} kernel families agree with the torch path on {report['card']}"
    if len(kernels) < len(report["kernels"]):
        line += f" ({len(report['kernels']) - len(kernels)} not for this card)"
    sized = [k for k in report["at_sizes"] if k["status"] != "not run"]
    if sized:
        line += f"; {sum(k['status'] == 'pass' for k in sized)} of {len(sized)} at {report['sizes']}'s sizes"
    if report["turned_off"]:
        line += f"; turned off (the torch path runs instead): {', '.join(report['turned_off'])}"
    if report["failed"]:
        line += f"; failed: {', '.join(report['failed'])}"
    return line


def rows(report: dict) -> list[Check]:
    return [Check(**c) for c in report["kernels"] + report["at_sizes"] + report["cuda"]]
