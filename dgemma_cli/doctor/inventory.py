"""What is on this machine: each card (name, memory, compute capability, PCIe link), the driver, CUDA runtime, torch,
Triton, free host memory, and whether dgemma supports the card."""

from __future__ import annotations

import os
import platform
from pathlib import Path

MIN_CC = 80  # the Triton kernels' oldest target (sm_80, Ampere): older cards take the torch path


def host_memory_free() -> int | None:
    """MemAvailable from /proc/meminfo, bytes; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pcie_link(bus_id: str | None) -> str | None:
    """The card's current PCIe link ("16.0 GT/s PCIe x16") from sysfs; None where it cannot be read."""
    if not bus_id:
        return None
    base = Path("/sys/bus/pci/devices") / bus_id.lower()
    try:
        speed = (base / "current_link_speed").read_text().strip()
        width = (base / "current_link_width").read_text().strip()
    except OSError:
        return None
    return f"{speed} x{width}"


def _bus_id(index: int) -> str | None:
    import torch

    props = torch.cuda.get_device_properties(index)
    domain, bus, device = (getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if None in (domain, bus, device):
        return None
    return f"{domain:04x}:{bus:02x}:{device:02x}.0"


def card(index: int) -> dict:
    """One CUDA card's facts and dgemma's support for it."""
    import torch

    props = torch.cuda.get_device_properties(index)
    cc = 10 * props.major + props.minor
    supported = cc >= MIN_CC
    return {"index": index, "name": props.name, "memory_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}", "pcie_link": pcie_link(_bus_id(index)),
            "supported": supported,
            "support": "Triton kernels" if supported else f"sm_{cc} is older than sm_{MIN_CC}: the torch path only"}


def inventory(devices: list[int] | None = None) -> dict:
    """The machine, as the report's "machine" part. devices: the CUDA cards to list (default every one)."""
    import torch

    from quant.kernels.verdicts import driver_version, triton_version
    from quant.kernels.tuning import version

    cuda = torch.cuda.is_available()
    indices = (list(range(torch.cuda.device_count())) if devices is None else devices) if cuda else []
    return {
        "dgemma": version(), "python": platform.python_version(), "os": platform.system(),
        "torch": torch.__version__, "triton": triton_version(),
        "cuda_runtime": torch.version.cuda, "driver": driver_version() if cuda else None,
        "host_memory_free_bytes": host_memory_free(), "cpu_threads": os.cpu_count(),
        "cards": [card(i) for i in indices],
    }
