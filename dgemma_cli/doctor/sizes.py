"""The doctor's kernels at a model's sizes: each family whose problem scales (quant/probes.py AT_SIZES) run at the
rows, widths, experts and vocabulary of a real step (a 256-token canvas through the 26B model: a 2816 x 2112
linear, 128 experts of 704, the head over 262,144 tokens), against the torch path at the tests' tolerances, and on
a card timed against its roofline bound: the call's least DRAM bytes at the card's peak bandwidth, or its FLOPs at
its tensor peak, whichever is longer (quant/kernels/roofline.py; the card must be one listed there).

A small problem passing says little about a kernel at sizes the small ones never reach (a grid of 262,144 / 64
tiles, int32 offsets into a 2 GB stack, launch settings tuned for thousands of rows); a family that fails here is
turned off for the card exactly as one that fails small. In Triton's interpreter the real sizes would take hours:
there `sizes` comes from a small config (`dgemma doctor --sizes tiny`), which checks the logic, not the card.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Callable

from .checks import WHAT, Check, not_for


def time_call(run: Callable[[], object], device, reps: int = 20) -> float | None:
    """The median seconds of `run` on a CUDA card, after three warm calls (CUDA events around each); None on the
    CPU, where the interpreter's time says nothing of a card."""
    if device.type != "cuda":
        return None
    import torch

    for _ in range(3):
        run()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def card_gpu(device):
    """The roofline table's entry for this card (quant/kernels/roofline.py gpu_named), or None."""
    if device.type != "cuda":
        return None
    import torch

    from quant.kernels.roofline import gpu_named

    return gpu_named(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).multi_processor_count)


def timing(call, seconds: float | None, gpu) -> dict:
    """One timed call against its bound: {call, ms, bound_ms, bound_by, x_bound} (None where not measured or the card
    is not listed)."""
    from quant.kernels.roofline import dram_us, tensor_us

    row = {"call": call.name, "ms": None if seconds is None else _sig(seconds * 1e3), "bound_ms": None,
           "bound_by": None, "x_bound": None}
    if gpu is not None:
        dram, tensor = dram_us(gpu, call.nbytes), tensor_us(gpu, call.flops, call.fp4) if call.flops else 0.0
        bound = max(dram, tensor)
        row.update(bound_ms=_sig(bound / 1e3), bound_by="DRAM" if dram >= tensor else "tensor")
        if seconds is not None and bound > 0:
            row["x_bound"] = _sig(seconds * 1e6 / bound, 3)
    return row


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def sized_checks(device, dtype, families, sizes, label: str, progress: Callable[[str], None] | None = None,
                 timer: Callable = time_call, gpu=None) -> list[Check]:
    """Each family of `families` that scales, at `sizes` (quant/probes.py Sizes), against the torch path; on a card each
    kernel call timed (`timer`) against the bound for `gpu` (default: this card's). A family that fails is turned off
    for the card and kept, as `checks.kernel_checks` does."""
    from quant.kernels import probe

    gpu = gpu if gpu is not None else card_gpu(device)
    checks, decided = [], {}
    for family in families:
        if family not in probe.AT_SIZES:
            continue
        what = f"{WHAT[family]} at {label}'s sizes"
        why = not_for(family, device)
        if why is not None:
            checks.append(Check(family, what, "not run", why))
            continue
        if progress is not None:
            progress(what)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            reason = probe.check(family, device, dtype, sizes)
        seconds = time.perf_counter() - t0
        error = max(probe.measured) if probe.measured else None
        if reason is not None:
            probe.timed.clear()  # the problem's tensors go with the calls
            if device.type == "cuda":
                import torch

                torch.cuda.empty_cache()  # the next check's problem gets the memory back
        if reason is not None and "OutOfMemoryError" in reason:  # the card's memory, not the kernel: nothing decided
            checks.append(Check(family, what, "not run", f"the card's free memory cannot hold this check at "
                                f"{label}'s sizes ({reason})", None, seconds))
            continue
        if reason is not None:
            checks.append(Check(family, what, "off", reason, error, seconds))
            decided[probe.verdict_name(family, dtype)] = {"ok": False, "why": f"{reason} at {label}'s sizes",
                                                         "error": error}
            continue
        rows = [timing(call, timer(call.run, device), gpu) for call in probe.timed]
        probe.timed.clear()  # the problem's tensors go with the calls
        checks.append(Check(family, what, "pass", _detail(error, rows, device, gpu), error, seconds, rows))
    if decided:
        probe.keep(device, decided)
    return checks


def _detail(error: float | None, rows: list[dict], device, gpu) -> str:
    said = ["exact" if error is None else f"error {error:.2f} x tolerance"]
    if device.type != "cuda":
        said.append("not timed (the interpreter)")
    elif gpu is None:
        said.append("timed; no bound: this card is not in quant/kernels/roofline.py")
    else:
        worst = max(rows, key=lambda r: r["x_bound"] or 0.0, default=None)
        if worst is not None and worst["x_bound"] is not None:
            said.append(f"{sum(r['ms'] for r in rows):.3f} ms, slowest {worst['x_bound']:.2f} x its "
                        f"{worst['bound_by']} bound")
    return "; ".join(said)
