"""The `dgemma` command line: parse, build settings, call library code. Thin on purpose.

Nothing heavy is imported at module level: `dgemma --help` and usage errors never import torch.
Stdout carries only answers; diagnostics go to stderr as one line each, with documented exit codes:
0 ok, 1 runtime error, 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import typer

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, DgemmaError, UsageError

app = typer.Typer(
    name="dgemma",
    help="Run DiffusionGemma locally: block diffusion, one canvas at a time.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", help="Print the version and exit."),
) -> None:
    """Run DiffusionGemma locally: block diffusion, one canvas at a time."""
    if version:
        from . import __version__

        sys.stdout.write(f"dgemma {__version__}\n")
        raise typer.Exit(0)
    if ctx.invoked_subcommand is None:
        sys.stdout.write(ctx.get_help() + "\n")
        raise typer.Exit(0)


MODEL_HELP = ("A model directory, a store name [OWNER/]NAME[:QUANT] (see `dgemma list`), or 'demo' for the "
              "bundled demo model. Defaults to $DGEMMA_MODEL, then 'demo'.")


def _read_prompt(prompt: Optional[str]) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: pass PROMPT, or pipe text on stdin")
    return sys.stdin.read()


def _model_dir(model: Optional[str]) -> str:
    """--model, else $DGEMMA_MODEL, else the bundled demo model (said on stderr)."""
    model = model or os.environ.get("DGEMMA_MODEL")
    if not model:
        sys.stderr.write("dgemma: using the bundled demo model (pass --model DIR for another)\n")
        model = "demo"
    return model


@app.command()
def run(
    prompt: Optional[str] = typer.Argument(None, help="The prompt; read from stdin when absent or '-'."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Most tokens to generate."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Most denoising steps per canvas."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed torch's generator for a reproducible run."),
    raw: bool = typer.Option(False, "--raw", help="No chat template: tokenize the text exactly as given."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (chat mode)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the answer."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    view: Optional[str] = typer.Option(None, "--view",
                                       help="live, plain or none. Default: live on a terminal, else none."),
    each_line: bool = typer.Option(False, "--each-line",
                                   help="Each input line is its own prompt; answers come in input order."),
    batch_size: int = typer.Option(8, "--batch-size", help="With --each-line: prompts generated together."),
) -> None:
    """Generate one answer. Stdout gets only the answer (or one JSON object with --json)."""
    if raw and system:
        raise UsageError("--system needs the chat template; it cannot be combined with --raw")
    if view is not None and view not in ("live", "plain", "none"):
        raise UsageError(f"--view must be live, plain or none (got {view!r})")
    text = _read_prompt(prompt)
    if (prompt is None or prompt == "-") and not raw and not each_line:
        text = text.rstrip("\r\n")  # `echo ... |` adds a newline the user did not mean as part of the prompt
    if each_line:
        return _run_each_line(text, model=model, as_json=as_json, batch_size=batch_size, device=device,
                              dtype=dtype, raw=raw, system=system, seed=seed, max_new_tokens=max_new_tokens,
                              max_denoising_steps=steps)
    if not text.strip():
        raise UsageError("empty prompt")
    if view is None:  # the view draws on stderr and only makes sense when a person watches the answer arrive
        view = "live" if sys.stdout.isatty() and sys.stderr.isatty() and not as_json else "none"
    from .engine import load  # heavy: torch

    engine = load(_model_dir(model), device=device, dtype=dtype)
    kwargs = dict(raw=raw, system=system, seed=seed, max_new_tokens=max_new_tokens, max_denoising_steps=steps)
    finished: list[int] = []  # tokens of finished canvases: what Ctrl-C keeps

    def keep(event) -> None:
        from .sampler import CanvasDone

        if isinstance(event, CanvasDone):
            finished.extend(event.tokens[0].tolist())

    try:
        if view == "live" and engine.tokenizer is not None:
            from .view import view_for

            canvas_view = view_for(engine.tokenizer)
            with canvas_view:
                result = engine.generate(text, on_event=lambda e: (keep(e), canvas_view(e)), **kwargs)
        elif view == "plain":
            result = engine.generate(text, on_event=lambda e: (keep(e), _plain_progress(e)), **kwargs)
        else:
            result = engine.generate(text, on_event=keep, **kwargs)
    except KeyboardInterrupt:
        if finished and engine.tokenizer is not None and not as_json:  # keep what was finished, then exit 130
            eot = engine.tokenizer.end_of_turn_id
            ids = finished[: finished.index(eot)] if eot in finished else finished
            answer = engine.tokenizer.decode(ids) if raw else engine.tokenizer.decode_answer(ids)[1]
            sys.stdout.write(answer + "\n")
            sys.stdout.flush()
        raise
    _write_answer(result, 0, as_json)
    sys.stdout.flush()



def _write_answer(result, i: int, as_json: bool, prompt: Optional[str] = None) -> None:
    if as_json:
        obj = {} if prompt is None else {"prompt": prompt}
        obj.update({
            "text": result.texts[i],
            "thought": result.thoughts[i],
            "token_ids": result.token_ids[i],
            "prompt_token_ids": result.prompt_token_ids[i],
            "canvases": result.steps_per_canvas[i],
            "tokens_per_forward": result.tokens_per_forward[i],
            "seconds": round(result.seconds, 4),
        })
        sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    else:
        out = result.texts[i]
        sys.stdout.write(out if out.endswith("\n") else out + "\n")


def _run_each_line(text: str, *, model, as_json: bool, batch_size: int, device: str, dtype: str, **gen) -> None:
    """One answer (or JSON Lines object) per input line, in input order; blank lines give blank answers."""
    if batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start another
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not any(line.strip() for line in lines):
        raise UsageError("empty input: no non-blank line")
    from .engine import load  # heavy: torch

    engine = load(_model_dir(model), device=device, dtype=dtype)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    answers: dict[int, tuple] = {}
    for start in range(0, len(todo), batch_size):
        chunk = todo[start : start + batch_size]
        result = engine.generate([lines[i] for i in chunk], **gen)
        for j, i in enumerate(chunk):
            answers[i] = (result, j)
    for i, line in enumerate(lines):
        if i in answers:
            _write_answer(*answers[i], as_json, prompt=line)
        elif as_json:
            sys.stdout.write(json.dumps({"prompt": line, "text": "", "skipped": True}) + "\n")
        else:
            sys.stdout.write("\n")
    sys.stdout.flush()


@app.command()
def chat(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Most denoising steps per canvas."),
    think: bool = typer.Option(False, "--think", help="Let the model think before answering."),
    view: str = typer.Option("live", "--view", help="live, plain or none."),
    context: int = typer.Option(8192, "--context", help="Tokens of conversation kept (oldest turns drop)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed each turn's generation."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
) -> None:
    """Chat in the terminal; the KV cache carries over between turns. /help lists the commands."""
    if view not in ("live", "plain", "none"):
        raise UsageError(f"--view must be live, plain or none (got {view!r})")
    if context < 64:
        raise UsageError("--context must be at least 64")
    if not sys.stdin.isatty():
        raise UsageError("dgemma chat needs a terminal; for pipes use `dgemma run` (--each-line for many prompts)")
    from .chat import run_chat
    from .engine import load

    engine = load(_model_dir(model), device=device, dtype=dtype)
    raise typer.Exit(run_chat(engine, system=system, steps=steps, think=think, view=view, context=context,
                              seed=seed))


@app.command()
def fim(
    file: str = typer.Argument(..., help="The file to fill; '-' reads stdin."),
    marker: str = typer.Option("<FILL>", "--marker", help="The text that marks a hole."),
    lines: Optional[str] = typer.Option(None, "--lines", help="Regenerate lines A:B (1-based, inclusive)."),
    in_place: bool = typer.Option(False, "--in-place", help="Rewrite FILE atomically (keeps FILE.orig)."),
    no_backup: bool = typer.Option(False, "--no-backup", help="With --in-place: no FILE.orig."),
    to_stdout: bool = typer.Option(False, "--stdout", help="Print the whole filled file instead of a diff."),
    method: str = typer.Option("held", "--method", help="held (default), prefix or instruct."),
    held_tokens: int = typer.Option(8, "--held-tokens", help="Suffix tokens held at the end of the canvas."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Most tokens for each hole."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Most denoising steps per canvas."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed torch's generator."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
) -> None:
    """Fill the holes of a file using the text on both sides. Prints a unified diff by default."""
    from . import fim as F

    if in_place and file == "-":
        raise UsageError("--in-place needs a file, not stdin")
    if in_place and to_stdout:
        raise UsageError("--in-place and --stdout exclude each other")
    if held_tokens < 0:
        raise UsageError("--held-tokens must be >= 0")
    if method not in F.METHODS:
        raise UsageError(f"--method must be one of {', '.join(F.METHODS)} (got {method!r})")
    text = F.read_source(file)
    name = "stdin" if file == "-" else file
    holes = [F.lines_hole(text, lines, name)] if lines else F.marker_holes(text, marker, name)
    from .engine import load  # heavy: torch

    engine = load(_model_dir(model), device=device, dtype=dtype)
    new = F.fill_holes(engine, text, holes, method=method, held_tokens=held_tokens, name=name, marker=marker,
                       warn=lambda m: sys.stderr.write(m + "\n"), seed=seed, max_new_tokens=max_new_tokens,
                       max_denoising_steps=steps)
    if in_place:
        from pathlib import Path

        F.save_in_place(Path(file), text, new, backup=not no_backup)
    elif to_stdout:
        sys.stdout.buffer.write(new.encode("utf-8"))
    else:
        sys.stdout.write(F.unified_diff(text, new, name))
    sys.stdout.flush()


# ----------------------------------------------------------------------------- weights: pull, store, quantize


def _note(message: str) -> None:
    sys.stderr.write(f"dgemma: {message}\n")


def _gb(n: int) -> str:
    """Bytes in decimal units (1 GB = 1e9 bytes)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@app.command()
