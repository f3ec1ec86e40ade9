"""`dgemma doctor`: the machine, and every Triton kernel family checked against the torch path on this card
(dgemma_cli/doctor); a family that disagrees is turned off for the card and the torch path runs in its place."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from .options import QUIET_OPTION, be_quiet, devices_arg, model_arg, note


def doctor(
    quick: bool = typer.Option(False, "--quick", help="Only the families every model uses (norms, router, head, "
                               "softcap, GELU, the expert plan); with --model, that model's."),
    json_out: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Also write the report as JSON to "
                                            "FILE ('-': stdout, and the table goes to stderr): no paths, prompts or "
                                            "user data, ready to attach to an issue."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Only the families this model uses (its "
                                        "format's, and the common ones), as run, chat and serve check a card the "
                                        "first time they meet it."),
    devices: Optional[str] = typer.Option(None, "--devices", help="The cards to list and check, as for run "
                                          "(cuda:0,cuda:1); the first is checked."),
    sizes: Optional[str] = typer.Option(None, "--sizes", metavar="CONFIG", help="Also run the kernels at this "
                                        "config's sizes (real, mid, tiny, a model name or directory), timed against "
                                        "their bounds on a card; 'none': small shapes only. Default: on a card the "
                                        "model's (--model) or the real model's; on the CPU none (the interpreter "
                                        "would take hours at the real sizes)."),
    reset: bool = typer.Option(False, "--reset", help="Forget every verdict kept for every card (families turned "
                                                      "off come back; each is checked again at its next use)."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Check this machine's card: each kernel family against the torch path; what fails is turned off for it."""
    be_quiet(quiet)
    if reset:
        from quant.kernels.verdicts import forget

        note("forgot the kernel verdicts kept for every card" if forget() else "no kernel verdicts were kept")
        return
    names = devices_arg(devices)
    if json_out is not None and json_out != Path("-") and not json_out.expanduser().parent.is_dir():
        raise UsageError(f"--json {json_out}: no such folder {json_out.expanduser().parent}")
    fmt = _model_format(model) if model else ("bf16" if quick else None)  # bf16: the families every model uses
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # the kernels in Triton's interpreter: set before Triton is imported (quant imports it)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UsageError("Triton is not installed: dgemma runs the torch path everywhere, and there is no kernel "
                         "to check (pip install triton)") from None
    import quant  # noqa: F401  (registers every family's problem with the probes)

    from ..doctor.report import diagnose, rows, summary

    indices = _indices(names) if cuda else None
    device = torch.device("cuda", indices[0] if indices else 0) if cuda else torch.device("cpu")
    stream = sys.stderr if json_out == Path("-") else sys.stdout
    at, skipped = _sizes(sizes, model, quick, cuda)
    from ..bench import environment

    # on the CPU the modules take the kernels (in the interpreter) while the doctor runs, and only then: a process
    # that goes on (a test, a notebook) keeps its own setting
    with environment({} if cuda else {"DGEMMA_KERNELS": "triton"}):
        report = _run(diagnose, device, quiet=quiet, fmt=fmt, devices=indices, sizes=at, sizes_skipped=skipped)
    if json_out is not None:
        text = json.dumps(report, indent=1)
        if json_out == Path("-"):
            sys.stdout.write(text + "\n")
        else:
            _write(json_out, text + "\n")
    if not quiet:
        _table(report, rows(report), stream)
    note(summary(report))
    if not report["ok"]:
        raise typer.Exit(1)


