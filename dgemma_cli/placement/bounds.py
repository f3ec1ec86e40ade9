"""A placement's step, bounded: the whole-step trace's per-layer bounds on each card (step_tables.json, which `make
kernel-report` writes: every kernel of a real-shape step compiled for the card's compute capability and bounded
with the card's figures, grouped by layer) combined with the copies the plan makes over the host links.

Streamed experts as placement/streaming.py runs them on a GPU: copies on a stream of their own, one layer buffer
filled while the other is read. A copy may start when the copy before it is done and the buffer it fills is free
again (the streamed layer before it in that buffer has run); a streamed layer starts when the layer before it is
done and its copy has landed. The next step's first two streamed layers are copied while this step's last layers,
head and sampler run, and land before the step ends (its end joins the copy stream: a CUDA graph leaves no copy
behind). The bound is the steady step (the third of three in a row). With copies that wait for their layer (the
CPU's path, and a GPU's whose first-use check failed), each copy adds its whole time. Layers split over cards add the
hidden state's copy across each boundary and back to the first card for the head. Bounds, not measurements: a card
runs no faster than this.
"""

from __future__ import annotations

import json
from pathlib import Path

from .plan import Plan, buffer_order

TABLES = Path(__file__).resolve().parent / "step_tables.json"
STEPS_PER_CANVAS = 12  # the published checkpoint's typical steps a canvas (the seed figure, not measured here)


def load_tables(path: Path = TABLES) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def table_format(fmt: str, policy: str) -> str | None:
    """The step tables' name for a format and policy (step_trace.FORMATS); None: no table costs it. "all" quantizes
    attention and the dense MLP too; NVFP4 "experts" is NVIDIA's published release as it is."""
    if policy == "all":
        return {"nvfp4": "nvfp4", "int8": "w8a8-int8", "fp8": "w8a8-fp8"}.get(fmt)
    return "nvfp4-experts" if (fmt, policy) == ("nvfp4", "experts") else None


def card_layers(tables: dict, card: str, fmt: str, batch: int, policy: str = "all") -> dict | None:
    """The table's entry for a card, format, batch and policy: pre_ms, layer_ms [L], post_ms, kernels (None: not
    there)."""
    name = table_format(fmt, policy)
    return None if name is None else tables.get("cards", {}).get(card, {}).get(name, {}).get(str(batch))


class Timeline:
    """The compute stream and the copy stream of one card, step after step, as placement/streaming.py schedules them:
    `run` adds layers; when a streamed layer has run, the copy of the layer its buffer takes next (plan.buffer_order)
    is queued on the copy stream, which runs copies one after another; a streamed layer starts once the layer before
    it is done and its copy has landed. The last copies of a step fill the buffers for the next one, and `join` (at
    the step's end) waits for them. overlap=False: each copy waits for its layer and delays it by its whole time."""

    def __init__(self, copy_ms: float, overlap: bool = True):
        self.copy_ms, self.overlap = copy_ms, overlap
        self.t = 0.0  # the compute stream
        self.copy_end = 0.0  # the copy stream
        self.ready: dict[int, float] = {}  # streamed layer -> when its copy, made ahead, lands
        self.issued: list[int] = []  # the layers copied ahead, in the copy stream's order

    def _copy(self, layer: int, at: float) -> None:
        self.issued.append(layer)
        self.copy_end = max(self.copy_end, at) + self.copy_ms
        self.ready[layer] = self.copy_end

    def run(self, layer_ms: list[float], layers: list[int], streamed: list[int]) -> None:
        buffer_of, after = buffer_order(streamed)
        if self.overlap:  # a pass starts with s0 and s1 in their buffers (copied by the step before, or now)
            for first in sorted(streamed)[:2]:
                if first not in self.ready:
                    self._copy(first, self.t)
        for i in layers:
            if i not in buffer_of:
                self.t += layer_ms[i]
            elif not self.overlap:
                self.t += self.copy_ms + layer_ms[i]
            else:
                self.t = max(self.t, self.ready.pop(i)) + layer_ms[i]
                if after[i] != i:  # its buffer is free: the next layer that uses it is copied in
                    self._copy(after[i], self.t)
                else:  # a buffer of its own: it stays there
                    self.ready[i] = self.t

    def join(self) -> None:
        """The step's end waits for the copies still in flight (a captured step leaves none behind)."""
        self.t = max(self.t, self.copy_end)