def pull(
    repo: str = typer.Argument("google/diffusiongemma-26B-A4B-it", help="Hub repository id (OWNER/NAME)."),
    quant: str = typer.Option("auto", "--quant", help="auto (from free GPU memory), bf16, int8 or nvfp4."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch, tag or commit (default: main)."),
    policy: str = typer.Option("experts", "--policy",
                               help="What int8/nvfp4 quantize: experts (default) or all (+ attention, dense MLP)."),
) -> None:
    """Download a model from the Hub and quantize it into the store. HF_TOKEN, HF_HOME and HF_HUB_OFFLINE apply."""
    from .errors import Interrupted
    from .store import pull as do_pull

    try:
        entry = do_pull(repo, quant, revision, policy, progress=sys.stderr.isatty(), note=_note)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; run the same command again to continue (finished files are kept)") from None
    if entry is not None:
        _note(f"stored {entry.name} ({_gb(entry.size)}) in {entry.path}")
        sys.stdout.write(f"{entry.name}\n")


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="JSON Lines instead of a table.")) -> None:
    """The models in the store."""
    from .store import entries, store_root

    found = entries()
    if as_json:
        for e in found:
            sys.stdout.write(json.dumps({"name": e.name, "format": e.quant, "size": e.size, "path": str(e.path),
                                         "revision": e.manifest["store"].get("revision")}) + "\n")
        return
    if not found:
        _note(f"the store is empty ({store_root()}); `dgemma pull` fetches a model")
        return
    width = max(len(e.name) for e in found)
    sys.stdout.write(f"{'NAME':<{width}}  {'SIZE':>9}  PATH\n")
    for e in found:
        sys.stdout.write(f"{e.name:<{width}}  {_gb(e.size):>9}  {e.path}\n")


