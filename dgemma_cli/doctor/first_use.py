"""The doctor's quick form, at load: the first time run, chat, serve or bench meet a card (no verdict kept for the
families the model uses), those families are checked against the torch path on it, small shapes, in seconds, and
one line says so. What disagrees is turned off for the card (verdicts.py), as `dgemma doctor` would."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .checks import families_for, kernel_checks, not_for


def model_format(path: Path) -> str:
    """The checkpoint's format's short name ('bf16' unquantized), as run runs it."""
    from ..checkpoint.stored import is_gguf
    from ..checkpoint.weights import stored_format

    if is_gguf(path):
        return "gguf"
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    return stored_format(path, raw)[0]


def first_use(device, path: Path, dtype, adapters: bool = False) -> str | None:
    """Check the families a model at `path` uses on `device` if none was decided for this card yet; the line to say,
    or None (nothing checked: verdicts kept already, or no Triton kernel runs on this device unprobed)."""
    from quant.kernels import probe, use_triton
    from quant.kernels.verdicts import card_name

    if not use_triton(device) or not probe.needs_probe(device):
        return None
    kept = probe.kept_verdicts(device)
    todo = [f for f in families_for(model_format(path), adapters)
            if probe.verdict_name(f, dtype) not in kept and not_for(f, device) is None]
    if not todo:
        return None
    t0 = time.perf_counter()
    checks = kernel_checks(device, dtype, todo)
    off = [c.name for c in checks if c.status == "off"]
    said = (f"first use of {card_name(device)}: {len(checks)} kernel families checked against the torch path in "
            f"{time.perf_counter() - t0:.1f} s, ")
    said += f"turned off (the torch path runs instead): {', '.join(off)}" if off else "all agree"
    return said + "; `dgemma doctor` gives the full report"
