"""The doctor's checks that only a CUDA card can run: on the CPU each is listed as not run, with why; on a card, what
the doctor measures itself (the pinned host-to-device rate), and what it leaves to the GPU-marked tests, said so."""

from __future__ import annotations

import time

from .checks import Check

CUDA_ONLY = (  # (name, what it checks); the GPU-marked tests (pytest -m gpu) run those the doctor does not yet
    ("cuda_graph", "the denoise step captured in a CUDA graph and replayed equal to eager"),
    ("copy_stream", "streamed experts: the copy stream, its events and the first-use check"),
    ("pinned_h2d", "pinned host-to-device copy rate"),
    ("two_cards", "a split over two cards"),
)


def cuda_checks(device, cards: int) -> list[Check]:
    """The checks only CUDA runs: on the CPU each is listed as not run, with why; on a card, what the doctor measures
    itself (the pinned rate), and what it leaves to the GPU-marked tests, said so."""
    out = []
    for name, what in CUDA_ONLY:
        if device.type != "cuda":
            out.append(Check(name, what, "not run", "needs a CUDA card"))
        elif name == "pinned_h2d":
            from ..bench import host_to_device_bandwidth

            t0 = time.perf_counter()
            rate = host_to_device_bandwidth(device)
            out.append(Check(name, what, "pass", f"{rate / 1e9:.1f} GB/s", None, time.perf_counter() - t0))
        elif name == "two_cards" and cards < 2:
            out.append(Check(name, what, "not run", "one card"))
        else:
            out.append(Check(name, what, "not run", "not in the doctor yet: `python3 -m pytest -m gpu` runs it"))
    return out
