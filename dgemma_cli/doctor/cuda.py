"""The doctor's checks of the machinery around the kernels, on the bundled demo model (4 layers, 9 MB): each runs
one generation two ways and asks for the same tokens.

- cuda_graph: the denoise steps replayed from CUDA graphs (the default on a card) against the same steps run eagerly
  (DGEMMA_EAGER=1): equal tokens and steps, and graphs replayed. CUDA only.
- copy_stream: the experts of all but one layer streamed from pinned host memory through the copy stream and its
  events (placement/streaming.py), at the card memory where the planner streams them, against the model resident.
- two_cards: the layers split over two cards (the planner's split at a memory neither card holds alone) against one
  card. With one card it is not run.
- pinned_h2d: the pinned host-to-device copy rate, measured.

On the CPU copy_stream and two_cards run as the CPU runs them (one device standing in for each card, copies in
order): the same plans and schedules, no CUDA stream, said so; cuda_graph and pinned_h2d are not run.
"""

from __future__ import annotations

import time
from typing import Callable

from ..bench import environment
from .checks import Check

CUDA_ONLY = (  # (name, what it checks)
    ("cuda_graph", "the denoise steps replayed from CUDA graphs equal to eager"),
    ("copy_stream", "streamed experts: the copy stream, its events and buffers"),
    ("pinned_h2d", "pinned host-to-device copy rate"),
    ("two_cards", "a split over two cards"),
)
PROMPTS = [[2, 20, 21, 22, 23, 24, 25, 26], [2, 30, 31, 32]]  # token ids of the demo's vocabulary (208)


def generation(engine) -> tuple[list[list[int]], list, dict]:
    """(token ids, steps per canvas, stats) of one seeded generation of three canvases of at most 6 steps."""
    from ..sampler import Done

    C = engine.config.canvas_length
    for ev in engine.events(PROMPTS, raw=True, seed=5, max_new_tokens=3 * C, max_denoising_steps=6):
        if isinstance(ev, Done):
            return ev.token_ids, ev.steps_per_canvas, ev.stats
    raise RuntimeError("the generation ended without its last event")


def cuda_checks(device, cards: int, progress: Callable[[str], None] | None = None) -> list[Check]:
    """Each check above on `device` (cards: how many CUDA cards the machine has); a check that raises is a failure
    with its first line, never a crash of the doctor."""
    out = []
    for name, what in CUDA_ONLY:
        if progress is not None:
            progress(what)
        if device.type != "cuda" and name in ("cuda_graph", "pinned_h2d"):
            out.append(Check(name, what, "not run", "needs a CUDA card"))
            continue
        if name == "two_cards" and device.type == "cuda" and cards < 2:
            out.append(Check(name, what, "not run", "one card"))
            continue
        t0 = time.perf_counter()
        try:
            # on the CPU the kernels' interpreter would make these minutes: the torch path, the machinery is the check
            with environment({"DGEMMA_KERNELS": "torch"} if device.type != "cuda" else {}):
                status, detail = CHECKS[name](device)
        except Exception as e:  # noqa: BLE001: whatever breaks is the check's finding
            first = (str(e).strip().splitlines() or [""])[0][:160]
            status, detail = "fail", f"raised {type(e).__name__}: {first}"
        out.append(Check(name, what, status, detail, None, time.perf_counter() - t0))
    return out


def _graph(device) -> tuple[str, str]:
    from ..engine import load

    runs = {}
    for side, eager in (("eager", "1"), ("graphed", None)):
        with environment({"DGEMMA_EAGER": eager}):
            runs[side] = generation(load("demo", device=str(device)))
    (a_ids, a_steps, _), (b_ids, b_steps, stats) = runs["eager"], runs["graphed"]
    replays = stats.get("graph_replays", 0)
    if not replays:
        return "fail", f"no CUDA graph was replayed ({stats.get('graph_fallback') or 'no reason given'})"
    if (a_ids, a_steps) != (b_ids, b_steps):
        return "fail", f"the replayed steps gave other tokens than the eager ones ({replays} replays)"
    return "pass", f"{replays} replays, the eager run's tokens"


def _copy_stream(device) -> tuple[str, str]:
    from ..checkpoint.names import DEMO_MODEL
    from ..config import ModelConfig
    from ..engine import load
    from ..placement.plan import streaming_memory

    memory = streaming_memory(ModelConfig.from_dir(DEMO_MODEL), "bf16")
    resident = load("demo", device=str(device))
    streamed = load("demo", device=str(device), gpu_memory=memory)
    layers = streamed.model.placement.streamed
    if not layers or not streamed.model.expert_streams:
        return "fail", f"nothing streamed at {memory / 1e6:.1f} MB of card memory"
    stream = streamed.model.expert_streams[0]
    before = stream.copies
    got, want = generation(streamed)[0], generation(resident)[0]
    copies = stream.copies - before
    if got != want:
        return "fail", f"{len(layers)} layers streamed gave other tokens than the resident model"
    if copies < len(layers):
        return "fail", f"{copies} copies for {len(layers)} streamed layers: the streamed weights were not read"
    emulated = "" if device.type == "cuda" else " (the CPU's copier: no CUDA stream)"
    return "pass", f"{len(layers)} layers' experts streamed, {copies} copies, the resident tokens{emulated}"


def _two_cards(device) -> tuple[str, str]:
    from ..checkpoint.names import DEMO_MODEL
    from ..config import ModelConfig
    from ..engine import load
    from ..placement.plan import largest_memory, planned_context

    cfg = ModelConfig.from_dir(DEMO_MODEL)
    memory = largest_memory(cfg, "bf16", lambda p: len(p.cards) == 2 and not any(c.streamed for c in p.cards),
                            context=planned_context(cfg), cards=2)
    pair = "cuda:0,cuda:1" if device.type == "cuda" else "cpu,cpu"
    one = load("demo", device=str(device))
    split = load("demo", devices=pair, gpu_memory=memory)
    cards = split.model.placement.cards
    if len(cards) != 2 or not all(c.layers for c in cards):
        return "fail", f"the plan did not split the layers over two cards at {memory / 1e6:.1f} MB each"
    if generation(split)[0] != generation(one)[0]:
        return "fail", "the split gave other tokens than one card"
    said = f"layers {len(cards[0].layers)} + {len(cards[1].layers)}, one card's tokens"
    return "pass", said + ("" if device.type == "cuda" else " (the CPU standing in for both cards)")


def _pinned(device) -> tuple[str, str]:
    from ..bench import host_to_device_bandwidth

    return "pass", f"{host_to_device_bandwidth(device) / 1e9:.1f} GB/s"


CHECKS = {"cuda_graph": _graph, "copy_stream": _copy_stream, "two_cards": _two_cards, "pinned_h2d": _pinned}
