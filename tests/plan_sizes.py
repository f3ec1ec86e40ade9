"""Card sizes for tests of placement: the largest size at which the planner's answer has a wanted property."""

from __future__ import annotations

from typing import Callable

from dgemma_cli.placement.cards import Card
from dgemma_cli.placement.plan import Plan, plan


def card_size(cfg, fmt: str, wanted: Callable[[Plan], bool], *, context: int, cards: int = 1, batch: int = 1,
              policy: str | None = None) -> int:
    """The largest memory (searched down from a card that holds everything, a quarter of a layer's experts at a time)
    at which `cards` cards of it, planned as the CPU runs the plan (quantized experts unpacked a layer at a time),
    give a plan that fits and satisfies `wanted`."""
    kw = dict(context=context, batch=batch, policy=policy, fused_experts=False)
    size = plan(cfg, fmt, [Card("any", 10**15, 0.0, 4, 16)], **kw).resident_bytes
    while size > 0:
        p = plan(cfg, fmt, [Card("card", size, 0.0, 4, 16)] * cards, **kw)
        if p.fits and wanted(p):
            return size
        size -= max(1, p.expert_bytes // 4)
    raise AssertionError("no card size gives such a plan")
