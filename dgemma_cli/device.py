"""Where the arithmetic runs: the device and dtype that `--device` / `--dtype` name, and how torch shares the CPU.

Below engine, quantize and bench (it imports only errors from dgemma_cli), and torch only inside its functions:
`prepare_cpu_runtime` has to run before torch is first imported, and `dgemma_cli/__init__.py` calls it.

Sharing the CPU: torch's OpenMP threads, left as they are, spin while they wait for each other (libgomp's default
wait policy). When another busy process holds one of the cores, a spinning thread burns its time slice waiting
for a thread that is not running, and every parallel region costs a scheduler slice: on a 2-core machine beside
two busy processes, the demo prompt's generation took 0.1-3.7 s instead of 0.013 s, and a 64-token run 0.9-65 s
where one thread takes 0.4 s (BENCHMARKS.md, CPU section). So:
- before torch loads its OpenMP runtime, OMP_WAIT_POLICY=PASSIVE (waiting threads sleep), unless the user set
  OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME (on an idle machine sleeping costs `make bench`'s mid-size model
  about 10%; OMP_WAIT_POLICY=ACTIVE takes it back);
- when a model is loaded onto the CPU, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set, torch's intra-op thread
  count is lowered to the cores this process may use (its CPU affinity, and a cgroup CPU quota when there is one),
  and to one thread for a model as small as the bundled demo (a denoising step's logits, canvas x vocabulary, under
  SMALL_STEP values: torch runs most ops of that size on one thread anyway, and a second thread only adds waits)
  when dgemma was imported before torch. A program that imported torch first keeps its count, capped at the usable
  cores; a count set lower than dgemma's (torch.set_num_threads) is kept. A larger model loaded after a small one
  gets back the count from before.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")

# Any of these means the user chose how OpenMP threads wait (GNU and Intel OpenMP runtimes).
WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "KMP_LIBRARY")
# Any of these means the user chose the thread count.
THREAD_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Logits per denoising step (canvas x vocabulary) below which one thread is used: the demo has 32 x 208.
SMALL_STEP = 1 << 16

_owns_torch = False  # dgemma_cli was imported before torch, so it sets torch up for the CPU
_threads: tuple[int, int] | None = None  # (the count before, the count dgemma set) after fit_cpu_threads


def prepare_cpu_runtime() -> bool:
    """Make OpenMP's waiting threads sleep instead of spin (OMP_WAIT_POLICY=PASSIVE). Only possible before torch is
    imported (the runtime reads it once, when it loads); a no-op after that or when the user chose a wait setting.
    Returns whether it set the policy."""
    global _owns_torch
    if "torch" in sys.modules:
        return False
    _owns_torch = True
    if any(k in os.environ for k in WAIT_SETTINGS):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def _cgroup_cpus(root: str = "/sys/fs/cgroup") -> int | None:
    """The CPU quota of this process's cgroup in whole CPUs (rounded up), or None when there is none."""
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]  # cgroup v2: "QUOTA PERIOD" / "max PERIOD"
    except (OSError, ValueError):
        try:  # cgroup v1
            quota = Path(root, "cpu", "cpu.cfs_quota_us").read_text()
            period = Path(root, "cpu", "cpu.cfs_period_us").read_text()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None  # v1 says -1 for none


def usable_cpus() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(n, quota) if quota else n)


def fit_cpu_threads(small: bool = False) -> int:
    """Set torch's intra-op thread count for a model about to run on the CPU (see the module docstring): the usable
    cores, or one for a `small` model. Returns the count in use."""
    import torch

    global _threads
    n = torch.get_num_threads()
    if any(os.environ.get(k) for k in THREAD_SETTINGS):
        return n
    before = _threads[0] if _threads is not None and n == _threads[1] else n  # unchanged since dgemma set it
    fit = min(before, 1 if small and _owns_torch else usable_cpus())
    if fit != n:
        torch.set_num_threads(fit)
    _threads = (before, fit)
    return fit


def check_device_name(device: str) -> None:
    """`--device` must be cpu, cuda, cuda:N or auto (checked without torch)."""
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"--device must be cpu, cuda or auto (got {device!r})")


def check_dtype_name(dtype: str) -> None:
    """`--dtype` must be one of DTYPE_NAMES or auto (checked without torch)."""
    if dtype != "auto" and dtype not in DTYPE_NAMES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPE_NAMES)} or auto (got {dtype!r})")


def parse_devices(text: str) -> list[str] | str:
    """`--devices` (checked without torch): "auto" (every CUDA device, split over only when one cannot hold the
    model), or a comma-separated list of CUDA indices (0,1) or names (cuda:0,cuda:1); "cpu,cpu" runs on the CPU the
    split a list of that many cards would (with --gpu-memory: each card's size). Returns "auto" or the names."""
    if text.strip() == "auto":
        return "auto"
    names = []
    for part in text.split(","):
        part = part.strip()
        name = f"cuda:{part}" if part.isdigit() else part
        if not (name == "cpu" or (name.startswith("cuda:") and name[5:].isdigit())):
            raise UsageError(f"--devices takes auto or a list such as 0,1 (got {text!r})")
        names.append(name)
    cards = [n for n in names if n != "cpu"]
    if cards and len(cards) != len(names):
        raise UsageError(f"--devices {text}: CUDA devices or the CPU, not both")
    if len(set(cards)) != len(cards):
        raise UsageError(f"--devices {text}: a card is named twice")
    return names


def resolve_devices(spec: list[str] | str) -> list[torch.device]:
    """parse_devices' answer -> devices; UsageError (one line) for a card this machine does not have."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return [torch.device(f"cuda:{i}") for i in range(count)] or [torch.device("cpu")]
    for name in spec:
        if name.startswith("cuda:") and int(name[5:]) >= count:
            raise UsageError(f"--devices: no {name} ({'no CUDA device' if not count else f'{count} CUDA devices'} "
                             "on this machine)")
    return [torch.device(n) for n in spec]


def resolve_device(device: str = "auto") -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device_name(device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on a GPU, float32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    check_dtype_name(dtype)
    return getattr(torch, dtype)
