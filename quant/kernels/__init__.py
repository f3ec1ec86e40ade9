"""Triton kernels for dgemma's quantized formats and sampler, one kernel per file.

Which implementation runs is one explicit switch, `DGEMMA_KERNELS`:
- `torch`: the plain PyTorch reference everywhere (dequantize, matmul; the sampler in torch);
- `triton`: the Triton kernels (on the CPU they run in Triton's interpreter, which needs TRITON_INTERPRET=1 set
  before triton is imported: slow, for tests at small sizes);
- `auto` (default): Triton on CUDA when it is installed, torch elsewhere.
Every kernel is tested against the reference on the dequantized weights (tests/test_kernels.py). On a GPU each
kernel family is also checked against the torch path at its first use in a process (probe.py: one that fails to
compile or disagrees falls back to torch with one line on stderr), and launch settings are timed on first use and
cached per GPU model (tuning.py).
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

CHOICES = ("torch", "triton", "auto")


def requested() -> str:
    value = os.environ.get("DGEMMA_KERNELS", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"DGEMMA_KERNELS must be one of {', '.join(CHOICES)} (got {value!r})")
    return value


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels run for tensors on `device` under the current DGEMMA_KERNELS."""
    choice = requested()
    if choice == "torch":
        return False
    if choice == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("DGEMMA_KERNELS=triton but triton is not installed")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError("DGEMMA_KERNELS=triton on the CPU needs TRITON_INTERPRET=1 (Triton's interpreter)")
    return True


def arch(device: torch.device) -> int:
    """Compute capability as one number (90 for sm_90) of a CUDA device; 0 elsewhere (the interpreter), where the
    launch tables take their portable rows (the static report, quant/kernels/aot.py, stands in its own answer)."""
    if device.type != "cuda" or interpreting():
        return 0
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def shared_b_operand(cc: int) -> bool:
    """Whether the tensor cores read the weight operand from shared memory (wgmma on sm_90, tcgen05 on sm_100 and
    its kin): a decoded tile is then stored once and read by every warp, so a tile can cover many rows. sm_120
    (consumer Blackwell, RTX 50) has neither and runs mma.sync like Ampere and Ada, with their launch settings."""
    return 90 <= cc < 120


def m_bucket(rows: int) -> int:
    """Rows rounded up to a power of two (at least 16): launch settings are tuned and cached per bucket."""
    return max(16, 1 << max(0, rows - 1).bit_length())


def sm_count(device: torch.device) -> int | None:
    """The GPU's SM count: the device's own on CUDA, the static report's target's where it answers `arch`
    (quant/kernels/aot.py), None elsewhere (the interpreter)."""
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    from .roofline import GPUS

    gpu = GPUS.get(arch(device))
    return gpu.sms if gpu is not None else None


def fewest_waves(device: torch.device, programs: int, choices: Iterable[int]) -> int:
    """How many ways (one of `choices`) to split each of `programs` programs' work so the GPU's SMs run the fewest
    waves per unit of work (ceil(programs x S / SMs) / S), the smallest such S; 1 where the SM count is unknown.
    For launches whose own grid leaves SMs idle (a canvas's router, the head's soft embedding at batch 1)."""
    sms = sm_count(device)
    if sms is None:
        return 1
    return min(choices, key=lambda s: (-(-programs * s // sms) / s, s))


# Kernels whose programs share a tile's work (split over K or H) count the programs that finished it in int32
# counters the last program sets back to 0: per (kernel, device), allocated zeroed once (before any graph capture: a
# canvas's first steps run eagerly) and grown when a launch has more tiles; an outgrown one is kept, never freed,
# since a captured CUDA graph may still point at it.
_counters: dict[tuple[str, torch.device], torch.Tensor] = {}
_retired: list[torch.Tensor] = []


def tile_counters(kernel: str, device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, at least `tiles` of them, for `kernel`'s launches on `device` (each launch's last
    program of a tile sets its counter back to 0, so they are zero between launches)."""
    have = _counters.get((kernel, device))
    if have is None or have.numel() < tiles:
        if have is not None:
            _retired.append(have)
        have = _counters[(kernel, device)] = torch.zeros(max(128, 1 << max(0, tiles - 1).bit_length()),
                                                         dtype=torch.int32, device=device)
    return have
