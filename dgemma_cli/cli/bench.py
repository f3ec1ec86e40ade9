"""`dgemma bench`: the command; the measurement is dgemma_cli/bench.py."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from .options import GPU_MEMORY_OPTION, QUIET_OPTION, be_quiet, gpu_memory_arg, note


def bench(
    config: str = typer.Option("mid", "--config", help="real (26B-A4B shapes), mid, tiny, a bundled model (demo, "
                               "...), a store name or a model directory: its shapes, random weights."),
    fmt: str = typer.Option("nvfp4", "--format", help="bf16, int8 or nvfp4 (random weights in that format)."),
    policy: str = typer.Option("experts", "--policy", help="What int8/nvfp4 cover: experts or all."),
    batch: int = typer.Option(1, "--batch", help="Rows generated together."),
    prompt: int = typer.Option(512, "--prompt", help="Prompt tokens per row."),
    steps: int = typer.Option(16, "--steps", help="Denoising steps per canvas (fixed; at least 5, so that the "
                              "median has enough intervals)."),
    canvases: int = typer.Option(1, "--canvases", help="Canvases per row."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    compare: Optional[str] = typer.Option(None, "--compare", help="'transformers': also time the reference (its "
                                          "compiled static-cache path where it has one); 'transformers-eager'."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    gpu_memory: Optional[str] = GPU_MEMORY_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Time the denoise step on random weights (no download) against the weight-read floor. Each phase is said on
    stderr when it is a terminal (stdout keeps only the table or the JSON object)."""
    be_quiet(quiet)
    card_bytes = gpu_memory_arg(gpu_memory)
    from ..bench import as_dict, run_bench

    def phase(message: str) -> None:
        note(f"bench: {message}")
        sys.stderr.flush()

    result = run_bench(config, fmt, policy, batch, prompt, steps, canvases, device, dtype, compare,
                       note=phase if sys.stderr.isatty() and not quiet else None, gpu_memory=card_bytes)
    sys.stdout.write((json.dumps(as_dict(result)) if as_json else result.table()) + "\n")