def no_bound(note: str) -> dict:
    """step_bounds' answer where no bound can be given: every figure None, `bound_note` says why."""
    return {"step_bound_ms": None, "serial_copy_step_bound_ms": None, "resident_step_bound_ms": None,
            "canvas_tokens_per_s": None, "steps_per_canvas": STEPS_PER_CANVAS, "bound_note": note}


def step_bounds(p: Plan, tables: dict | None = None) -> dict:
    """{step_bound_ms, serial_copy_step_bound_ms, resident_step_bound_ms, canvas_tokens_per_s, bound_note}: the
    plan's step with copies overlapped as planned, with copies that wait (the fallback), and on the same card had it
    room for everything; None where a card has no table (bound_note says which)."""
    tables = load_tables() if tables is None else tables
    if tables is None:
        return no_bound("no step tables in this install (make kernel-report writes them)")
    if p.context != tables.get("context", p.context):
        return no_bound(f"the step tables are for an {tables['context']:,}-token context")
    if table_format(p.fmt, p.policy) is None:
        return no_bound(f"no step table costs {p.fmt} with policy {p.policy} (tables: NVFP4, INT8 and FP8 with "
                        "--policy all, and NVFP4 experts as published)")
    rows = [card_layers(tables, c.card.name, p.fmt, p.batch, p.policy) for c in p.cards]
    missing = sorted({c.card.name for c, r in zip(p.cards, rows) if r is None})
    if missing:
        have = ", ".join(sorted(tables.get("cards", {})))
        return no_bound(f"no step table for {', '.join(missing)} in {p.fmt} ({p.policy}) at batch {p.batch} "
                        f"(tables: {have}; batch 1 and 4)")
    canvas = tables.get("canvas", 256)
    hidden = tables.get("hidden", 2816)
    boundary_bytes = p.batch * canvas * hidden * 2  # the hidden state, bf16, across a split

    def bound(overlap: bool, streaming: bool = True, steps: int = 3) -> float:
        """The steady step: `steps` steps one after another, the last one's time (the first step's first copies wait
        for nothing to hide behind; later steps' are made while the step before ends)."""
        lines = [Timeline(p.expert_bytes / (c.card.copy_gb_per_s * 1e9) * 1e3, overlap) for c in p.cards]
        ends = []
        t = 0.0
        for _ in range(steps):
            t += rows[0]["pre_ms"]
            for k, (c, row, line) in enumerate(zip(p.cards, rows, lines)):
                if k:  # crossing into this card
                    t += boundary_bytes / (c.card.copy_gb_per_s * 1e9) * 1e3
                line.t = t
                line.run(row["layer_ms"], c.layers, c.streamed if streaming else [])
                t = line.t
            if len(p.cards) > 1:  # back to the first card, for the head
                t += boundary_bytes / (min(c.card.copy_gb_per_s for c in p.cards) * 1e9) * 1e3
            t += rows[0]["post_ms"]
            for line in lines:  # the copies for the next step land before this one ends (joined at its end)
                line.t = t
                line.join()
                t = line.t
            ends.append(t)
        return ends[-1] - ends[-2] if steps > 1 else ends[-1]

    planned = bound(True)
    return {"step_bound_ms": round(planned, 3), "serial_copy_step_bound_ms": round(bound(False), 3),
            "resident_step_bound_ms": round(bound(True, streaming=False), 3),
            "canvas_tokens_per_s": round(p.batch * canvas / (STEPS_PER_CANVAS * planned / 1e3), 1),
            "steps_per_canvas": STEPS_PER_CANVAS, "bound_note": None}