def _sizes(name: str | None, model: str | None, quick: bool, cuda: bool) -> tuple[tuple | None, str | None]:
    """((label, Sizes) or None, why not) for --sizes, as the docstring of the option says."""
    if name == "none":
        return None, "--sizes none: small shapes only"
    if name is None:
        if quick:
            return None, "--quick: small shapes only"
        if not cuda:
            return None, ("needs a CUDA card: the interpreter would take hours at the real sizes (`--sizes tiny` "
                          "runs this check's logic here)")
        name = model_arg(model, quiet=True) if model else "real"
    from quant.probes import Sizes

    from ..bench import config_for
    from ..checkpoint.names import resolve_model
    from ..checkpoint.stored import is_gguf, model_config
    from ..config import ModelConfig

    if model and name == model_arg(model, quiet=True) and is_gguf(resolve_model(name)):  # a GGUF: its own keys
        path = resolve_model(name)
        return (path.name, Sizes.of(model_config(path))), None
    label, raw = config_for(name)
    return (Path(label).name if "/" in label else label, Sizes.of(ModelConfig.from_dict(raw))), None


def _model_format(model: str) -> str:
    from ..checkpoint.names import resolve_model
    from ..doctor.first_use import model_format

    return model_format(resolve_model(model_arg(model, quiet=True)))


def _indices(names) -> list[int] | None:
    if names in (None, "auto"):
        return None
    out = []
    for name in names:
        kind, _, index = str(name).partition(":")
        if kind != "cuda":
            raise UsageError(f"--devices {name}: the doctor checks CUDA cards (cuda:N)")
        out.append(int(index or 0))
    return out


def _run(diagnose, device, *, quiet, **kw):
    """diagnose with a progress line on a terminal (Rich), silently elsewhere."""
    if quiet or not sys.stderr.isatty():
        return diagnose(device, **kw)
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=Console(stderr=True),
                  transient=True) as bar:
        task = bar.add_task("checking")
        return diagnose(device, progress=lambda what: bar.update(task, description=f"checking {what}"), **kw)


def _table(report: dict, checks, stream) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream, highlight=False, soft_wrap=False)
    m = report["machine"]
    console.print(f"dgemma {m['dgemma']} · torch {m['torch']} · Triton {m['triton']} · CUDA "
                  f"{m['cuda_runtime'] or '-'} · driver {m['driver'] or '-'} · host memory free "
                  f"{_gib(m['host_memory_free_bytes'])}")
    for card in m["cards"]:
        console.print(f"cuda:{card['index']} {card['name']}: {_gib(card['memory_bytes'])}, compute "
                      f"{card['compute_capability']}, PCIe {card['pcie_link'] or 'unknown'}: {card['support']}")
    if not m["cards"]:
        console.print("no CUDA card: the kernels checked in Triton's interpreter, at small shapes"
                      + (f" and at {report['sizes']}'s sizes" if report["sizes"] else ""))
    table = Table(title=f"{report['card']}: {report['mode']}, {report['compute_dtype']}")
    for col in ("check", "what", "result", "detail", "s"):
        table.add_column(col, justify="right" if col == "s" else "left")
    for c in checks:
        style = {"pass": "green", "off": "red", "fail": "red"}.get(c.status, "dim")
        table.add_row(c.name, c.what, f"[{style}]{c.status}[/]", c.detail,
                      "" if c.seconds is None else f"{c.seconds:.2f}")
    console.print(table)
    timed = [t for c in checks for t in c.timings or () if t["ms"] is not None]
    if timed:  # a card: each kernel call at the model's sizes against its bound
        calls = Table(title=f"kernel calls at {report['sizes']}'s sizes against their bounds on {report['card']}")
        for col in ("call", "ms", "bound ms", "bound by", "x bound"):
            calls.add_column(col, justify="left" if col == "call" else "right")
        for t in timed:
            calls.add_row(t["call"], f"{t['ms']:.3f}", "-" if t["bound_ms"] is None else f"{t['bound_ms']:.3f}",
                          t["bound_by"] or "-", "-" if t["x_bound"] is None else f"{t['x_bound']:.2f}")
        console.print(calls)
    for line in report["not_done"]:
        console.print(f"[dim]not checked yet: {line}[/]")


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _write(path: Path, text: str) -> None:
    """Written whole or not at all (a temporary file renamed over it)."""
    import tempfile

    path = path.expanduser()
    try:
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent if str(path.parent)
                                   else ".")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise UsageError(f"--json {path}: cannot write it ({e.strerror or e})") from None
