"""The cards dgemma plans for: memory, DRAM bandwidth and the host link, from their vendors' specification pages.

A card is named as people say it ("RTX 4080", "rtx4060ti", "4060 Ti 16GB") or given as a size ("16GB": a card of
that much memory, on a PCIe 4.0 x16 link, as most desktop boards give a graphics card). No torch here: `dgemma plan`
answers in a fraction of a second on any machine.

Link figures: PCIe's signalling rate per lane (4.0: 16 GT/s, 5.0: 32 GT/s, 128b/130b coding) times the lanes the
card's board uses; what a copy from pinned memory reaches is less (LINK_EFFICIENCY, an assumption, not measured
here: figures derived from it say so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError

GB = 10**9
GIB = 2**30
LINK_EFFICIENCY = 0.8  # of the link's coded rate, for large pinned host-to-device copies (assumed; not measured here)
GT_PER_LANE = {3: 8.0, 4: 16.0, 5: 32.0}  # PCIe generation -> GT/s per lane (128b/130b coding from 3.0 on)


@dataclass(frozen=True)
class Card:
    name: str
    memory: int  # bytes on the card
    dram_gb_per_s: float  # the card's memory bandwidth, GB/s
    pcie_gen: int
    pcie_lanes: int
    fp8: bool = True  # FP8 tensor cores (Ada, Hopper, Blackwell); Ampere has none

    @property
    def link_gb_per_s(self) -> float:
        """The host link's coded rate, GB/s (PCIe 4.0 x16: 31.5)."""
        return GT_PER_LANE[self.pcie_gen] * self.pcie_lanes * 128 / 130 / 8

    @property
    def copy_gb_per_s(self) -> float:
        """What a large copy from pinned host memory is assumed to reach over that link, GB/s."""
        return self.link_gb_per_s * LINK_EFFICIENCY


# Memory size, memory bandwidth and bus interface from each card's NVIDIA specification page ("Specs": Memory Size,
# Memory Bandwidth / Memory Interface, Bus Support); the PCIe lanes are the card's own (the RTX 4060 family and the
# RTX 5060 Ti are x8 cards). Data-center cards: the H100 SXM and H200 datasheets (host link PCIe 5.0 x16).
CARDS = [
    Card("RTX 3060 12GB", 12 * GIB, 360, 4, 16, fp8=False),
    Card("RTX 3090", 24 * GIB, 936, 4, 16, fp8=False),
    Card("RTX 4060", 8 * GIB, 272, 4, 8),
    Card("RTX 4060 Ti 16GB", 16 * GIB, 288, 4, 8),
    Card("RTX 4070", 12 * GIB, 504, 4, 16),
    Card("RTX 4080", 16 * GIB, 716.8, 4, 16),
    Card("RTX 4090", 24 * GIB, 1008, 4, 16),
    Card("RTX 5060 Ti 16GB", 16 * GIB, 448, 5, 8),
    Card("RTX 5070", 12 * GIB, 672, 5, 16),
    Card("RTX 5070 Ti", 16 * GIB, 896, 5, 16),
    Card("RTX 5080", 16 * GIB, 960, 5, 16),
    Card("RTX 5090", 32 * GIB, 1792, 5, 16),
    Card("H100 SXM", 80 * GIB, 3350, 5, 16),
    Card("H200", 141 * GB, 4800, 5, 16),
]
# other spellings people use for the same cards
ALIASES = {"rtx3060": "RTX 3060 12GB", "rtx306012gb": "RTX 3060 12GB", "rtx4060ti": "RTX 4060 Ti 16GB",
           "rtx4060ti16gb": "RTX 4060 Ti 16GB", "rtx5060ti": "RTX 5060 Ti 16GB", "rtx5060ti16gb": "RTX 5060 Ti 16GB",
           "h100": "H100 SXM", "h100sxm": "H100 SXM", "h200": "H200", "h200sxm": "H200"}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m)?\s*$", re.I)


def _key(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce")
    return key if key.startswith(("rtx", "h1", "h2")) else "rtx" + key if key[:1].isdigit() else key


def parse_size(text: str, what: str = "--gpu-memory") -> int:
    """'16GB', '16G', '16' (GB), '12.5GiB', '8000MB' -> bytes (GB and MB decimal, GiB and MiB binary)."""
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"{what} {text!r}: give a size such as 16GB, 12.5GiB or 8000MB")
    value, unit = float(m[1]), (m[2] or "gb").lower()
    scale = {"gib": GIB, "gb": GB, "g": GB, "mib": 2**20, "mb": 10**6, "m": 10**6}[unit]
    size = int(value * scale)
    if size < 256 * 2**20:
        raise UsageError(f"{what} {text}: at least 256 MiB")
    return size


def card(text: str) -> Card:
    """A card by name (the table above), or a size: a card of that memory on a PCIe 4.0 x16 link."""
    by_key = {_key(c.name): c for c in CARDS}
    key = _key(text)
    found = by_key.get(key) or by_key.get(_key(ALIASES.get(key, "")))
    if found is not None:
        return found
    if _SIZE.match(text):
        size = parse_size(text, "--gpu")
        return Card(f"{size / GB:.3g} GB card", size, 0.0, 4, 16)
    known = ", ".join(c.name for c in CARDS)
    raise UsageError(f"--gpu {text!r}: not a card dgemma knows ({known}) or a size such as 16GB")


def sized(base: Card, memory: int) -> Card:
    """The same card with `memory` to plan for (--gpu-memory: room left for a desktop, or another card's size)."""
    return Card(base.name, memory, base.dram_gb_per_s, base.pcie_gen, base.pcie_lanes, base.fp8)


def card_for(device, memory: int) -> Card:
    """The card a device plans as with `memory` bytes (--gpu-memory, or its free memory): a CUDA device's own figures
    (card_of_device); the CPU, which runs the plan a card of that size would, as such a card."""
    if device.type == "cuda":
        return sized(card_of_device(device), memory)
    return Card("card of --gpu-memory", memory, 0.0, 4, 16)


def card_of_device(device) -> Card:
    """The table's card for a CUDA device (by its name, the longest match), with the device's own memory; one not
    in the table: its memory on a PCIe 4.0 x16 link."""
    import torch

    return _matched(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)


def local_cards() -> list[Card]:
    """This machine's NVIDIA cards as the driver's nvidia-smi reports them (name, total memory), each matched to the
    table; [] without nvidia-smi or a card. No torch: `dgemma info` and `dgemma plan` stay fast."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    cards = []
    for line in out.stdout.strip().splitlines():
        name, _, mib = line.rpartition(",")
        try:
            memory = int(float(mib.strip())) * 2**20
        except ValueError:
            continue
        cards.append(_matched(name.strip(), memory))
    return cards


def _matched(name: str, memory: int) -> Card:
    """A device's name matched to the table (the longest match) with the device's own memory."""
    key = _key(name)
    keys = {_key(c.name): c for c in CARDS}
    keys.update({k: keys[_key(v)] for k, v in ALIASES.items()})
    best = max((k for k in keys if key.startswith(k)), key=len, default=None)
    return Card(name, memory, 0.0, 4, 16) if best is None else sized(keys[best], memory)
