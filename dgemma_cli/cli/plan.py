"""`dgemma plan`: what lives where on the named cards (dgemma_cli/placement), without loading anything."""

from __future__ import annotations

import json
import sys
from typing import List, Optional

import typer

from ..errors import ModelError, UsageError
from .options import QUIET_OPTION, be_quiet, gb, model_arg, note


def plan(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="A store name or model directory (its config "
                                        "and format; no weights are read). Default: the published 26B-A4B."),
    gpu: Optional[List[str]] = typer.Option(None, "--gpu", metavar="CARD|SIZE", help="A card by name (\"RTX 4080\", "
                                            "\"RTX 4060\", \"H100\"...) or a size (16GB); once per card. Default: "
                                            "this machine's first NVIDIA card."),
    quant: str = typer.Option("auto", "--quant", help="auto (a --model's own format, as `dgemma run` runs it; "
                              "else the least lossy format that fits without streaming, else nvfp4), bf16, fp8, int8 "
                              "or nvfp4; a quantized --model keeps its own."),
    policy: Optional[str] = typer.Option(None, "--policy", help="What fp8/int8/nvfp4 quantize: experts or all (+ "
                                         "attention, dense MLP); default as published: all for fp8/int8, experts "
                                         "for nvfp4. The step's bound is tabled for all, and for nvfp4 experts."),
    context: Optional[int] = typer.Option(None, "--context", help="Tokens of context the KV cache is planned for "
                                          "(default 8192, or the model's context if shorter).", show_default=False),
    batch: int = typer.Option(1, "--batch", help="Rows generated together."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Plan a model onto cards: which layers' experts stay on the card and which stream from host memory, and what
    each card and the host must hold. Exit status 1 when it does not fit (said in one line)."""
    be_quiet(quiet)
    from ..checkpoint.footprint import DEFAULT_POLICY
    from ..checkpoint.names import QUANTS
    from ..config import DIFFUSIONGEMMA_26B_A4B, ModelConfig
    from ..placement.cards import card
    from ..placement.plan import choose
    from ..placement.plan import plan as make_plan
    from ..placement.plan import planned_context

    if quant not in QUANTS + ("auto",):
        raise UsageError(f"--quant must be auto, {', '.join(QUANTS)} (got {quant!r})")
    if policy is not None and policy not in ("experts", "all"):
        raise UsageError(f"--policy must be experts or all (got {policy!r})")
    if (context is not None and context < 1) or batch < 1:
        raise UsageError("--context and --batch must be at least 1")
    cards = [card(g) for g in gpu or []]
    stored = stored_policy = None  # a --model's own format and policy: what `dgemma run` runs (engine.load's plan)
    gguf = None  # a GGUF --model: its blocks' bytes by type, said beside the plan
    if model is None:
        cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    else:
        from ..checkpoint.names import resolve_model
        from ..checkpoint.weights import stored_model

        path = resolve_model(model_arg(model))
        cfg, stored, stored_policy = stored_model(path)
        from ..checkpoint.stored import is_gguf

        if is_gguf(path):
            if quant != "auto" or policy is not None:
                raise UsageError(f"{path.name} runs as it is (its own block types): plan it with no --quant or "
                                 "--policy")
            from ..store.models import describe_gguf

            d = describe_gguf(path)
            gguf = {"file": path.name, "bytes_by_type": d["bytes_by_type"], "weights_on_disk": d["weights_on_disk"],
                    "weights_in_memory": d["weights_in_memory"], "footprint": d["footprint"], "note": GGUF_NOTE}
    published = stored if stored != "bf16" else None
    if published is not None and quant not in ("auto", published):
        raise UsageError(f"{model} is stored in {published}; plan it as it is (--quant auto or {published})")
    if published is not None and policy not in (None, stored_policy):
        raise UsageError(f"{model} is stored with --policy {stored_policy}; plan it as it is (no --policy, or "
                         f"--policy {stored_policy})")
    if policy is not None and (quant == "bf16" or quant == "auto" and stored == "bf16"):
        raise UsageError(f"--policy {policy} is for fp8, int8 and nvfp4: bf16 quantizes nothing"
                         + (f" ({model} is stored in bf16; --quant plans a quantized copy)" if quant == "auto" else ""))
    context = context or planned_context(cfg)
    if context > cfg.text.max_position_embeddings:
        raise UsageError(f"--context {context}: the model's context is {cfg.text.max_position_embeddings:,} tokens")
    if not cards:
        cards = [_local_card()]
    from ..checkpoint.footprint import system_free

    fmt = quant if quant != "auto" else stored or choose(cfg, cards, context, batch)
    if fmt == "bf16" and policy is not None:  # --quant auto took bf16
        note(f"--policy {policy} does not apply: --quant auto took bf16, which quantizes nothing")
        policy = None
    if published is not None:  # what the checkpoint quantizes, as stored
        policy = stored_policy
    remedies = ["a shorter --context"] + (["a smaller --batch"] if batch > 1 else [])
    if published is None and fmt != "nvfp4":
        remedies.append("a smaller --quant")
    elif published is None and (policy or DEFAULT_POLICY[fmt]) == "experts":
        remedies.append("--policy all")
    if gguf:
        remedies = [r for r in remedies if "--quant" not in r and "--policy" not in r]
    p = make_plan(cfg, fmt, cards, context=context, batch=batch, policy=policy, host_free=system_free() or None,
                  remedies=remedies + ["a larger --gpu", "another --gpu"],
                  footprint=gguf["footprint"] if gguf else None)
    from ..placement.bounds import no_bound, step_bounds

    # the tables hold the published 26B-A4B's layers: another model's shapes get no bound
    bounds = step_bounds(p) if model is None else no_bound("the step tables are for the published 26B-A4B")
    if as_json:
        sys.stdout.write(json.dumps({**p.as_dict(), **bounds, **({"gguf": gguf} if gguf else {})}) + "\n")
    else:
        if gguf:
            sys.stdout.write(f"{gguf['file']}: {gb(gguf['weights_on_disk'])} of GGUF blocks, "
                             f"{gb(gguf['weights_in_memory'])} in memory; {GGUF_NOTE}\n")
        _table(p, bounds)
    if not p.fits:
        if as_json:
            raise typer.Exit(1)
        raise ModelError(p.refusal)


GGUF_NOTE = ("the routed experts and the attention and MLP projections are held as the file's blocks, the rest "
             "(the embedding the head reads, norms, the router) decoded to 16 bits; where Triton runs the experts' "
             "kernels read the blocks in their tiles, elsewhere a layer's experts are decoded at a time (counted)")


def _local_card():
    """This machine's first NVIDIA card (nvidia-smi's), as the planner sees it."""
    from ..placement.cards import local_cards

    found = local_cards()
    if not found:
        raise UsageError("no NVIDIA card found here (nvidia-smi): name the card(s) to plan for with --gpu (a name, "
                         "or a size: 16GB)")
    return found[0]


def _table(p, bounds: dict) -> None:
    out = sys.stdout.write
    out(f"format {p.fmt} ({p.policy}), context {p.context:,}, batch {p.batch}: "
        + ("fits\n" if p.fits else "does not fit\n"))
    for c in p.cards:
        streamed = f"{len(c.streamed)} streamed ({', '.join(map(str, c.streamed))})" if c.streamed else "none streamed"
        layers = f"layers {c.layers[0]}-{c.layers[-1]}" if c.layers else "no layers"
        out(f"  {c.card.name:<18} {gb(c.card.memory):>9}  {layers}: {streamed}; holds "
            f"{gb(c.resident_bytes)}" + (f" (two layer buffers {gb(c.buffer_bytes)})" if c.buffer_bytes else "")
            + f"; host link {c.card.link_gb_per_s:.1f} GB/s\n")
    if p.streamed:
        out(f"  host memory (pinned): {gb(p.host_bytes)}; copied per step: {gb(p.streamed_bytes_per_step)}\n")
    if p.fits and len(p.cards) > 1:
        out(f"  run it with --devices {','.join(map(str, range(len(p.cards))))} (the cards in this order)\n")
    if bounds["step_bound_ms"] is not None:
        out(f"  step bound: {bounds['step_bound_ms']:.1f} ms as planned (copies overlapped), "
            f"{bounds['serial_copy_step_bound_ms']:.1f} ms with copies that wait for their layer (the fallback), "
            f"{bounds['resident_step_bound_ms']:.1f} ms were everything on the card; "
            f"{bounds['canvas_tokens_per_s']:.0f} canvas tokens/s at {bounds['steps_per_canvas']} steps a canvas "
            "(bounds, not measurements)\n")
    else:
        out(f"  step bound: not computed ({bounds['bound_note']})\n")