@app.command()
def info(
    model: str = typer.Argument(..., help="A store name, a model directory, or 'demo'."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
) -> None:
    """Format, sizes, estimated GPU memory and location of a model."""
    from .engine import resolve_model
    from .store import describe

    path = resolve_model(model)
    if not path.is_dir():
        from .errors import ModelError

        raise ModelError(f"{path}: no such model directory")
    d = describe(path)
    if as_json:
        sys.stdout.write(json.dumps(d) + "\n")
        return
    src = d["source"]
    fmt = d["format"] + (f" (policy {d['policy']})" if d["policy"] != "none" else f" ({d['dtype_on_disk']} on disk)")
    rows = [("path", d["path"]), ("format", fmt),
            ("size on disk", _gb(d["size_on_disk"])), ("weights in memory", _gb(d["weights_in_memory"])),
            ("GPU memory, 8k context", f"{_gb(d['gpu_memory_estimate_8k'])} (estimate)"),
            ("shape", f"{d['layers']} layers, {d['experts']} experts, vocabulary {d['vocab']}")]
    if src:
        rows.append(("source", f"{src.get('repo')} @ {str(src.get('revision'))[:12]}"))
    for k, v in rows:
        sys.stdout.write(f"{k + ':':<24}{v}\n")


@app.command()
def rm(
    model: str = typer.Argument(..., help="A store name [OWNER/]NAME[:QUANT]."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Remove a model from the store (never touches directories outside it)."""
    from .store import find, remove, store_root

    found = find(model)
    if not found:
        raise UsageError(f"{model}: not in the store ({store_root()}); `dgemma list` shows what is there")
    if len(found) > 1:
        raise UsageError(f"{model} matches {', '.join(e.name for e in found)}; add :QUANT to choose")
    entry = found[0]
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"removing {entry.name} needs --yes when stdin is not a terminal")
        sys.stderr.write(f"remove {entry.name} ({_gb(entry.size)}, {entry.path})? [y/N] ")
        sys.stderr.flush()
        if sys.stdin.readline().strip().lower() not in ("y", "yes"):
            _note("nothing removed")
            return
    remove(entry)
    _note(f"removed {entry.name}")


@app.command()
def quantize(
    src: str = typer.Argument(..., help="An unquantized checkpoint: a directory or a store name."),
    quant: str = typer.Option(..., "--quant", help="nvfp4 or int8."),
    out: str = typer.Option(..., "--out", help="The new directory to write (must not exist)."),
    policy: str = typer.Option("experts", "--policy", help="experts (default) or all (+ attention, dense MLP)."),
    scales: str = typer.Option("auto", "--scales", help="auto, absmax or search (block scales chosen by error)."),
    device: str = typer.Option("auto", "--device", help="Where to compute: cpu, cuda or auto."),
) -> None:
    """Quantize a local checkpoint, streaming and resumable: run it again after an interruption to continue."""
    from pathlib import Path

    from .errors import Interrupted

    if scales not in ("auto", "absmax", "search"):
        raise UsageError(f"--scales must be auto, absmax or search (got {scales!r})")
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda or auto (got {device!r})")
    from .engine import resolve_model
    from .quantize import quantize_checkpoint

    search = None if scales == "auto" else scales == "search"
    try:
        manifest = quantize_checkpoint(resolve_model(src), Path(out), quant, policy, search, device,
                                       progress=sys.stderr.isatty(), note=_note)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; run the same command again to continue where it stopped") from None
    _note(f"wrote {out} ({quant}, policy {policy}, {_gb(manifest['total_bytes'])})")


@app.command()
def bench(
    config: str = typer.Option("mid", "--config", help="real (26B-A4B shapes), mid, tiny, or a model directory."),
    fmt: str = typer.Option("nvfp4", "--format", help="bf16, int8 or nvfp4 (random weights in that format)."),
    policy: str = typer.Option("experts", "--policy", help="What int8/nvfp4 cover: experts or all."),
    batch: int = typer.Option(1, "--batch", help="Rows generated together."),
    prompt: int = typer.Option(512, "--prompt", help="Prompt tokens per row."),
    steps: int = typer.Option(16, "--steps", help="Denoising steps per canvas (fixed)."),
    canvases: int = typer.Option(1, "--canvases", help="Canvases per row."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    compare: Optional[str] = typer.Option(None, "--compare", help="'transformers': also time the reference (its "
                                          "compiled static-cache path where it has one); 'transformers-eager'."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
) -> None:
    """Time the denoise step on random weights (no download) against the weight-read floor."""
    from .bench import as_dict, run_bench

    result = run_bench(config, fmt, policy, batch, prompt, steps, canvases, device, dtype, compare)
    sys.stdout.write((json.dumps(as_dict(result)) if as_json else result.table()) + "\n")


def _plain_progress(event) -> None:
    """--view plain: one line per finished canvas on stderr."""
    from .sampler import CanvasDone

    if isinstance(event, CanvasDone):
        sys.stderr.write(f"dgemma: canvas {event.canvas_index + 1} done in {event.steps[0]} steps\n")


def _fail(message: str, code: int) -> None:
    sys.stderr.write(f"dgemma: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _click_exceptions():
    """Typer's parser exceptions: recent Typer vendors its own click, older releases use click itself."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def main(argv: list[str] | None = None) -> None:
    """Console entry point: every failure is one line on stderr and an exit code, never a traceback."""
    ex = _click_exceptions()
    try:
        # Without standalone mode errors propagate to the handlers below, but Typer turns Ctrl-C into an
        # exit code that it *returns* (130), so the return value matters too.
        rc = app(args=argv, standalone_mode=False)
        if rc == EXIT_INTERRUPTED:
            _fail("interrupted", EXIT_INTERRUPTED)
        if isinstance(rc, int) and rc != 0:
            raise SystemExit(rc)
    except DgemmaError as e:
        _fail(str(e), e.exit_code)
    except ex.NoArgsIsHelpError:
        raise SystemExit(EXIT_USAGE) from None
    except ex.UsageError as e:
        hint = f" (see: dgemma {e.ctx.info_name} --help)" if e.ctx is not None and e.ctx.parent else ""
        _fail(e.format_message().replace("\n", " ") + hint, EXIT_USAGE)
    except ex.ClickException as e:
        _fail(e.format_message().replace("\n", " "), e.exit_code)
    except typer.Exit as e:
        raise SystemExit(e.exit_code) from None
    except typer.Abort:
        _fail("interrupted", EXIT_INTERRUPTED)
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        # the reader went away (e.g. `| head`): nothing more to say
        try:
            sys.stdout = open(os.devnull, "w")
        finally:
            raise SystemExit(0)
    except MemoryError:
        _fail("out of memory: try a smaller --max-new-tokens or a quantized model", 1)
    except Exception as e:  # a bug, not bad input: still one line, with a way to see the traceback
        if os.environ.get("DGEMMA_DEBUG"):
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (set DGEMMA_DEBUG=1 for the traceback)", 1)
