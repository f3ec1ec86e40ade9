"""`dgemma tune`: its flags, the memory it will need, its progress; the tuning itself is dgemma_cli/tuner."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import UsageError
from .options import (
    GPU_MEMORY_OPTION,
    MODEL_HELP,
    QUIET_OPTION,
    be_quiet,
    check_device_dtype,
    gb,
    gpu_memory_arg,
    model_arg,
    note,
)

HELD_OUT = 64  # --held-out's default (TuneSettings.held_out)
# Streamed experts share two layer buffers, so a layer's experts are in one only while that layer runs: the backward
# pass must recompute the layer (which copies them in again), not keep what its forward saved.
STREAMED_NEED_CHECKPOINTING = ("experts streamed from host memory (--gpu-memory, or a card too small) need "
                               "--gradient-checkpointing: it cannot be combined with --no-gradient-checkpointing")


def tune(
    data: str = typer.Argument(..., metavar="DATA.jsonl", help="Training examples, one JSON object per line: "
                               "{\"messages\": [...]}, {\"prompt\", \"completion\"} or "
                               "{\"prefix\", \"middle\", \"suffix\"}."),
    out: str = typer.Option(..., "--out", "-o", metavar="DIR", help="Where the adapter goes (PEFT's format); its "
                            "state in DIR/.tune lets a stopped run resume. A DIR that holds files but no stopped run "
                            "(another adapter) is refused, unless --restart."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    eval_file: Optional[str] = typer.Option(None, "--eval", metavar="FILE", help="Held-out examples (JSONL) for "
                                            "the held-out loss and exact-answer rate; default: --held-out of DATA."),
    rank: int = typer.Option(16, "--rank", help="LoRA rank of each adapted projection."),
    alpha: float = typer.Option(32.0, "--alpha", help="LoRA alpha (the delta is scaled by alpha / rank)."),
    targets: str = typer.Option("attention,mlp", "--targets", help="Projections to adapt: attention, mlp, "
                                "self_conditioning (comma-separated)."),
    expert_rank: int = typer.Option(0, "--expert-rank", help="Also adapt the routed experts at this rank "
                                    "(0: not)."),
    steps: int = typer.Option(1000, "--steps", help="Optimiser steps."),
    batch_size: int = typer.Option(16, "--batch-size", help="Examples per step."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (warm-up, then cosine decay)."),
    warmup: int = typer.Option(50, "--warmup", help="Steps of linear warm-up."),
    seed: int = typer.Option(0, "--seed", help="Seed of everything random: a run is repeatable."),
    held_out: Optional[int] = typer.Option(None, "--held-out", show_default=False,
                                           help="Examples of DATA kept apart (default 64; a fifth of DATA at most); "
                                           "not with --eval, whose examples are the held-out ones."),
    eval_every: int = typer.Option(100, "--eval-every", help="Steps between held-out evaluations."),
    eval_examples: int = typer.Option(32, "--eval-examples", help="Held-out answers generated at each "
                                      "evaluation for the exact-answer rate."),
    eval_steps: Optional[int] = typer.Option(None, "--eval-steps", help="Denoising steps per canvas for those "
                                             "answers (default: the model's)."),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", help="Steps between saved states."),
    raw: bool = typer.Option(False, "--raw", help="Prompts of prompt/completion lines as raw text (no chat "
                             "template)."),
    restart: bool = typer.Option(False, "--restart", help="Start over even if DIR holds a stopped run's state, "
                                 "and write the adapter into a DIR that holds other files (over any adapter there)."),
    checkpointing: bool = typer.Option(True, "--gradient-checkpointing/--no-gradient-checkpointing",
                                       help="Recompute each layer's feed-forward stage in the backward pass instead "
                                       "of keeping it (less memory, about a third more compute; the same adapter)."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    gpu_memory: Optional[str] = GPU_MEMORY_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Tune a LoRA adapter with the model's own objective (noised canvases, self-conditioning) on a frozen base.

    Prints the memory it needs before it starts, the training loss as it goes, and the held-out loss and
    exact-answer rate every --eval-every steps. Ctrl-C or a crash loses at most --checkpoint-every steps: run the
    same command again to resume. The adapter runs with `dgemma run --adapter DIR` and loads in peft."""
    from pathlib import Path

    check_device_dtype(device, dtype)
    card_bytes = gpu_memory_arg(gpu_memory)
    if card_bytes is not None and not checkpointing:
        raise UsageError(STREAMED_NEED_CHECKPOINTING)
    if eval_file is not None and held_out is not None:
        raise UsageError(f"--held-out {held_out} and --eval exclude each other: with --eval FILE the held-out examples "
                         "are FILE's, and all of DATA trains")
    held_out = HELD_OUT if held_out is None else held_out
    kinds = tuple(t.strip() for t in targets.split(",") if t.strip())
    bad = [k for k in kinds if k not in ("attention", "mlp", "self_conditioning")]
    if bad or not kinds:
        raise UsageError(f"--targets takes attention, mlp and self_conditioning (got {targets!r})")
    for name, v, lo in (("--rank", rank, 1), ("--steps", steps, 1), ("--batch-size", batch_size, 1),
                        ("--eval-every", eval_every, 1), ("--checkpoint-every", checkpoint_every, 1),
                        ("--expert-rank", expert_rank, 0), ("--held-out", held_out, 0),
                        ("--eval-examples", eval_examples, 0), ("--warmup", warmup, 0)):
        if v < lo:
            raise UsageError(f"{name} must be at least {lo}")
    if not (lr > 0 and lr < 1) or not (alpha > 0 and alpha < 1e6):
        raise UsageError("--lr must be in (0, 1) and --alpha positive")
    if not Path(data).is_file():
        raise UsageError(f"{data}: no such file")
    out_dir = Path(out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out}: not a directory")
    from ..tuner.tune import others_in

    try:
        there = [] if restart else others_in(out_dir)
    except OSError as e:
        raise UsageError(f"--out {out}: cannot read it ({e.strerror or e})") from None
    if there:  # as quantize refuses an --out that exists: nothing there is written over unasked
        names = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        raise UsageError(f"--out {out} holds {names} and no stopped tune to resume: choose another --out, or "
                         "--restart to write the adapter there (over any adapter it holds)")
    be_quiet(quiet)
    model_dir = model_arg(model, quiet)
    from ..engine import load
    from ..tuner.tune import Tuner, TuneSettings, load_state, memory_estimate, read_examples

    # dtype auto: float32 on the CPU, bfloat16 on a GPU
    engine = load(model_dir, device=device, dtype=dtype, gpu_memory=card_bytes)
    if engine.tokenizer is None:
        raise UsageError(f"{model_dir}: no tokenizer.json, so the examples cannot be encoded")
    C = engine.config.canvas_length
    settings = TuneSettings(rank=rank, alpha=alpha, targets=kinds, expert_rank=expert_rank, steps=steps,
                            batch_size=batch_size, lr=lr, warmup=warmup, seed=seed, held_out=held_out,
                            eval_every=eval_every,
                            eval_examples=eval_examples, checkpoint_every=checkpoint_every, raw=raw,
                            max_denoising_steps=eval_steps)
    read = dict(raw=settings.raw, held_tokens=settings.held_tokens)
    examples = read_examples(Path(data), engine.tokenizer, C, **read)  # the whole file, before any training
    held = read_examples(Path(eval_file), engine.tokenizer, C, **read) if eval_file else None
    state = None if restart else load_state(out_dir)
    from ..tuner.lora import AdapterError

    try:
        tuner = Tuner(engine, examples, out_dir, settings, base_name=str(model or "demo"), held=held,
                      report=_tune_reporter(quiet))
    except AdapterError as e:
        raise UsageError(str(e)) from None
    if state is not None:
        tuner.restore(state)
        note(f"resuming {out_dir} at step {tuner.step} of {steps}")
    if engine.model.expert_streams and not checkpointing:
        raise UsageError(STREAMED_NEED_CHECKPOINTING)  # planned onto a card too small: experts stream
    engine.model.checkpointing = checkpointing
    if held is None and len(tuner.held) < held_out:  # split's cap: the rest must still train
        note(f"--held-out {held_out}: {len(tuner.held):,} of DATA's {len(examples):,} examples held out (a fifth of "
             "DATA at most)")
    longest = max(len(e.prompt) + len(e.answer) for e in examples)
    est = memory_estimate(engine.model, tuner.adapter, settings, longest, checkpointing)
    note(f"{len(tuner.train):,} training examples, {len(tuner.held):,} held out; adapter: "
          f"{est['parameters']:,} parameters; memory (estimate): base {gb(est['base'])}, adapter with AdamW "
          f"{gb(est['adapter'])}, activations up to {gb(est['activations'])}: {gb(est['total'])} in all")
    if engine.model.device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(engine.model.device)
        if est["total"] > free:
            note(f"that is more than the {gb(free)} free on the GPU: try a smaller --batch-size, shorter examples"
                  + (", or --gradient-checkpointing" if not checkpointing else ""))
    from ..errors import Interrupted

    try:
        tuner.run()
    except KeyboardInterrupt:
        kept = f"the state at step {tuner.saved} is kept" if tuner.saved else "no state was saved yet"
        # (with --restart and nothing saved yet, DIR still holds the state it started over from)
        again = "the same command without --restart" if restart and tuner.saved else "the same command again"
        raise Interrupted(f"interrupted; {kept}: run {again} to resume") from None
    note(f"adapter written to {out_dir} (run it: dgemma run --model {model or 'demo'} --adapter {out_dir} ...)")


def _tune_reporter(quiet: bool):
    """Progress for `dgemma tune`: a Rich bar on a terminal, a line per evaluation otherwise (stderr)."""
    bar = {}

    def report(kind: str, **kw) -> None:
        if quiet:
            return
        if kind == "start" and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            p = Progress(TextColumn("tune"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                         TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            p.start()
            bar["p"], bar["t"] = p, p.add_task("tune", total=kw["steps"], completed=kw["step"], loss="-")
        elif kind == "step" and "p" in bar:
            bar["p"].update(bar["t"], completed=kw["step"], loss=f"{kw['loss']:.3f}")
        elif kind == "end" and "p" in bar:
            bar.pop("p").stop()
        elif kind == "eval":
            ev = kw["evaluation"]
            held = "-" if ev.held_loss is None else f"{ev.held_loss:.3f}"
            exact = "-" if ev.exact is None else f"{100 * ev.exact:.0f}%"
            line = f"step {ev.step}: loss {ev.train_loss:.3f}, held-out loss {held}, exact answers {exact}"
            (bar["p"].console.print if "p" in bar else lambda m: sys.stderr.write(f"dgemma: {m}\n"))(line)

    return report
