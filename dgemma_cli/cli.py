"""The `dgemma` command line: parse, build settings, call library code. Thin on purpose.

Nothing heavy is imported at module level: `dgemma --help` and usage errors never import torch.
Stdout carries only answers; diagnostics go to stderr as one line each, with documented exit codes:
0 ok, 1 runtime error, 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, DgemmaError, UsageError
from .guard import is_loopback

app = typer.Typer(
    name="dgemma",
    help="Run DiffusionGemma locally: block diffusion, one canvas at a time.",
    add_completion=True,  # --install-completion, --show-completion: for the shell they run from (detected)
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},  # every command: -h as in ollama, llm, llama.cpp
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


def _sampler_option(flag: str):
    """The Typer option for one of the sampler's settings (config.SAMPLER_FLAGS); None keeps the model's value."""
    from .config import SAMPLER_FLAGS

    return typer.Option(None, f"--{flag}", help=SAMPLER_FLAGS[flag][2], show_default=False)


_quiet = False  # -q: nothing on stderr but errors (set by each command)

QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="Nothing on stderr but errors: no progress, no notices.")
COMPILE_TIMEOUT_OPTION = typer.Option(
    30.0, "--compile-timeout", metavar="SECONDS", help="The most time a --json-schema, --regex or --grammar (or a "
    "request's structure) may take to compile, in a process of its own; past it, refused.")
COMPILE_MEMORY_OPTION = typer.Option(
    4.0, "--compile-memory", metavar="GB", help="The most memory that compile may use; past it, refused.")


def _compile_budget(seconds: float, gigabytes: float) -> tuple[float, int]:
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


def _sampler_settings(**given) -> dict:
    """Flag values -> GenerationSettings overrides, the flags that were not given left out (so the model's own
    values stay). Each value is range-checked here, before the model loads; combinations (--t-min above the
    model's --t-max) are checked when the settings are applied."""
    from .config import GenerationSettings

    out = {k: v for k, v in given.items() if v is not None}
    GenerationSettings().override(**out)  # a schedule end given alone moves the other as it will over the model's
    return out


def _read_prompt(prompt: Optional[str]) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: pass PROMPT, or pipe text on stdin")
    return sys.stdin.read()


def _prompt_words(words: Optional[List[str]]) -> Optional[str]:
    """PROMPT as typed: several words are one prompt, joined by spaces (`dgemma run why is the sky blue`, as in
    ollama and llm); None (read stdin) when absent or '-'."""
    if not words or list(words) == ["-"]:
        return None
    return " ".join(words)


def _check_device_dtype(device: str, dtype: str) -> None:
    """What engine.load checks too, checked before torch is imported so that a typo fails at once."""
    from .device import check_device_name, check_dtype_name

    check_device_name(device)
    check_dtype_name(dtype)


ADAPTER_OPTION = typer.Option(
    None, "--adapter", metavar="DIR[:SCALE]", help="A LoRA adapter in PEFT's format (a directory, or a bundled or "
    "stored adapter's name), applied unmerged to any base format; :SCALE weighs it (default 1). Repeat to add "
    "several.")


def _adapters(args: Optional[List[str]]) -> list:
    """--adapter values -> [(directory, scale)], each checked before torch is imported."""
    from .names import resolve_adapter

    return [resolve_adapter(a) for a in args or []]


def _model_dir(model: Optional[str], quiet: bool = False) -> str:
    """--model, else $DGEMMA_MODEL (an error then names the variable), else the bundled demo model (said on stderr
    unless quiet). Resolved and checked here, before anything imports torch: a missing model is said at once."""
    from .errors import ModelError
    from .names import resolve_model

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
    if not path.exists():
        raise ModelError(f"{where}{path}: no such model directory")
    if not path.is_dir():
        raise ModelError(f"{where}{path}: not a directory")
    return model


@app.command()
def run(
    prompt: Optional[List[str]] = typer.Argument(
        None, metavar="PROMPT",
        help="The prompt; several words are joined with spaces. Read from stdin when absent or '-'."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: Optional[int] = _sampler_option("max-new-tokens"),
    steps: Optional[int] = _sampler_option("steps"),
    t_max: Optional[float] = _sampler_option("t-max"),
    t_min: Optional[float] = _sampler_option("t-min"),
    temperature: Optional[float] = TEMPERATURE_OPTION,
    entropy_bound: Optional[float] = _sampler_option("entropy-bound"),
    confidence_threshold: Optional[float] = _sampler_option("confidence-threshold"),
    stability_threshold: Optional[int] = _sampler_option("stability-threshold"),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed torch's generator for a reproducible run."),
    raw: bool = typer.Option(False, "--raw", help="No chat template: tokenize the text exactly as given."),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt (chat mode)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the answer."),
    image: Optional[List[str]] = typer.Option(
        None, "--image", metavar="PATH", help="An image the prompt is about: PNG, JPEG, WebP or GIF (first frame). "
        "Repeat for several; '-' reads one from stdin (then PROMPT must be an argument)."),
    image_tokens: Optional[int] = typer.Option(
        None, "--image-tokens", help="Soft tokens per image: 70, 140, 280, 560 or 1120 (default: the model's, "
        "280). More tokens see finer detail and cost more time.", show_default=False),
    view_delay: float = typer.Option(0.0, "--view-delay", metavar="SECONDS",
                                     help="Pause the live view this long after each step it draws (every step is "
                                     "then drawn), to follow a fast model by eye. Live view only; 0: no pause."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    view: Optional[str] = typer.Option(None, "--view", help="live, plain or none (not with --each-line). "
                                       "Default: live when stdout and stderr are a terminal; plain (a line per "
                                       "canvas) when only stderr is, or with --json; none when stderr is not a "
                                       "terminal. live on a dumb terminal (TERM=dumb) is plain."),
    each_line: bool = typer.Option(False, "--each-line", help="Each input line is its own prompt; answers come "
                                   "in input order, written as each batch finishes."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size",
                                             help="With --each-line: prompts generated together (default 8)."),
    json_schema: Optional[str] = typer.Option(
        None, "--json-schema", metavar="FILE", help="Hold the answer to this JSON Schema: it is valid JSON of the "
        "schema by construction ('-' reads the schema from stdin; then PROMPT must be an argument)."),
    regex: Optional[str] = typer.Option(None, "--regex", metavar="PATTERN",
                                        help="Hold the answer to this regular expression (the whole answer)."),
    grammar: Optional[str] = typer.Option(
        None, "--grammar", metavar="FILE", help="Hold the answer to this context-free grammar: llguidance's Lark "
        "syntax (start: ...), or llama.cpp's GBNF (root ::= ...)."),
    adapter: Optional[List[str]] = ADAPTER_OPTION,
    compile_timeout: float = COMPILE_TIMEOUT_OPTION,
    compile_memory: float = COMPILE_MEMORY_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Generate one answer. Stdout gets only the answer (or one JSON object with --json).

    With --json-schema, --regex or --grammar the answer matches by construction; one that cannot be completed within
    --max-new-tokens is written as far as it got, said on stderr, and the exit status is 1.

    The sampler's settings (--steps to --stability-threshold) default to the model's generation_config.json."""
    # Flags first, all of them before torch is imported: a typo fails at once, and no flag is silently ignored.
    if raw and system:
        raise UsageError("--system needs the chat template; it cannot be combined with --raw")
    _check_device_dtype(device, dtype)
    if view is not None and view not in ("live", "plain", "none"):
        raise UsageError(f"--view must be live, plain or none (got {view!r})")
    if quiet and view in ("live", "plain"):
        raise UsageError(f"--quiet and --view {view} exclude each other")
    if not (0 <= view_delay <= 60):  # NaN fails too
        raise UsageError(f"--view-delay must be between 0 and 60 seconds (got {view_delay:g})")
    if view_delay and (quiet or each_line or view in ("plain", "none")):
        raise UsageError("--view-delay paces the live view; it cannot be combined with "
                         + ("--quiet" if quiet else "--each-line" if each_line else f"--view {view}"))
    if each_line and view in ("live", "plain"):
        raise UsageError(f"--view {view} draws one prompt's canvas; it cannot be combined with --each-line")
    if batch_size is not None and not each_line:
        raise UsageError("--batch-size needs --each-line (a single prompt is generated alone)")
    if batch_size is not None and batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    sampler = _sampler_settings(max_new_tokens=max_new_tokens, max_denoising_steps=steps, t_max=t_max,
                                t_min=t_min, temperature=temperature, entropy_bound=entropy_bound,
                                confidence_threshold=confidence_threshold, stability_threshold=stability_threshold)
    adapters = _adapters(adapter)
    budget = _compile_budget(compile_timeout, compile_memory)
    _be_quiet(quiet)
    joined = _prompt_words(prompt)
    structure = _structure(json_schema, regex, grammar, stdin_prompt=joined is None)
    if (joined is None and sys.stdin is not None and sys.stdin.isatty() and sys.stdout.isatty()
            and not (as_json or each_line or raw or image)):
        # No prompt, and a person at a terminal: a conversation, as `ollama run` and `llm` start one.
        _note("no prompt given: starting `dgemma chat` (Ctrl-D leaves)")
        return chat(model=model, system=system, max_new_tokens=max_new_tokens, steps=steps, t_max=t_max,
                    t_min=t_min, temperature=temperature, entropy_bound=entropy_bound,
                    confidence_threshold=confidence_threshold, stability_threshold=stability_threshold, think=False,
                    view=view or "live", context=None, seed=seed, device=device, dtype=dtype, adapter=adapter,
                    quiet=quiet)
    _check_images(image or [], image_tokens, stdin_prompt=joined is None, each_line=each_line)
    text = _read_prompt(joined)
    if joined is None and not raw and not each_line:
        text = text.rstrip("\r\n")  # `echo ... |` adds a newline the user did not mean as part of the prompt
    if each_line:
        return _run_each_line(text, model=model, as_json=as_json, batch_size=batch_size or 8, device=device,
                              dtype=dtype, quiet=quiet, raw=raw, system=system, seed=seed, structure=structure,
                              adapters=adapters, compile_budget=budget, **sampler)
    if not text.strip():
        raise UsageError("empty prompt")
    model_dir = _model_dir(model, quiet)  # a missing model is said before torch is imported (seconds)
    images = _read_images(image or [], model_dir)  # bad images fail here, before the model loads
    from .view import choose_view  # progress goes to stderr, for a person watching it (view.choose_view)

    view = choose_view(view, stdout_tty=sys.stdout.isatty(), stderr_tty=sys.stderr.isatty(),
                       term=os.environ.get("TERM"), as_json=as_json, quiet=quiet)
    import time

    from .engine import load  # heavy: torch

    engine = load(model_dir, device=device, dtype=dtype, adapters=adapters)
    engine.set_compile_budget(*budget)
    kwargs = dict(raw=raw, system=system, seed=seed, **sampler)
    if structure is not None:
        kwargs.update(structure=structure)
    if images:
        kwargs.update(images=images, image_tokens=image_tokens)
    from .answer import FinishedCanvases

    # stdout and stderr on one screen: whether the answer's last piece left the cursor mid-line, where a progress
    # line would join it (the progress then starts a line of its own; stdout's bytes are unchanged).
    one_screen = sys.stdout.isatty() and sys.stderr.isatty()
    screen = {"mid_line": False}

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()
        if piece:
            screen["mid_line"] = one_screen and not piece.endswith("\n")

    def mid_line() -> bool:
        was, screen["mid_line"] = screen["mid_line"], False  # the progress line ends with its newline
        return was

    # Each finished canvas's text goes to stdout as it settles (a pipe sees the answer grow), unless stdout gets
    # one JSON object or the live view shows the answer growing; Ctrl-C keeps every finished canvas either way.
    streaming = not as_json and view != "live" and engine.tokenizer is not None
    finished = (FinishedCanvases(engine.tokenizer, engine.settings.override(**sampler), raw=raw or bool(structure),
                                 write=write if streaming else None) if engine.tokenizer is not None else None)

    def keep(event) -> None:
        from .sampler import CanvasDone

        if isinstance(event, CanvasDone) and finished is not None:
            finished.add(event.tokens[0].tolist(), int(event.steps[0]), int(event.kept[0]))

    from .view import Board

    board = Board.from_hint(engine.view_hints.get("board"), engine.config.canvas_length)  # the checkpoint's layout
    if board is not None:  # a prompt the board's model cannot read is said, whatever the view
        board, warning = board.read_prompt(text)
        if warning:
            _note(warning)
    t0 = time.perf_counter()
    try:
        if structure is not None:
            engine.automaton(structure)  # compiled before the first step: a schema the vocabulary cannot spell fails
        if view == "live" and engine.tokenizer is not None:
            from .view import view_for

            canvas_view = view_for(engine.tokenizer, board=board, delay=view_delay)
            with canvas_view:
                result = engine.generate(text, on_event=lambda e: (keep(e), canvas_view(e)), **kwargs)
        elif view != "none":  # plain (or live without a tokenizer to show tokens with)
            from .view import PlainProgress

            progress = PlainProgress(sys.stderr, mid_line=mid_line)
            result = engine.generate(text, on_event=lambda e: (keep(e), progress(e)), **kwargs)
        else:
            result = engine.generate(text, on_event=keep, **kwargs)
    except KeyboardInterrupt:  # print what was finished (the answer, or its JSON object), then exit 130
        if as_json:  # the object whatever was finished (before the first canvas: an empty answer), as docs/run.md
            part = _partial_answer(engine, text, finished, time.perf_counter() - t0, raw=raw, system=system,
                                   images=engine.image_patches(images, image_tokens) if images else ())
            write(json.dumps(part, ensure_ascii=False) + "\n")
        elif finished is not None and finished.tokens:
            if streaming:
                finished.finish(finished.answer())
            else:
                write(finished.answer() + "\n")
        raise
    if streaming:
        finished.finish(result.texts[0])
    else:
        write(_answer_line(result, 0, as_json))
    if result.satisfied is not None and not result.satisfied[0]:
        _fail(_cut_short(structure, engine.settings.override(**sampler).max_new_tokens), 1)
    notice = _empty_notice(result, 0, as_json)
    if notice and not quiet:
        _note(notice)


def _structure(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str], *, stdin_prompt: bool):
    """--json-schema / --regex / --grammar as a constrain.Structure (None without any), read and checked before
    the model loads: a schema that is not JSON, a pattern that is not a regular expression, a grammar that does not
    compile, fail in one line."""
    given = [(flag, v) for flag, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise UsageError(f"{given[0][0]} and {given[1][0]} exclude each other: give one")
    if not given:
        return None
    from .constrain import Structure

    flag, value = given[0]
    if flag == "--regex":
        structure = Structure("regex", regex)
    else:
        if value == "-":
            if stdin_prompt:
                raise UsageError(f"stdin cannot hold both the prompt and {flag}: pass PROMPT as an argument")
            source = sys.stdin.read()
        else:
            from pathlib import Path

            try:
                source = Path(value).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UsageError(f"{flag} {value}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        structure = Structure("json_schema" if flag == "--json-schema" else "grammar", source)
    structure.check()  # UsageError in one line
    return structure


def _cut_short(structure, limit: int) -> str:
    what = {"regex": "--regex", "grammar": "--grammar"}.get(structure.kind, "--json-schema")
    return (f"the answer could not be completed to match {what} within --max-new-tokens {limit}: what was written "
            "is cut short (raise --max-new-tokens)")


def _check_images(paths: List[str], image_tokens: Optional[int], *, stdin_prompt: bool, each_line: bool) -> None:
    """--image / --image-tokens combinations, checked before anything is read."""
    from .config import IMAGE_TOKEN_BUDGETS

    if image_tokens is not None and image_tokens not in IMAGE_TOKEN_BUDGETS:
        raise UsageError(f"--image-tokens must be one of {', '.join(map(str, IMAGE_TOKEN_BUDGETS))} "
                         f"(got {image_tokens})")
    if image_tokens is not None and not paths:
        raise UsageError("--image-tokens needs --image")
    if paths and each_line:
        raise UsageError("--image goes with a single prompt; it cannot be combined with --each-line")
    if paths.count("-") > 1:
        raise UsageError("stdin holds one image: '-' may be given to --image once")
    if "-" in paths and stdin_prompt:
        raise UsageError("stdin cannot hold both the prompt and an image: pass PROMPT as an argument")


def _read_images(paths: List[str], model_dir: str) -> list:
    """Decoded images for --image (one line on bad input), after checking that the model has a vision tower."""
    if not paths:
        return []
    from .config import ModelConfig
    from .errors import ModelError
    from .names import resolve_model

    directory = resolve_model(model_dir)
    if (directory / "config.json").is_file() and ModelConfig.from_dir(directory).vision is None:
        raise ModelError(f"{directory}: this model has no vision tower, so it cannot read images")
    from .store import check_images

    check_images(directory)  # a store entry holding only the text model: how to replace it, in one line
    from .image import open_image

    if "-" in paths and (sys.stdin is None or sys.stdin.isatty()):
        raise UsageError("--image -: pipe the image on stdin")
    return [open_image(sys.stdin.buffer.read(), name="stdin") if p == "-" else open_image(p) for p in paths]


def _partial_answer(engine, text: str, finished, seconds: float, *, raw: bool, system: Optional[str],
                    images: list = ()) -> dict:
    """The JSON object of an interrupted run: its finished canvases (answer.FinishedCanvases; None or none yet: an
    empty answer), cut and counted as a whole answer's are, with "interrupted": true."""
    from .sampler import tokens_per_forward

    thought, answer = finished.thought_and_answer() if finished is not None else ("", "")
    steps = finished.steps if finished is not None else []
    return {"text": answer, "thought": thought, "token_ids": finished.ids if finished is not None else [],
            "prompt_token_ids": engine.prompt_ids(text, raw=raw, system=system, images=images), "canvases": steps,
            "tokens_per_forward": tokens_per_forward(finished.kept_tokens if finished is not None else 0, sum(steps)),
            "seconds": round(seconds, 4), "interrupted": True}


def _empty_notice(result, i: int, as_json: bool) -> Optional[str]:
    """The notice for an answer with no text (None when it has some): an empty line alone says nothing."""
    if result.texts[i].strip():
        return None
    if result.thoughts[i].strip():
        return "the model produced no answer text, only a thought" + ("" if as_json else " (--json shows it)")
    return "the model produced no text"


def _answer_line(result, i: int, as_json: bool, prompt: Optional[str] = None) -> str:
    """Answer i of a result as it goes to stdout: its text, or its JSON object, ending in one newline."""
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
        return json.dumps(obj, ensure_ascii=False) + "\n"
    out = result.texts[i]
    return out if out.endswith("\n") else out + "\n"


class _CtrlCHeld:
    """Within: Ctrl-C waits until the block ends, then interrupts as usual. Keeps a batch's answers and the count
    of what was written together (a write never half-done, a count never off by the line just written)."""

    def __enter__(self) -> _CtrlCHeld:
        import signal

        self.pending = False
        try:
            self.old = signal.signal(signal.SIGINT, self._hold)
        except ValueError:  # not the main thread: signals are not ours to hold
            self.old = None
        return self

    def _hold(self, signum, frame) -> None:
        self.pending = True

    def __exit__(self, *exc) -> None:
        import signal

        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            if self.pending and callable(self.old):
                self.old(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt


def _run_each_line(text: str, *, model, as_json: bool, batch_size: int, device: str, dtype: str,
                   quiet: bool = False, adapters=(), compile_budget=(None, None), **gen) -> None:
    """One answer (or JSON Lines object) per input line, in input order; blank lines give blank answers.

    Each batch's answers are written and flushed as soon as it is done, so a reader sees them arrive; what is on
    stdout is always the answers to a prefix of the input, whole lines only, and Ctrl-C keeps it (exit 130, and
    stderr says how many lines were answered: the input after them is what is left to do)."""
    from .errors import Interrupted

    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start another
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not any(line.strip() for line in lines):
        raise UsageError("empty input: no non-blank line")
    model_dir = _model_dir(model, quiet)  # before torch is imported
    from .engine import load  # heavy: torch

    engine = load(model_dir, device=device, dtype=dtype, adapters=adapters)
    engine.set_compile_budget(*compile_budget)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    written = 0  # input lines answered on stdout so far
    cut_short = 0  # answers that could not complete their --json-schema / --regex
    if gen.get("structure") is not None:
        engine.automaton(gen["structure"])  # a schema the vocabulary cannot spell fails before the first line
    limit = engine.settings.override(**{k: v for k, v in gen.items()
                                        if k not in ("raw", "system", "seed", "structure")}).max_new_tokens
    try:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            result = engine.generate([lines[i] for i in chunk], **gen)
            row = {i: j for j, i in enumerate(chunk)}
            end = len(lines) if start + batch_size >= len(todo) else chunk[-1] + 1  # the last batch ends the input
            out, notices = [], []
            for i in range(written, end):
                if i in row:
                    out.append(_answer_line(result, row[i], as_json, prompt=lines[i]))
                    notice = _empty_notice(result, row[i], as_json)
                    if notice:
                        notices.append(f"line {i + 1}: {notice}")
                    if result.satisfied is not None and not result.satisfied[row[i]]:
                        cut_short += 1
                        notices.append(f"line {i + 1}: " + _cut_short(gen["structure"], limit))
                elif as_json:
                    out.append(json.dumps({"prompt": lines[i], "text": "", "skipped": True}) + "\n")
                else:
                    out.append("\n")
            with _CtrlCHeld():
                sys.stdout.write("".join(out))
                sys.stdout.flush()
                written = end
            for notice in [] if quiet else notices:
                _note(notice)
    except KeyboardInterrupt:
        sys.stdout.flush()
        if not written:
            raise Interrupted("interrupted before any line was answered") from None
        raise Interrupted(f"interrupted after answering {written} of {len(lines)} lines (their answers were "
                          "written)") from None
    if cut_short:
        _fail(f"{cut_short} of {len(todo)} answers could not be completed to match their structure", 1)


@app.command()
def chat(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_new_tokens: Optional[int] = _sampler_option("max-new-tokens"),
    steps: Optional[int] = _sampler_option("steps"),
    t_max: Optional[float] = _sampler_option("t-max"),
    t_min: Optional[float] = _sampler_option("t-min"),
    temperature: Optional[float] = TEMPERATURE_OPTION,
    entropy_bound: Optional[float] = _sampler_option("entropy-bound"),
    confidence_threshold: Optional[float] = _sampler_option("confidence-threshold"),
    stability_threshold: Optional[int] = _sampler_option("stability-threshold"),
    think: bool = typer.Option(False, "--think", help="Let the model think before answering."),
    view: str = typer.Option("live", "--view", help="live, plain or none."),
    context: Optional[int] = typer.Option(None, "--context", show_default=False,
                                          help="Tokens of conversation kept (oldest turns drop). Default: 8192, or "
                                               "the model's context if smaller."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed each turn's generation."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    adapter: Optional[List[str]] = ADAPTER_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Chat in the terminal; the KV cache carries over between turns. /help lists the commands.

    The sampler's settings (--max-new-tokens to --stability-threshold) default to the model's
    generation_config.json; /settings shows them and /set changes them during the chat."""
    sampler = _sampler_settings(max_new_tokens=max_new_tokens, max_denoising_steps=steps, t_max=t_max,
                                t_min=t_min, temperature=temperature, entropy_bound=entropy_bound,
                                confidence_threshold=confidence_threshold, stability_threshold=stability_threshold)
    _check_device_dtype(device, dtype)
    if view not in ("live", "plain", "none"):
        raise UsageError(f"--view must be live, plain or none (got {view!r})")
    if context is not None and context < 64:
        raise UsageError("--context must be at least 64")
    if not sys.stdin.isatty():
        raise UsageError("dgemma chat needs a terminal; for pipes use `dgemma run` (--each-line for many prompts)")
    adapters = _adapters(adapter)
    _be_quiet(quiet)
    model_dir = _model_dir(model, quiet)
    from .chat import run_chat
    from .engine import load

    engine = load(model_dir, device=device, dtype=dtype, adapters=adapters)
    settings = engine.settings.override(**sampler)
    raise typer.Exit(run_chat(engine, system=system, settings=settings, think=think, view=view, context=context,
                              seed=seed, quiet=quiet))


@app.command()
def fim(
    file: str = typer.Argument(..., help="The file to fill; '-' reads stdin."),
    marker: str = typer.Option("<FILL>", "--marker", help="The text that marks a hole."),
    lines: Optional[str] = typer.Option(None, "--lines", help="Regenerate lines A:B (1-based, inclusive)."),
    in_place: bool = typer.Option(False, "--in-place",
                                  help="Rewrite FILE atomically, keeping the file as it was in FILE.orig; an "
                                       "existing FILE.orig is never overwritten (then FILE.orig.1, .2, ...)."),
    no_backup: bool = typer.Option(False, "--no-backup", help="With --in-place: keep no backup."),
    to_stdout: bool = typer.Option(False, "--stdout", help="Print the whole filled file instead of a diff."),
    method: str = typer.Option("held", "--method", help="held (default), prefix or instruct."),
    held_tokens: int = typer.Option(8, "--held-tokens", help="Suffix tokens held at the end of the canvas."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Most tokens for each hole."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Most denoising steps per canvas."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed torch's generator."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Fill the holes of a file using the text on both sides. Prints a unified diff by default."""
    _be_quiet(quiet)
    from . import fim as F

    if in_place and file == "-":
        raise UsageError("--in-place needs a file, not stdin")
    if in_place and to_stdout:
        raise UsageError("--in-place and --stdout exclude each other")
    if no_backup and not in_place:
        raise UsageError("--no-backup only applies with --in-place (without it, no file is written)")
    if held_tokens < 0:
        raise UsageError("--held-tokens must be >= 0")
    if method not in F.METHODS:
        raise UsageError(f"--method must be one of {', '.join(F.METHODS)} (got {method!r})")
    from pathlib import Path

    text = F.read_source(file)
    if in_place:
        F.check_writable(Path(file), backup=not no_backup)
    name = "stdin" if file == "-" else file
    holes = [F.lines_hole(text, lines, name)] if lines else F.marker_holes(text, marker, name)
    model_dir = _model_dir(model, quiet)  # before torch is imported
    from .engine import load  # heavy: torch

    engine = load(model_dir, device=device, dtype=dtype)
    new = F.fill_holes(engine, text, holes, method=method, held_tokens=held_tokens, name=name, marker=marker,
                       warn=lambda m: None if quiet else sys.stderr.write(m + "\n"), seed=seed,
                       max_new_tokens=max_new_tokens,
                       max_denoising_steps=steps)
    if in_place:
        kept = F.save_in_place(Path(file), text, new, backup=not no_backup)
        if kept is not None and kept.name != f"{Path(file).name}.orig":
            _note(f"{file}.orig holds an earlier original and is kept; this run's original is in {kept}")
    elif to_stdout:
        sys.stdout.buffer.write(new.encode("utf-8"))
    else:
        sys.stdout.write(F.unified_diff(text, new, name))
    sys.stdout.flush()


@app.command()
def serve(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; one other than loopback needs "
                             "--api-key."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port, said on stderr)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DGEMMA_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on /v1 routes."),
    max_batch: int = typer.Option(8, "--max-batch", help="Requests generated together."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting for a slot; past it, 429."),
    prefix_cache: int = typer.Option(1024, "--prefix-cache", metavar="MB",
                                     help="Memory for encoded prompts a later request may start with (a resent "
                                     "conversation encodes only what is new); 0: off."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    allow_origin: Optional[List[str]] = typer.Option(
        None, "--allow-origin", metavar="ORIGIN", help="A web page origin (scheme://host[:port]) whose pages may "
        "call the server (CORS); repeatable; '*' for any. Default: none."),
    allow_host: Optional[List[str]] = typer.Option(
        None, "--allow-host", metavar="NAME", help="A name clients may reach the server by (its Host header), "
        "besides the --host address and localhost; repeatable; '*' for any."),
    adapter: Optional[List[str]] = typer.Option(
        None, "--adapter", metavar="NAME=DIR[:SCALE]", help="Serve a LoRA adapter (PEFT's format) as the model id "
        "NAME beside the base; repeatable. Requests choose by 'model'; requests for different adapters share a "
        "batch."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", metavar="SECONDS",
                                         help="Close a connection that has not sent a whole request line and "
                                         "headers within this time."),
    compile_timeout: float = COMPILE_TIMEOUT_OPTION,
    compile_memory: float = COMPILE_MEMORY_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """An OpenAI-compatible HTTP server (chat, completions with suffix infill, models), batching requests."""
    _be_quiet(quiet)
    named = []
    for a in adapter or []:
        name, sep, where = a.partition("=")
        if not sep or not name or not where:
            raise UsageError(f"--adapter {a}: give it as NAME=DIR (the model id clients send, then the adapter)")
        if not all(c.isalnum() or c in "-_.:/" for c in name) or len(name) > 128:
            raise UsageError(f"--adapter {a}: NAME may hold letters, digits and - _ . : / only")
        if name in (n for n, _, _ in named):
            raise UsageError(f"--adapter {name}: named twice")
        from .names import resolve_adapter

        named.append((name, *resolve_adapter(where)))
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535 (got {port})")
    if max_batch < 1:
        raise UsageError("--max-batch must be at least 1")
    if max_queue < 0:
        raise UsageError("--max-queue must be at least 0")
    if prefix_cache < 0:
        raise UsageError("--prefix-cache must be at least 0 (MB; 0 turns it off)")
    if not 0 < header_timeout <= 3600:  # NaN too
        raise UsageError(f"--header-timeout must be between 0 and 3600 seconds (got {header_timeout:g})")
    budget = _compile_budget(compile_timeout, compile_memory)
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key must not be empty")
    if not is_loopback(host) and not api_key:
        raise UsageError(f"--host {host} can be reached from other machines: pass --api-key KEY (or set "
                         "DGEMMA_API_KEY)")
    _check_device_dtype(device, dtype)
    model = _model_dir(model, quiet)  # before torch is imported
    from .serve import serve as run_server  # heavy: torch, starlette, uvicorn

    raise typer.Exit(run_server(model, host=host, port=port, api_key=api_key, max_batch=max_batch,
                                max_queue=max_queue, device=device, dtype=dtype, note=_note,
                                prefix_cache_bytes=prefix_cache * 2**20, adapters=named,
                                allow_hosts=tuple(allow_host or ()), allow_origins=tuple(allow_origin or ()),
                                header_timeout=header_timeout, compile_budget=budget))


# ----------------------------------------------------------------------------- weights: pull, store, quantize


def _be_quiet(quiet: bool) -> None:
    global _quiet
    _quiet = quiet
    if quiet:
        import warnings

        warnings.simplefilter("ignore")  # a library's warning is a notice too


def _note(message: str) -> None:
    if not _quiet:
        sys.stderr.write(f"dgemma: {message}\n")


def _gb(n: int) -> str:
    """Bytes in decimal units (1 GB = 1e9 bytes)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@app.command()
def tune(
    data: str = typer.Argument(..., metavar="DATA.jsonl", help="Training examples, one JSON object per line: "
                               "{\"messages\": [...]}, {\"prompt\", \"completion\"} or "
                               "{\"prefix\", \"middle\", \"suffix\"}."),
    out: str = typer.Option(..., "--out", "-o", metavar="DIR", help="Where the adapter goes (PEFT's format); its "
                            "state in DIR/.tune lets a stopped run resume."),
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
    held_out: int = typer.Option(64, "--held-out", help="Examples of DATA kept apart when there is no --eval."),
    eval_every: int = typer.Option(100, "--eval-every", help="Steps between held-out evaluations."),
    eval_examples: int = typer.Option(32, "--eval-examples", help="Held-out answers generated at each "
                                      "evaluation for the exact-answer rate."),
    eval_steps: Optional[int] = typer.Option(None, "--eval-steps", help="Denoising steps per canvas for those "
                                             "answers (default: the model's)."),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", help="Steps between saved states."),
    raw: bool = typer.Option(False, "--raw", help="Prompts of prompt/completion lines as raw text (no chat "
                             "template)."),
    restart: bool = typer.Option(False, "--restart", help="Start over even if DIR holds a stopped run's state."),
    checkpointing: bool = typer.Option(True, "--gradient-checkpointing/--no-gradient-checkpointing",
                                       help="Recompute each layer's feed-forward stage in the backward pass instead "
                                       "of keeping it (less memory, about a third more compute; the same adapter)."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Tune a LoRA adapter with the model's own objective (noised canvases, self-conditioning) on a frozen base.

    Prints the memory it needs before it starts, the training loss as it goes, and the held-out loss and
    exact-answer rate every --eval-every steps. Ctrl-C or a crash loses at most --checkpoint-every steps: run the
    same command again to resume. The adapter runs with `dgemma run --adapter DIR` and loads in peft."""
    from pathlib import Path

    _check_device_dtype(device, dtype)
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
    _be_quiet(quiet)
    model_dir = _model_dir(model, quiet)
    from .engine import load
    from .tune import Tuner, TuneSettings, load_state, memory_estimate, read_examples

    engine = load(model_dir, device=device, dtype=dtype)  # auto: float32 on the CPU, bfloat16 on a GPU
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
    out_dir = Path(out).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out}: not a directory")
    state = None if restart else load_state(out_dir)
    from .lora import AdapterError

    try:
        tuner = Tuner(engine, examples, out_dir, settings, base_name=str(model or "demo"), held=held,
                      report=_tune_reporter(quiet))
    except AdapterError as e:
        raise UsageError(str(e)) from None
    if state is not None:
        tuner.restore(state)
        _note(f"resuming {out_dir} at step {tuner.step} of {steps}")
    engine.model.checkpointing = checkpointing
    longest = max(len(e.prompt) + len(e.answer) for e in examples)
    est = memory_estimate(engine.model, tuner.adapter, settings, longest, checkpointing)
    _note(f"{len(tuner.train):,} training examples, {len(tuner.held):,} held out; adapter: "
          f"{est['parameters']:,} parameters; memory (estimate): base {_gb(est['base'])}, adapter with AdamW "
          f"{_gb(est['adapter'])}, activations up to {_gb(est['activations'])}: {_gb(est['total'])} in all")
    if engine.model.device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(engine.model.device)
        if est["total"] > free:
            _note(f"that is more than the {_gb(free)} free on the GPU: try a smaller --batch-size, shorter examples"
                  + (", or --gradient-checkpointing" if not checkpointing else ""))
    from .errors import Interrupted

    try:
        tuner.run()
    except KeyboardInterrupt:
        kept = f"the state at step {tuner.saved} is kept" if tuner.saved else "no state was saved yet"
        raise Interrupted(f"interrupted; {kept}: run the same command again to resume") from None
    _note(f"adapter written to {out_dir} (run it: dgemma run --model {model or 'demo'} --adapter {out_dir} ...)")


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


@app.command()
def pull(
    repo: str = typer.Argument("google/diffusiongemma-26B-A4B-it", help="Hub repository id (OWNER/NAME)."),
    quant: str = typer.Option("auto", "--quant", help="auto (from free GPU memory), bf16, fp8, int8 or nvfp4."),
    revision: Optional[str] = typer.Option(None, "--revision",
                                           help="Branch, tag or commit (default: main). An entry already stored "
                                                "from another commit is not replaced: it says how."),
    policy: Optional[str] = typer.Option(None, "--policy",
                                         help="What fp8/int8/nvfp4 quantize: experts or all (+ attention, dense MLP); "
                                              "default as published: all for fp8/int8, experts for nvfp4."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Download a model from the Hub into the store: a published quantized release as published, an unquantized one
    quantized to --quant (on the GPU when there is one). HF_TOKEN, HF_HOME and HF_HUB_OFFLINE apply."""
    _be_quiet(quiet)
    from .errors import Interrupted
    from .store import pull as do_pull

    try:
        entry = do_pull(repo, quant, revision, policy, progress=sys.stderr.isatty() and not quiet, note=_note)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; run the same command again to continue (finished files are kept)") from None
    if entry is not None:
        _note(f"stored {entry.name} ({_gb(entry.size)}) in {entry.path}")
        sys.stdout.write(f"{entry.name}\n")


@app.command("list")
def list_models(as_json: bool = typer.Option(False, "--json", help="JSON Lines instead of a table."),
                quiet: bool = QUIET_OPTION) -> None:
    """The models in the store, and the small demo models bundled with dgemma."""
    _be_quiet(quiet)
    from .names import BUNDLED, BUNDLED_ABOUT, BUNDLED_ADAPTERS, BUNDLED_ADAPTERS_ABOUT
    from .store import entries, store_root

    found = entries()
    bundled = [(name, path, sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
               for name, path in BUNDLED.items()]
    adapters = [(name, path, sum(f.stat().st_size for f in path.iterdir() if f.is_file()))
                for name, path in BUNDLED_ADAPTERS.items() if path.is_dir()]
    if as_json:
        for name, path, size in bundled:
            sys.stdout.write(json.dumps({"name": name, "format": "unquantized", "size": size, "path": str(path),
                                         "bundled": True, "about": BUNDLED_ABOUT[name]}) + "\n")
        for name, path, size in adapters:
            base, about = BUNDLED_ADAPTERS_ABOUT[name]
            sys.stdout.write(json.dumps({"name": name, "format": "lora", "size": size, "path": str(path),
                                         "bundled": True, "adapter_of": base, "about": about}) + "\n")
        for e in found:
            row = {"name": e.name, "format": e.quant, "size": e.size, "path": str(e.path),
                   "revision": e.manifest["store"].get("revision")}
            if e.quant == "lora":
                row["adapter_of"] = e.manifest["store"].get("adapter_of")
            sys.stdout.write(json.dumps(row) + "\n")
        return
    width = max(len(n) for n in [*BUNDLED, *BUNDLED_ADAPTERS, *(e.name for e in found)])
    sys.stdout.write(f"{'NAME':<{width}}  {'SIZE':>9}  WHERE\n")
    for e in found:
        of = e.manifest["store"].get("adapter_of") if e.quant == "lora" else None
        sys.stdout.write(f"{e.name:<{width}}  {_gb(e.size):>9}  {e.path}"
                         + (f" (LoRA adapter of {of})" if of else " (LoRA adapter)" if e.quant == "lora" else "")
                         + "\n")
    for name, _, size in bundled:
        sys.stdout.write(f"{name:<{width}}  {_gb(size):>9}  bundled: {BUNDLED_ABOUT[name]}\n")
    for name, _, size in adapters:
        base, about = BUNDLED_ADAPTERS_ABOUT[name]
        sys.stdout.write(f"{name:<{width}}  {_gb(size):>9}  bundled LoRA adapter of {base}: {about}\n")
    if not found and not quiet:
        _note(f"the store is empty ({store_root()}); `dgemma pull` fetches a model")


app.command("ls", hidden=True, help="The same as `dgemma list` (as in ollama).")(list_models)


@app.command()
def info(
    model: str = typer.Argument(..., help="A store name, a model directory, or 'demo'."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Format, sizes, estimated GPU memory and location of a model; or what a LoRA adapter adapts."""
    _be_quiet(quiet)
    from .names import resolve_model
    from .store import describe

    if _is_adapter(model):
        return _adapter_info(model, as_json)
    path = resolve_model(_model_dir(model))
    d = describe(path)
    if as_json:
        sys.stdout.write(json.dumps(d) + "\n")
        return
    _info_rows(d)


def _is_adapter(ref: str) -> bool:
    """Whether `info`/`show` REF names a LoRA adapter (bundled, a directory holding one, or a store entry)."""
    from pathlib import Path

    from .names import ADAPTER_CONFIG, BUNDLED_ADAPTERS, STORE_NAME, find

    return ref in BUNDLED_ADAPTERS or (Path(ref).expanduser() / ADAPTER_CONFIG).is_file() or bool(
        STORE_NAME.match(ref) and any(e.quant == "lora" for e in find(ref)))


def _adapter_info(ref: str, as_json: bool) -> None:
    """`dgemma info` of a LoRA adapter: its base, rank, targets, tensors and size (read from its files only)."""
    from .lora import read_adapter
    from .names import BUNDLED_ADAPTERS_ABOUT, resolve_adapter

    path, _ = resolve_adapter(ref)
    ad = read_adapter(path)
    ranks = sorted({a.shape[0] for a, _, _ in ad.linears.values()})
    modules = sorted({name.split(".", 2)[-1] if name.startswith("layers.") else name for _, name in ad.linears})
    base = BUNDLED_ADAPTERS_ABOUT[ref][0] if ref in BUNDLED_ADAPTERS_ABOUT else ad.base or "(not recorded)"
    d = {"path": str(path), "format": "lora (PEFT)", "base": base, "ranks": ranks, "modules": modules,
         "experts": bool(ad.experts), "token_rows": sorted({i for ids, _ in ad.tokens.values() for i in ids}),
         "alpha": ad.config.get("lora_alpha"), "size_on_disk": sum(f.stat().st_size for f in path.iterdir()
                                                                    if f.is_file())}
    if as_json:
        sys.stdout.write(json.dumps(d) + "\n")
        return
    rows = [("path", d["path"]), ("format", d["format"]), ("adapts", d["base"]),
            ("rank", ", ".join(map(str, ranks)) or "-"), ("alpha", d["alpha"]),
            ("modules", ", ".join(modules) or "-"), ("routed experts", "yes" if d["experts"] else "no"),
            ("size on disk", _gb(d["size_on_disk"]))]
    if d["token_rows"]:
        rows.append(("token rows", ", ".join(map(str, d["token_rows"]))))
    _write_rows(rows)


def _write_rows(rows: list[tuple[str, object]]) -> None:
    """`dgemma info`'s "name:   value" lines."""
    for k, v in rows:
        sys.stdout.write(f"{k + ':':<24}{v}\n")


def _info_rows(d: dict) -> None:
    src = d["source"]
    fmt = d["format"] + (f" ({', '.join(d['quantized'])} quantized)" if d["quantized"] else
                         f" ({d['dtype_on_disk']} on disk)")
    rows = [("path", d["path"]), ("format", fmt)] + ([("scheme", d["scheme"])] if d["scheme"] else []) + [
            ("size on disk", _gb(d["size_on_disk"])), ("weights in memory", _gb(d["weights_in_memory"])),
            ("GPU memory, 8k context", f"{_gb(d['gpu_memory_estimate_8k'])} (estimate)"),
            ("shape", f"{d['layers']} layers, {d['experts']} experts, vocabulary {d['vocab']}"),
            ("images", f"yes (vision tower, {_gb(d['vision_tower_on_disk'])} on disk)" if d["images"]
             else f"no ({d['no_images_because'].removeprefix(d['path'] + ': ')})")]
    if src:
        rows.append(("source", f"{src.get('repo')} @ {str(src.get('revision'))[:12]}"
                               + (" (as published)" if src.get("published") else "")))
    _write_rows(rows)


@app.command()
def show(
    model: str = typer.Argument(..., help="A store name, a model directory, or a bundled model ('demo', ...)."),
    template: bool = typer.Option(False, "--template", help="Only the chat template, as the model ships it."),
    parameters: bool = typer.Option(False, "--parameters", help="Only the sampler's defaults, one per line."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: info, parameters, template."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """What a model is: its format and sizes (as `info`), the sampler's defaults it brings and its chat template.
    For a LoRA adapter: what it adapts (as `info`)."""
    _be_quiet(quiet)
    if _is_adapter(model):
        if template or parameters:
            raise UsageError(f"{model} is a LoRA adapter: it has no chat template or sampler settings of its own "
                             "(those of the model it adapts apply)")
        return _adapter_info(model, as_json)
    from .config import SAMPLER_FLAGS, GenerationSettings, ModelConfig
    from .errors import ModelError
    from .names import resolve_model
    from .store import describe
    from .tokenizer import Tokenizer

    if template and parameters:
        raise UsageError("--template and --parameters exclude each other (neither: both, and the rest)")
    path = resolve_model(_model_dir(model))
    cfg = ModelConfig.from_dir(path)
    settings = GenerationSettings.from_checkpoint(path, cfg.text)
    params = {flag: getattr(settings, name) for flag, (name, _, _) in SAMPLER_FLAGS.items()}
    params.update({"canvas-length": cfg.canvas_length, "context": cfg.text.max_position_embeddings,
                   "eos-token-ids": list(settings.eos_token_ids)})
    tok = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    chat_template = tok.chat_template if tok is not None else None
    if template:
        if chat_template is None:
            raise ModelError(f"{path}: no tokenizer.json, so no chat template")
        sys.stdout.write(chat_template if chat_template.endswith("\n") else chat_template + "\n")
        return
    if parameters:
        for k, v in params.items():
            sys.stdout.write(f"{k:<24}{' '.join(map(str, v)) if isinstance(v, list) else v}\n")
        return
    d = describe(path)
    if as_json:
        sys.stdout.write(json.dumps({**d, "parameters": params, "template": chat_template,
                                     "template_from": tok.template_origin if tok else None}) + "\n")
        return
    _info_rows(d)
    sys.stdout.write("\nparameters (the model's defaults; the flags of the same names change them):\n")
    for k, v in params.items():
        sys.stdout.write(f"  {k:<22}{' '.join(map(str, v)) if isinstance(v, list) else v}\n")
    where = tok.template_origin if tok else "no tokenizer.json"
    sys.stdout.write(f"\ntemplate ({where}; `dgemma show {model} --template` prints it whole):\n")
    for line in (chat_template or "").splitlines()[:8]:
        sys.stdout.write(f"  {line}\n")


@app.command()
def rm(
    model: str = typer.Argument(..., help="A store name [OWNER/]NAME[:QUANT]."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Remove a model from the store (never touches directories outside it)."""
    _be_quiet(quiet)
    from .store import find, remove, store_root

    found = find(model)
    from .names import BUNDLED

    if model in BUNDLED:  # as everywhere a model is named, 'demo' is the bundled one, never a store entry
        same = f"; to remove the store's {', '.join(e.name for e in found)}, give its full name" if found else ""
        raise UsageError(f"{model} is a bundled demo model, part of dgemma itself: it cannot be removed{same}")
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
    quant: str = typer.Option(..., "--quant", help="nvfp4 (ModelOpt), fp8 or int8 (compressed-tensors W8A8)."),
    out: str = typer.Option(..., "--out", help="The new directory to write (must not exist)."),
    policy: Optional[str] = typer.Option(None, "--policy",
                                         help="experts or all (+ attention, dense MLP); default as published: all "
                                              "for fp8/int8, experts for nvfp4."),
    scales: str = typer.Option("auto", "--scales", help="auto, absmax or search (block scales chosen by error)."),
    device: str = typer.Option("auto", "--device", help="Where to compute: cpu, cuda or auto."),
    quiet: bool = QUIET_OPTION,
) -> None:
    """Quantize a local checkpoint, streaming and resumable: run it again after an interruption to continue."""
    _be_quiet(quiet)
    from pathlib import Path

    from .errors import Interrupted

    if scales not in ("auto", "absmax", "search"):
        raise UsageError(f"--scales must be auto, absmax or search (got {scales!r})")
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda or auto (got {device!r})")
    from .names import POLICIES, QUANTS, resolve_model

    if quant not in QUANTS or quant == "bf16":
        raise UsageError(f"--quant must be one of {', '.join(q for q in QUANTS if q != 'bf16')} (got {quant!r})")
    if policy is not None and policy not in POLICIES:
        raise UsageError(f"--policy must be one of {', '.join(POLICIES)} (got {policy!r})")
    source = resolve_model(_model_dir(src))  # checked before torch is imported
    from .quantize import quantize_checkpoint

    search = None if scales == "auto" else scales == "search"
    try:
        manifest = quantize_checkpoint(source, Path(out), quant, policy, search, device,
                                       progress=sys.stderr.isatty() and not quiet, note=_note)
    except KeyboardInterrupt:
        raise Interrupted("interrupted; run the same command again to continue where it stopped") from None
    _note(f"wrote {out} ({quant}, policy {manifest['quantize']['policy']}, {_gb(manifest['total_bytes'])})")


@app.command()
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
    quiet: bool = QUIET_OPTION,
) -> None:
    """Time the denoise step on random weights (no download) against the weight-read floor. Each phase is said on
    stderr when it is a terminal (stdout keeps only the table or the JSON object)."""
    _be_quiet(quiet)
    from .bench import as_dict, run_bench

    def note(message: str) -> None:
        _note(f"bench: {message}")
        sys.stderr.flush()

    result = run_bench(config, fmt, policy, batch, prompt, steps, canvases, device, dtype, compare,
                       note=note if sys.stderr.isatty() and not quiet else None)
    sys.stdout.write((json.dumps(as_dict(result)) if as_json else result.table()) + "\n")


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
    if (sys.argv[1:] if argv is None else list(argv)) == ["--version"]:
        # answered before Typer converts any parameter (which imports pydantic): about 0.1 s of 0.25 s
        from . import __version__

        sys.stdout.write(f"dgemma {__version__}\n")
        raise SystemExit(0)
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
    except SystemExit as e:
        # Click answers a write to a closed pipe (`dgemma run ... | head -n 1`) with exit 1 and nothing said, after
        # wrapping stdout in its (_)PacifyFlushWrapper (the name depends on click's version): the reader left,
        # which is no failure of ours.
        if e.code == 1 and type(sys.stdout).__name__.lstrip("_") == "PacifyFlushWrapper":
            raise SystemExit(0) from None
        raise
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
