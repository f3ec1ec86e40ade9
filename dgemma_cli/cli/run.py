"""`dgemma run`: one answer, a batch of lines (--each-line), or a conversation when a person runs it bare."""

from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

from ..errors import UsageError
from .chat import chat
from .options import (
    ADAPTER_OPTION,
    COMPILE_MEMORY_OPTION,
    COMPILE_TIMEOUT_OPTION,
    DEVICES_OPTION,
    GPU_MEMORY_OPTION,
    MODEL_HELP,
    QUIET_OPTION,
    TEMPERATURE_OPTION,
    adapter_args,
    be_quiet,
    check_device_dtype,
    compile_budget,
    fail,
    devices_arg,
    gpu_memory_arg,
    model_arg,
    note,
    note_placement,
    prompt_words,
    read_prompt,
    sampler_option,
    sampler_settings,
)


def run(
    prompt: Optional[List[str]] = typer.Argument(
        None, metavar="PROMPT",
        help="The prompt; several words are joined with spaces. Read from stdin when absent or '-'."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    max_new_tokens: Optional[int] = sampler_option("max-new-tokens"),
    steps: Optional[int] = sampler_option("steps"),
    t_max: Optional[float] = sampler_option("t-max"),
    t_min: Optional[float] = sampler_option("t-min"),
    temperature: Optional[float] = TEMPERATURE_OPTION,
    entropy_bound: Optional[float] = sampler_option("entropy-bound"),
    confidence_threshold: Optional[float] = sampler_option("confidence-threshold"),
    stability_threshold: Optional[int] = sampler_option("stability-threshold"),
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
    gpu_memory: Optional[str] = GPU_MEMORY_OPTION,
    devices: Optional[str] = DEVICES_OPTION,
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
    check_device_dtype(device, dtype)
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
    sampler = sampler_settings(max_new_tokens=max_new_tokens, max_denoising_steps=steps, t_max=t_max,
                                t_min=t_min, temperature=temperature, entropy_bound=entropy_bound,
                                confidence_threshold=confidence_threshold, stability_threshold=stability_threshold)
    adapters = adapter_args(adapter)
    budget = compile_budget(compile_timeout, compile_memory)
    card_bytes = gpu_memory_arg(gpu_memory)
    cards = devices_arg(devices)
    be_quiet(quiet)
    joined = prompt_words(prompt)
    structure = _structure(json_schema, regex, grammar, stdin_prompt=joined is None)
    if (joined is None and sys.stdin is not None and sys.stdin.isatty() and sys.stdout.isatty()
            and not (as_json or each_line or raw or image)):
        # No prompt, and a person at a terminal: a conversation, as `ollama run` and `llm` start one.
        note("no prompt given: starting `dgemma chat` (Ctrl-D leaves)")
        return chat(model=model, system=system, max_new_tokens=max_new_tokens, steps=steps, t_max=t_max,
                    t_min=t_min, temperature=temperature, entropy_bound=entropy_bound,
                    confidence_threshold=confidence_threshold, stability_threshold=stability_threshold, think=False,
                    view=view or "live", context=None, seed=seed, device=device, dtype=dtype, adapter=adapter,
                    gpu_memory=gpu_memory, devices=devices, quiet=quiet)
    _check_images(image or [], image_tokens, stdin_prompt=joined is None, each_line=each_line)
    text = read_prompt(joined)
    if joined is None and not raw and not each_line:
        text = text.rstrip("\r\n")  # `echo ... |` adds a newline the user did not mean as part of the prompt
    if each_line:
        return _run_each_line(text, model=model, as_json=as_json, batch_size=batch_size or 8, device=device,
                              dtype=dtype, quiet=quiet, raw=raw, system=system, seed=seed, structure=structure,
                              adapters=adapters, compile_budget=budget, gpu_memory=card_bytes, devices=cards,
                              **sampler)
    if not text.strip():
        raise UsageError("empty prompt")
    model_dir = model_arg(model, quiet)  # a missing model is said before torch is imported (seconds)
    images = _read_images(image or [], model_dir)  # bad images fail here, before the model loads
    from .view import choose_view  # progress goes to stderr, for a person watching it (view.choose_view)

    view = choose_view(view, stdout_tty=sys.stdout.isatty(), stderr_tty=sys.stderr.isatty(),
                       term=os.environ.get("TERM"), as_json=as_json, quiet=quiet)
    import time

    from ..engine import load  # heavy: torch

    engine = load(model_dir, device=device, dtype=dtype, adapters=adapters, gpu_memory=card_bytes, devices=cards)
    note_placement(engine)
    engine.set_compile_budget(*budget)
    kwargs = dict(raw=raw, system=system, seed=seed, **sampler)
    if structure is not None:
        kwargs.update(structure=structure)
    if images:
        kwargs.update(images=images, image_tokens=image_tokens)
    from ..answer import FinishedCanvases

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
        from ..sampler import CanvasDone

        if isinstance(event, CanvasDone) and finished is not None:
            finished.add(event.tokens[0].tolist(), int(event.steps[0]), int(event.kept[0]))

    from .view import Board

    board = Board.from_hint(engine.view_hints.get("board"), engine.config.canvas_length)  # the checkpoint's layout
    if board is not None:  # a prompt the board's model cannot read is said, whatever the view
        board, warning = board.read_prompt(text)
        if warning:
            note(warning)
    t0 = time.perf_counter()
    try:
        if structure is not None:
            # compiled before the first step: a schema the vocabulary cannot spell, or whose shortest answer cannot
            # fit --max-tokens, fails in one line
            engine.automaton(structure, max_tokens=engine.settings.override(**sampler).max_new_tokens)
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
        fail(_cut_short(structure, engine.settings.override(**sampler).max_new_tokens), 1)
    notice = _empty_notice(result, 0, as_json)
    if notice and not quiet:
        note(notice)


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
    from ..structured.constrain import Structure

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
    try:
        structure.check()  # UsageError in one line
    except UsageError as e:
        if flag == "--regex" or value == "-":
            raise
        raise UsageError(f"{flag} {value}: {e}") from None  # the file named
    return structure


def _cut_short(structure, limit: int) -> str:
    what = {"regex": "--regex", "grammar": "--grammar"}.get(structure.kind, "--json-schema")
    return (f"the answer could not be completed to match {what} within --max-new-tokens {limit}: what was written "
            "is cut short (raise --max-new-tokens)")


def _check_images(paths: List[str], image_tokens: Optional[int], *, stdin_prompt: bool, each_line: bool) -> None:
    """--image / --image-tokens combinations, checked before anything is read."""
    from ..config import IMAGE_TOKEN_BUDGETS

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
    from ..checkpoint.names import resolve_model
    from ..config import ModelConfig
    from ..errors import ModelError

    directory = resolve_model(model_dir)
    if (directory / "config.json").is_file() and ModelConfig.from_dir(directory).vision is None:
        raise ModelError(f"{directory}: this model has no vision tower, so it cannot read images")
    from ..checkpoint.layout import check_images

    check_images(directory)  # a store entry holding only the text model: how to replace it, in one line
    from ..image import open_image

    if "-" in paths and (sys.stdin is None or sys.stdin.isatty()):
        raise UsageError("--image -: pipe the image on stdin")
    return [open_image(sys.stdin.buffer.read(), name="stdin") if p == "-" else open_image(p) for p in paths]


def _partial_answer(engine, text: str, finished, seconds: float, *, raw: bool, system: Optional[str],
                    images: list = ()) -> dict:
    """The JSON object of an interrupted run: its finished canvases (answer.FinishedCanvases; None or none yet: an
    empty answer), cut and counted as a whole answer's are, with "interrupted": true."""
    from ..sampler import tokens_per_forward

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
        if result.satisfied is not None:  # held to a structure: whether the answer completed it (false: cut short)
            obj["satisfied"] = bool(result.satisfied[i])
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
                   quiet: bool = False, adapters=(), compile_budget=(None, None), gpu_memory: int | None = None,
                   devices=None, **gen) -> None:
    """One answer (or JSON Lines object) per input line, in input order; blank lines give blank answers.

    Each batch's answers are written and flushed as soon as it is done, so a reader sees them arrive; what is on
    stdout is always the answers to a prefix of the input, whole lines only, and Ctrl-C keeps it (exit 130, and
    stderr says how many lines were answered: the input after them is what is left to do)."""
    from ..errors import Interrupted

    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start another
    lines = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not any(line.strip() for line in lines):
        raise UsageError("empty input: no non-blank line")
    model_dir = model_arg(model, quiet)  # before torch is imported
    from ..engine import load  # heavy: torch

    engine = load(model_dir, device=device, dtype=dtype, adapters=adapters, gpu_memory=gpu_memory,
                  batch=batch_size, devices=devices, batch_flag="--batch-size")
    note_placement(engine)
    engine.set_compile_budget(*compile_budget)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    written = 0  # input lines answered on stdout so far
    cut_short = 0  # answers that could not complete their --json-schema / --regex
    limit = engine.settings.override(**{k: v for k, v in gen.items()
                                        if k not in ("raw", "system", "seed", "structure")}).max_new_tokens
    if gen.get("structure") is not None:  # a schema the vocabulary cannot spell, or too long for max_tokens, fails
        engine.automaton(gen["structure"], max_tokens=limit)  # before the first line
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
                note(notice)
    except KeyboardInterrupt:
        sys.stdout.flush()
        if not written:
            raise Interrupted("interrupted before any line was answered") from None
        raise Interrupted(f"interrupted after answering {written} of {len(lines)} lines (their answers were "
                          "written)") from None
    if cut_short:
        fail(f"{cut_short} of {len(todo)} answers could not be completed to match their structure", 1)
