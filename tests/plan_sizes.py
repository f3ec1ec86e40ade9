"""Card sizes for tests of placement: the largest size at which the planner's answer has a wanted property
(dgemma_cli/placement/plan.py largest_memory, planned as the CPU runs the plan: quantized experts unpacked a layer at a
time)."""

from __future__ import annotations

from dgemma_cli.placement.plan import largest_memory as card_size

__all__ = ["card_size"]
