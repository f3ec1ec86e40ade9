"""The doctor's checks: each Triton kernel family against the torch path on this card (quant/kernels/probe.py's
problems: seeded, small, with partial tiles, at the kernel tests' tolerances). A family that fails to compile, fails to run or disagrees is turned off for this card, kept (verdicts.py), and
the torch path runs in its place from then on.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by the command before Triton is imported):
the same problems, the same verdicts, kept for the CPU as a card, so the doctor's logic is exercised without a GPU.
This module is what the engine's first use of a card runs (first_use.py): it imports nothing above the network.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable

COMMON = ("head", "rms_norm", "softcap", "router", "moe_plan", "gelu_mul")  # every model, every format
BY_FORMAT = {
    "nvfp4": ("nvfp4_linear", "moe_nvfp4", "nvfp4_w4a4", "moe_nvfp4_w4a4", "nvfp4_w4a4_gated"),
    "int8": ("int8_linear", "moe_int8", "w8a8_linear_int8", "moe_w8a8_int8"),  # dgemma's INT8 and W8A8 INT8
    "fp8": ("w8a8_linear_fp8", "moe_w8a8_fp8"),
    "gguf": ("ggml_decode", "moe_gguf", "ggml_linear", "head_gguf"),  # a GGUF file's blocks
    "bf16": (),
}
LORA = ("lora", "moe_lora", "lora_epilogue")
WHAT = {  # a family, in the report's words
    "nvfp4_linear": "NVFP4 linear", "nvfp4_w4a4": "NVFP4 W4A4 linear", "nvfp4_w4a4_gated": "NVFP4 W4A4 gated MLP",
    "int8_linear": "INT8 linear", "w8a8_linear_fp8": "FP8 W8A8 linear", "w8a8_linear_int8": "INT8 W8A8 linear",
    "moe_nvfp4": "NVFP4 experts", "moe_nvfp4_w4a4": "NVFP4 W4A4 experts", "moe_int8": "INT8 experts",
    "moe_w8a8_fp8": "FP8 W8A8 experts", "moe_w8a8_int8": "INT8 W8A8 experts", "router": "router",
    "moe_plan": "expert plan (routing)", "head": "fused head and its draws", "rms_norm": "RMS norms",
    "softcap": "logit softcap", "gelu_mul": "GELU x up", "lora": "LoRA (linear)", "moe_lora": "LoRA (experts)",
    "lora_epilogue": "LoRA (epilogue)", "ggml_decode": "GGUF block decode", "moe_gguf": "GGUF experts",
    "ggml_linear": "GGUF linear", "head_gguf": "fused head on GGUF blocks",
}
@dataclass
class Check:
    name: str  # a family, or a CUDA-only check's name
    what: str
    status: str  # "pass", "off" (turned off for this card), "not run"
    detail: str = ""  # why it is off, or not run; a measured figure
    error: float | None = None  # the largest error as a fraction of its tolerance (kernel checks)
    seconds: float | None = None
    timings: list[dict] | None = None  # at a model's sizes: each kernel call's time against its bound (sizes.py)

    def as_dict(self) -> dict:
        return asdict(self)


def families_for(fmt: str | None = None, adapters: bool = False) -> tuple[str, ...]:
    """The families a model of format `fmt` uses (None: every family: the full doctor)."""
    from quant.kernels.probe import FAMILIES

    if fmt is None:
        return FAMILIES
    chosen = COMMON + BY_FORMAT.get(fmt, ()) + (LORA if adapters else ())
    return tuple(f for f in FAMILIES if f in chosen)


def not_for(family: str, device) -> str | None:
    """Why a family's kernel does not run on this card at all (its modules take another kernel or the torch path
    there, so it has nothing to agree with), or None. The interpreter runs every kernel."""
    if device.type != "cuda":
        return None
    from quant.kernels import moe_w8a8, nvfp4_w4a4

    if family in ("nvfp4_w4a4", "moe_nvfp4_w4a4", "nvfp4_w4a4_gated") and not nvfp4_w4a4.supported(device):
        return "not for this card: FP4 tensor cores (sm_100, sm_120); NVFP4 runs through nvfp4_linear here"
    for kind in ("fp8", "int8"):
        if family in (f"w8a8_linear_{kind}", f"moe_w8a8_{kind}") and not moe_w8a8.supported(kind, device):
            return (f"not for this card: {kind.upper()} tensor cores (sm_{moe_w8a8.MIN_ARCH[kind]} or newer); the "
                    "torch path runs W8A8 here")
    return None


def kernel_checks(device, dtype, families, progress: Callable[[str], None] | None = None) -> list[Check]:
    """Each family's kernel against the torch path on `device`; the verdicts kept for the card (an "off" family
    answers False to probe.family_ok from here on, in this process and later ones)."""
    from quant.kernels import probe

    checks, decided = [], {}
    for family in families:
        if progress is not None:
            progress(WHAT[family])
        why = not_for(family, device)
        if why is not None:  # nothing decided: its modules never ask for it on this card
            checks.append(Check(family, WHAT[family], "not run", why))
            continue
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # the interpreter's numpy overflow notices: the comparison is the verdict
            warnings.simplefilter("ignore", RuntimeWarning)
            reason = probe.check(family, device, dtype)
        seconds = time.perf_counter() - t0
        error = max(probe.measured) if probe.measured else None
        if reason is None:
            detail = "exact" if error is None else f"error {error:.2f} x tolerance"
            checks.append(Check(family, WHAT[family], "pass", detail, error, seconds))
        else:
            checks.append(Check(family, WHAT[family], "off", reason, error, seconds))
        decided[probe.verdict_name(family, dtype)] = {"ok": reason is None, "why": reason or "", "error": error}
    probe.keep(device, decided)
    return checks
