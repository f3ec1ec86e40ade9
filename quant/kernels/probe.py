"""First use of a Triton kernel family on a GPU: run it once on a small problem and compare with the torch path.

The modules ask `family_ok(family, device, dtype)` where DGEMMA_KERNELS selects Triton. The first time in a process
that a family is asked about on a CUDA device (per device and compute dtype) its kernel runs on a small fixed
problem (seeded, a few dozen rows, sizes that leave partial tiles) next to the torch path. If it raises (a compile
error included) or disagrees beyond the kernel tests' tolerances (tests/test_kernels.py), one line goes to stderr,

    dgemma: the Triton <family> kernel <failed to compile|failed to run|disagrees with the torch path> on this GPU
    (<short reason>); using the torch path

and the family answers False for the rest of the process: its modules take the torch path, nothing crashes. The
verdict is kept for the card (verdicts.py), so later processes on it read it instead of probing, and so is every
verdict `dgemma doctor` reaches. On the CPU nothing is probed (the interpreter runs the kernels only in tests, which
check them), but a verdict kept for it (the doctor runs there too) is followed; `check` runs a probe directly on
any device.

Not during a CUDA-graph capture: a probe synchronizes with the host, which a capture forbids. A family not yet
probed when a capture asks gets the torch path inside that capture, and nothing is recorded, so it is probed at its
next eager use. The engine never hits this: its first denoise step of every canvas, and the step before a capture,
run eagerly (dgemma_cli/engine.py, GraphedDenoiser), the fused head with them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

FAMILIES = ("nvfp4_linear", "nvfp4_w4a4", "int8_linear", "moe_nvfp4", "moe_nvfp4_w4a4", "moe_int8",
            "moe_w8a8_int8", "moe_w8a8_fp8", "head", "rms_norm", "softcap", "moe_plan", "router", "lora",
            "moe_lora", "lora_epilogue", "gelu_mul", "w8a8_linear_fp8", "w8a8_linear_int8",
            "nvfp4_w4a4_gated", "ggml_decode", "moe_gguf", "ggml_linear", "head_gguf")
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}  # max |kernel - ref| / max |ref|

_ok: dict[tuple[str, int, torch.dtype], bool] = {}  # (family, device index, dtype) -> verdict, this process
measured: list[float] = []  # each comparison's relative error over its tolerance, since `check` last began


@dataclass
class Timed:
    """A kernel call a probe at a model's sizes leaves to be timed (`dgemma doctor`): `run()` repeats it; `nbytes` is
    its least DRAM traffic, `flops` its useful FLOPs (FP4 x FP4 products where `fp4`)."""
    name: str
    run: Callable[[], object]
    nbytes: float
    flops: float
    fp4: bool = False


timed: list[Timed] = []  # the calls the last `check` at a model's sizes left to be timed


def needs_probe(device: torch.device) -> bool:
    """Whether kernels on `device` are probed before use: CUDA only (tests replace this to probe on the CPU)."""
    return device.type == "cuda"


def family_ok(family: str, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `family`'s Triton kernel may run on `device` for inputs of `dtype` (see the module docstring): a
    verdict kept for this card (verdicts.py: by `dgemma doctor`, or by an earlier process's probe) if there is one,
    else the probe's, kept for the next process."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}")
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else -1
    key = (family, index, dtype)
    if key in _ok:
        return _ok[key]
    kept = kept_verdicts(device).get(verdict_name(family, dtype))
    if kept is not None:
        _ok[key] = kept["ok"]
        return _ok[key]
    if not needs_probe(device):
        _ok[key] = True
        return True
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False  # not probed yet: the torch path for this capture, the probe at the next eager use
    _ok[key] = True  # while the probe runs the family's own entry point (fused_experts asks again) runs the kernel
    try:
        reason = check(family, device, dtype)
    except BaseException:  # interrupted: no verdict
        del _ok[key]
        raise
    if reason is not None:
        _ok[key] = False
        print(f"dgemma: the Triton {family} kernel {reason}; using the torch path", file=sys.stderr)
    keep(device, {verdict_name(family, dtype): {"ok": reason is None, "why": reason or "", "error": None}})
    return _ok[key]


def verdict_name(family: str, dtype: torch.dtype) -> str:
    """A kept verdict's name: the family and the compute dtype it was checked in ("head bfloat16")."""
    return f"{family} {str(dtype).removeprefix('torch.')}"


_kept: dict[tuple, dict] = {}  # (home, card key) -> {verdict name: verdict}, read once a process


def kept_verdicts(device: torch.device) -> dict[str, dict]:
    """The verdicts kept for `device`'s card (verdicts.py), read once per process and home."""
    from . import verdicts

    cache = (str(verdicts.path()), device.type, device.index)
    if cache not in _kept:
        _kept[cache] = dict(verdicts.load(verdicts.card_key(device)))
    return _kept[cache]


def keep(device: torch.device, decided: dict[str, dict]) -> None:
    """Keep verdicts for `device`'s card, in this process and for later ones (verdicts.py)."""
    from . import verdicts

    kept_verdicts(device).update(decided)
    verdicts.save(verdicts.card_key(device), decided)
    for name, v in decided.items():  # this process's own answers follow what was decided
        family, _, dtype = name.partition(" ")
        for key in [k for k in _ok if k[0] == family and str(k[2]).removeprefix("torch.") == dtype]:
            _ok[key] = v["ok"]


def check(family: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, sizes=None) -> str | None:
    """Run `family`'s probe on `device` now: None when the kernel agrees with the torch path, else what went wrong
    ("failed to compile (...)", "failed to run (...)", "disagrees with the torch path (...) on this GPU"). The
    comparisons' errors, as fractions of their tolerances, are left in `measured`. sizes: a model's (quant/probes.py
    Sizes; the family must be in AT_SIZES), whose kernel calls are left in `timed`; None: the small problem."""
    measured.clear()
    timed.clear()
    args = (device, dtype) if sizes is None else (device, dtype, sizes)
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                err = PROBES[family](*args)
        else:
            err = PROBES[family](*args)
    except Exception as e:
        what = "failed to compile" if type(e).__module__.startswith("triton") else "failed to run"
        first = (str(e).strip().splitlines() or [""])[0][:120]  # compile errors span many lines
        return f"{what} on this GPU ({type(e).__name__}{': ' + first if first else ''})"
    return None if err is None else f"disagrees with the torch path on this GPU ({err})"


def reset() -> None:
    """Forget every verdict this process holds (a fresh process, for tests); the kept ones are read again."""
    _ok.clear()
    _kept.clear()


# The problem each family is checked on: quant/probes.py (which builds them from the quantized modules) registers
# them when the quant package is imported, so this module imports nothing above the kernels.
PROBES: dict = {}
AT_SIZES: set[str] = set()  # the families whose problem also runs at a model's sizes: f(device, dtype, sizes)


def register(problems: dict, at_sizes=()) -> None:
    """Add first-use problems: family -> f(device, dtype) returning None (agrees) or a short mismatch reason;
    at_sizes: those that also take a model's sizes as a third argument."""
    unknown = (set(problems) | set(at_sizes)) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown kernel families {sorted(unknown)}")
    PROBES.update(problems)
    AT_SIZES.update(at_sizes)
