"""What the commands share: the options that several take, their checks (all before torch is imported),
the model argument, and the stderr notices -q silences."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

import typer

from ..errors import DgemmaError, UsageError

MODEL_HELP = ("A model directory, a store name [OWNER/]NAME[:QUANT] (see `dgemma list`), or 'demo' for the "
              "bundled demo model. Defaults to $DGEMMA_MODEL, then 'demo'.")


def sampler_option(flag: str):
    """The Typer option for one of the sampler's settings (config.SAMPLER_FLAGS); None keeps the model's value."""
    from ..config import SAMPLER_FLAGS

    return typer.Option(None, f"--{flag}", help=SAMPLER_FLAGS[flag][2], show_default=False)


_quiet = False  # -q: nothing on stderr but errors (set by each command)

QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors: no progress, no notices.")
COMPILE_TIMEOUT_OPTION = typer.Option(
    30.0, "--compile-timeout", metavar="SECONDS", help="The most time a --json-schema, --regex or --grammar (or a "
    "request's structure) may take to compile, in a process of its own; past it, refused.")
COMPILE_MEMORY_OPTION = typer.Option(
    4.0, "--compile-memory", metavar="GB", help="The most memory that compile may use; past it, refused.")


def compile_budget(seconds: float, gigabytes: float) -> tuple[float, int]:
    """--compile-timeout and --compile-memory, checked (before torch is imported) -> (seconds, bytes)."""
    if not 0 < seconds <= 3600:  # NaN too
        raise UsageError(f"--compile-timeout must be between 0 and 3600 seconds (got {seconds:g})")
    if not 0.1 <= gigabytes <= 1024:
        raise UsageError(f"--compile-memory must be between 0.1 and 1024 GB (got {gigabytes:g})")
    return seconds, int(gigabytes * (1 << 30))

TEMPERATURE_OPTION = typer.Option(
    None, "--temperature", "--temp", show_default=False,
    help="Scale the model's temperature schedule (--t-max to --t-min) by this: 1 keeps it, 0 is greedy (each draw "
    "the most likely token), up to 2. Not with --t-max / --t-min.")


def sampler_settings(**given) -> dict:
    """Flag values -> GenerationSettings overrides, the flags that were not given left out (so the model's own
    values stay). Each value is range-checked here, before the model loads; combinations (--t-min above the
    model's --t-max) are checked when the settings are applied."""
    from ..config import GenerationSettings

    out = {k: v for k, v in given.items() if v is not None}
    GenerationSettings().override(**out)  # a schedule end given alone moves the other as it will over the model's
    return out


def read_prompt(prompt: Optional[str]) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: pass PROMPT, or pipe text on stdin")
    return sys.stdin.read()


def prompt_words(words: Optional[List[str]]) -> Optional[str]:
    """PROMPT as typed: several words are one prompt, joined by spaces (`dgemma run why is the sky blue`, as in
    ollama and llm); None (read stdin) when absent or '-'."""
    if not words or list(words) == ["-"]:
        return None
    return " ".join(words)


def check_device_dtype(device: str, dtype: str) -> None:
    """What engine.load checks too, checked before torch is imported so that a typo fails at once."""
    from ..device import check_device_name, check_dtype_name

    check_device_name(device)
    check_dtype_name(dtype)


GPU_MEMORY_OPTION = typer.Option(
    None, "--gpu-memory", metavar="SIZE", help="The card memory to plan for (16GB, 12.5GiB, 8000MB): routed experts "
    "that do not fit stay in host memory and stream to the card layer by layer (`dgemma plan` shows the plan). "
    "Default: the card's free memory. On the CPU, the same plan runs as on a card of that size.")


DEVICES_OPTION = typer.Option(
    None, "--devices", metavar="LIST", help="The cards to split the layers over when one cannot hold the model: 0,1 "
    "or auto (every CUDA device); each card's share streams what does not fit there. `dgemma plan --gpu A --gpu B` "
    "shows the split.")


def devices_arg(value: Optional[str]):
    """--devices, checked before torch is imported -> "auto", the device names, or None (not given)."""
    if value is None:
        return None
    from ..device import parse_devices

    return parse_devices(value)


def gpu_memory_arg(value: Optional[str]) -> Optional[int]:
    """--gpu-memory, checked before torch is imported -> bytes (None: not given)."""
    if value is None:
        return None
    from ..placement.cards import parse_size

    return parse_size(value)


ADAPTER_OPTION = typer.Option(
    None, "--adapter", metavar="DIR[:SCALE]", help="A LoRA adapter in PEFT's format (a directory, or a bundled or "
    "stored adapter's name), applied unmerged to any base format; :SCALE weighs it (default 1). Repeat to add "
    "several.")


def adapter_args(args: Optional[List[str]]) -> list:
    """--adapter values -> [(directory, scale)], each checked before torch is imported."""
    from ..checkpoint.names import resolve_adapter

    return [resolve_adapter(a) for a in args or []]


def model_arg(model: Optional[str], quiet: bool = False) -> str:
    """--model, else $DGEMMA_MODEL (an error then names the variable), else the bundled demo model (said on stderr
    unless quiet). Resolved and checked here, before anything imports torch: a missing model is said at once."""
    from ..checkpoint.names import resolve_model
    from ..errors import ModelError

    where = ""
    if not model and os.environ.get("DGEMMA_MODEL"):
        model, where = os.environ["DGEMMA_MODEL"], "$DGEMMA_MODEL: "
    if not model:
        if not quiet:
            sys.stderr.write("dgemma: using the bundled demo model, which only upper-cases 16-character text "
                             "(try \"upper: hello diffusions\"); pass --model NAME or DIR for a real model\n")
        return "demo"
    try:
        path = resolve_model(model)
    except DgemmaError as e:
        raise type(e)(f"{where}{e}") from None
    from ..checkpoint.stored import is_gguf

    gguf = is_gguf(path)  # llama.cpp's format, one file (or a split file's first part)
    if not path.exists():
        raise ModelError(f"{where}{path}: no such {'file' if gguf else 'model directory'}")
    if not path.is_dir() and not gguf:
        raise ModelError(f"{where}{path}: not a directory (a model is a directory, or a .gguf file)")
    return model




def be_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet
    if quiet:
        import warnings

        warnings.simplefilter("ignore")  # a library's warning is a notice too


def note(message: str) -> None:
    if not _quiet:
        sys.stderr.write(f"dgemma: {message}\n")


def note_placement(engine) -> None:
    """Say on stderr (unless quiet) when the loaded model streams experts or splits its layers (engine.load's plan)."""
    from ..placement.plan import loaded_summary

    said = loaded_summary(engine.model)
    if said:
        note(said)
    if getattr(engine.model, "kernel_note", None):  # the kernels checked on a card met for the first time
        note(engine.model.kernel_note)
    if getattr(engine.model, "tokenizer_note", None):  # a GGUF read with its own tokenizer
        note(engine.model.tokenizer_note)


def gb(n: int) -> str:
    """Bytes in decimal units (1 GB = 1e9 bytes)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def fail(message: str, code: int) -> None:
    """The one line an error gets on stderr, and the exit status."""
    sys.stderr.write(f"dgemma: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)
