"""The doctor's report: the machine, the checks, the verdicts kept, as one JSON-able dict (no paths, prompts or
user data: what a user can attach to an issue as it is), and `diagnose`, which runs everything in order."""

from __future__ import annotations

import time
from typing import Callable

from .checks import Check, families_for, kernel_checks
from .cuda import cuda_checks
from .inventory import inventory

SCHEMA = 1  # the report's layout version


def diagnose(device, *, fmt: str | None = None, adapters: bool = False, devices: list[int] | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Run the doctor on `device` (torch.device): every family (fmt None), or those a model of `fmt` uses (the quick
    form). The report's "ok" is False when a family was turned off."""
    import torch

    from quant.kernels.verdicts import card_key, card_name

    started = time.time()
    machine = inventory(devices)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's numbers: float32
    kernels = kernel_checks(device, dtype, families_for(fmt, adapters), progress)
    cuda = cuda_checks(device, len(machine["cards"]))
    off = [c.name for c in kernels if c.status == "off"]
    return {
        "schema": SCHEMA, "ok": not off, "card": card_name(device), "card_key": card_key(device),
        "mode": "interpreter (small shapes)" if device.type != "cuda" else "compiled (small shapes)",
        "compute_dtype": str(dtype).removeprefix("torch."), "quick": fmt is not None,
        "machine": machine, "kernels": [c.as_dict() for c in kernels], "cuda": [c.as_dict() for c in cuda],
        "turned_off": off, "not_done": NOT_DONE, "seconds": round(time.time() - started, 2),
    }


# What the full doctor asks for that this one does not do yet: said in every report, never implied.
NOT_DONE = [
    "kernel families at the real model's shapes (only the small probe shapes run)",
    "each kernel's time against its roofline bound, and the step against the kernel report's bound",
]


def summary(report: dict) -> str:
    """One line: how many families passed, which were turned off."""
    kernels = [k for k in report["kernels"] if k["status"] != "not run"]  # not for this card: nothing to agree
    passed = sum(k["status"] == "pass" for k in kernels)
    line = f"{passed} of {len(kernels)} kernel families agree with the torch path on {report['card']}"
    if len(kernels) < len(report["kernels"]):
        line += f" ({len(report['kernels']) - len(kernels)} not for this card)"
    if report["turned_off"]:
        line += f"; turned off (the torch path runs instead): {', '.join(report['turned_off'])}"
    return line


def rows(report: dict) -> list[Check]:
    return [Check(**c) for c in report["kernels"] + report["cuda"]]
