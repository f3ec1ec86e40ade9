"""Which Triton kernel families agree with the torch path on this card, kept across processes.

The rule: a family's verdict on a card (agrees, or turned off and why) is decided once per card, driver, Triton and
dgemma version, by `dgemma doctor` or by the first process that probes it (probe.py), and every later process on the
same card reads it instead of deciding again: a family turned off stays off for run, chat, serve and bench until the
card, driver, Triton or dgemma changes, or `dgemma doctor --reset` forgets it.

One JSON file in dgemma's home (tuning.home()), `<home>/doctor/verdicts.json`:

    {"cards": {KEY: {"checked": unix time, "families": {family: {"ok": bool, "why": str, "error": float | null}}}}}

KEY is `card_key(device)`: the card's name, its driver, Triton's and dgemma's versions (the CPU under Triton's
interpreter is a card too, so the doctor's logic is tested without a GPU). Written atomically (a temporary file
renamed over it) and re-read before each write, so two processes add their own verdicts without losing the other's;
an unreadable file is ignored (decided again) with one line on stderr, a home that cannot be written only means
nothing is kept. The file holds no paths, prompts or user data.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .tuning import _warn_once, home, version, write_json

def path() -> Path:
    return home() / "doctor" / "verdicts.json"


def driver_version() -> str:
    """The NVIDIA driver's version (from /proc on Linux), else 'unknown'."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return "unknown"


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


def card_name(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            return torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError):  # no driver to ask (a test's stand-in device)
            return f"cuda:{device.index}"
    return f"{device.type} (Triton interpreter)"


def card_key(device: torch.device) -> str:
    """What a verdict is kept for: the card, its driver, Triton, dgemma."""
    driver = driver_version() if device.type == "cuda" else "-"
    return f"{card_name(device)} | driver {driver} | triton {triton_version()} | dgemma {version()}"


def _read(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (FileNotFoundError, NotADirectoryError):
        return {"cards": {}}
    if not isinstance(data, dict) or not isinstance(data.get("cards"), dict):
        raise ValueError("not a verdicts file")
    return data


def load(key: str) -> dict[str, dict]:
    """{family: {"ok", "why", "error"}} kept for a card key ({} when none, or when the file is unreadable)."""
    file = path()
    try:
        data = _read(file)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        _warn_once(f"read {file}", f"dgemma: ignoring the unreadable kernel verdicts {file} ({type(e).__name__}); "
                                   "checking the kernels again")
        return {}
    families = data["cards"].get(key, {}).get("families", {})
    return {f: v for f, v in families.items() if isinstance(v, dict) and isinstance(v.get("ok"), bool)}


def save(key: str, verdicts: dict[str, dict]) -> None:
    """Merge `verdicts` ({family: {"ok", "why", "error"}}) into the card's entry, atomically."""
    file = path()
    try:
        data = _read(file)
    except (OSError, ValueError):
        data = {"cards": {}}  # damaged: already said by load; written whole again
    entry = data["cards"].setdefault(key, {"families": {}})
    entry.setdefault("families", {}).update(verdicts)
    entry["checked"] = int(time.time())
    try:
        write_json(file, data)
    except OSError as e:
        _warn_once(f"write {file}", f"dgemma: cannot keep the kernel verdicts in {file} ({type(e).__name__}: {e}); "
                                    "they will be checked again next run")


def forget() -> bool:
    """Delete every kept verdict (`dgemma doctor --reset`); whether there was anything to forget."""
    try:
        path().unlink()
        return True
    except FileNotFoundError:
        return False
