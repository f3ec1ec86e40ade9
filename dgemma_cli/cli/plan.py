"""`dgemma plan`: what lives where on the named cards (dgemma_cli/placement), without loading anything."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from ..errors import ModelError, UsageError
from .options import QUIET_OPTION, be_quiet, gb, model_arg


def plan(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="A store name or model directory (its config "
                                        "and format; no weights are read). Default: the published 26B-A4B."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", metavar="CARD|SIZE", help="A card by name (\"RTX 4080\", "
                                            "\"RTX 4060\", \"H100\"...) or a size (16GB); once per card. Default: "
                                            "this machine's first CUDA device."),
    quant: str = typer.Option("auto", "--quant", help="auto (the least lossy format that fits without streaming, "
                              "else nvfp4), bf16, fp8, int8 or nvfp4; a quantized --model keeps its own."),
    context: int = typer.Option(8192, "--context", help="Tokens of context the KV cache is planned for."),
    batch: int = typer.Option(1, "--batch", help="Rows generated together."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Plan a model onto cards: which layers' experts stay on the card and which stream from host memory, and what
    each card and the host must hold. Exit status 1 when it does not fit (said in one line)."""
    be_quiet(quiet)
    from ..checkpoint.names import QUANTS
    from ..config import DIFFUSIONGEMMA_26B_A4B, ModelConfig
    from ..placement.cards import card
    from ..placement.plan import choose
    from ..placement.plan import plan as make_plan

    if quant not in QUANTS + ("auto",):
        raise UsageError(f"--quant must be auto, {', '.join(QUANTS)} (got {quant!r})")
    if context < 1 or batch < 1:
        raise UsageError("--context and --batch must be at least 1")
    cards = [card(g) for g in gpu or []]
    if model is None:
        cfg, published = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B), None
    else:
        from ..checkpoint.names import resolve_model
        from ..checkpoint.weights import read_quant_format

        path = resolve_model(model_arg(model))
        cfg = ModelConfig.from_dir(path)
        published = read_quant_format(path, cfg.raw)
    if published is not None and quant not in ("auto", published):
        raise UsageError(f"{model} is stored in {published}; plan it as it is (--quant auto or {published})")
    if context > cfg.text.max_position_embeddings:
        raise UsageError(f"--context {context}: the model's context is {cfg.text.max_position_embeddings:,} tokens")
    if not cards:
        cards = [_local_card()]
    from ..checkpoint.footprint import system_free

    fmt = published or (choose(cfg, cards, context, batch) if quant == "auto" else quant)
    p = make_plan(cfg, fmt, cards, context=context, batch=batch, host_free=system_free() or None)
    if as_json:
        sys.stdout.write(json.dumps(p.as_dict()) + "\n")
    else:
        _table(p)
    if not p.fits:
        if as_json:
            raise typer.Exit(1)
        raise ModelError(p.refusal)


def _local_card():
    """This machine's first CUDA device, as the planner sees it."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError("no CUDA device here: name the card(s) to plan for with --gpu (a name, or a size: 16GB)")
    from ..placement.cards import card_of_device

    return card_of_device(torch.device("cuda", 0))


def _table(p) -> None:
    out = sys.stdout.write
    out(f"format {p.fmt} ({p.policy}), context {p.context:,}, batch {p.batch}: "
        + ("fits\n" if p.fits else "does not fit\n"))
    for c in p.cards:
        streamed = f"{len(c.streamed)} streamed ({', '.join(map(str, c.streamed))})" if c.streamed else "none streamed"
        out(f"  {c.card.name:<18} {gb(c.card.memory):>9}  layers {c.layers[0]}-{c.layers[-1]}: {streamed}; holds "
            f"{gb(c.resident_bytes)}" + (f" (two layer buffers {gb(c.buffer_bytes)})" if c.buffer_bytes else "")
            + f"; host link {c.card.link_gb_per_s:.1f} GB/s\n")
    if p.streamed:
        out(f"  host memory (pinned): {gb(p.host_bytes)}; copied per step: {gb(p.streamed_bytes_per_step)}\n")
