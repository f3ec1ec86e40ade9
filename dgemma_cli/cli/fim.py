"""`dgemma fim`: fill holes in a text file using the text on both sides of each hole.

The rule: this module knows files, holes and text; generation is the engine's (`Engine.infill`). Text outside the
holes is never re-encoded: the file is decoded once (UTF-8, line endings and all), each hole's span is replaced by
the generated middle, and the result is encoded back, so every other byte is preserved.

Methods (BENCHMARKS.md compares them on the demo model's infill task):
- held (default): the prefix goes through the encoder; the first `held_tokens` tokens after the hole are held fixed
  at the end of the canvas; the middle is denoised in front of them and ends at `<pad>` or an end token.
- prefix: the same without the held suffix (the model sees only what comes before the hole).
- instruct: an instruction through the chat template with the file, the hole written as the marker.

`--in-place` keeps the file as it was in a backup written before the file is replaced: FILE.orig, and when that
exists it is never overwritten (the first original stays there); the backup then goes to FILE.orig.1, .2, ...
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from .options import MODEL_HELP, QUIET_OPTION, be_quiet, model_arg, note

DEFAULT_MARKER = "<FILL>"
METHODS = ("held", "prefix", "instruct")


class FileError(UsageError):
    """A file that cannot be filled (missing, unreadable, binary, not UTF-8, no hole) or written back: bad input,
    exit 2, as for every input file (`run --image` too)."""


@dataclass
class Hole:
    start: int  # character offsets into the text: text[start:end] is replaced
    end: int


def read_source(path: str) -> str:
    """The file's text, decoded exactly (no newline translation). '-' reads stdin."""
    if path == "-":
        data = sys.stdin.buffer.read()
        name = "stdin"
    else:
        p = Path(path)
        if not p.exists():
            raise FileError(f"{path}: no such file")
        if not p.is_file():
            raise FileError(f"{path}: not a regular file")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise FileError(f"{path}: cannot read ({e.strerror or e})") from None
        name = path
    if not data:
        raise FileError(f"{name}: empty file, nothing to fill")
    if b"\0" in data:
        raise FileError(f"{name}: binary file (contains NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(f"{name}: not UTF-8 text (byte {e.start})") from None


def marker_holes(text: str, marker: str, name: str) -> list[Hole]:
    if not marker:
        raise UsageError("--marker must not be empty")
    holes, at = [], text.find(marker)
    while at >= 0:
        holes.append(Hole(at, at + len(marker)))
        at = text.find(marker, at + len(marker))
    if not holes:
        raise FileError(f"{name}: no {marker} marker (or pass --lines A:B)")
    return holes


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split at '\n' only (as editors and `wc -l` count them)."""
    return [x for x in re.split(r"(?<=\n)", text) if x]


def lines_hole(text: str, spec: str, name: str) -> Hole:
    """--lines A:B (1-based, inclusive): the text of those lines is regenerated; the last one's line ending
    (\n or \r\n) is kept, so the lines after it stay where they are."""
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise UsageError(f"--lines must look like A:B, two line numbers (got {spec!r})") from None
    lines = split_lines(text)
    if a < 1 or b < 1:
        raise UsageError(f"--lines {spec}: lines count from 1 (the first line is 1:1)")
    if b < a:
        raise UsageError(f"--lines {spec}: the end ({b}) is before the start ({a}); A:B needs A <= B "
                         f"(--lines {b}:{a}?)")
    if b > len(lines):
        has = f"{len(lines)} line" + ("" if len(lines) == 1 else "s")
        raise UsageError(f"--lines {spec}: {name} has only {has}" if a <= len(lines)
                         else f"--lines {spec}: {name} has {has}, so line {a} is past its end")
    start = sum(len(x) for x in lines[: a - 1])
    end = start + sum(len(x) for x in lines[a - 1 : b])
    last = lines[b - 1]
    ending = len(last) - len(last.rstrip("\r\n")) if last.endswith("\n") else 0
    return Hole(start, end - ending)


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def fill_holes(engine, text: str, holes: list[Hole], *, method: str = "held", held_tokens: int = 8,
               name: str = "file", marker: str = DEFAULT_MARKER, warn=None, **gen) -> str:
    """Fill holes in order; returns the new text. `gen`: seed, max_new_tokens, max_denoising_steps.

    `warn` gets one line for a prefix cut to fit the context, and one naming the holes filled with nothing."""
    if method not in METHODS:
        raise UsageError(f"--method must be one of {', '.join(METHODS)}")
    tok = engine.tokenizer
    # Check every hole before generating anything: a later marker inside an earlier hole's held window
    # would be held as literal text.
    for k in range(len(holes) - 1):
        between = text[holes[k].end : holes[k + 1].start]
        if method == "held" and len(tok.encode_text(between)) < held_tokens:
            raise UsageError(f"{name}: the marker on line {line_of(text, holes[k + 1].start)} is inside the held "
                             f"suffix of the hole before it (keep {held_tokens} tokens between holes)")
    out, shift, empty = text, 0, []
    for k, hole in enumerate(holes):
        start, end = hole.start + shift, hole.end + shift
        prefix = out[:start]
        next_start = holes[k + 1].start + shift if k + 1 < len(holes) else len(out)
        suffix = out[end:next_start]
        held = held_tokens if method == "held" else 0
        prefix = fit_prefix(engine, prefix, name, warn, gen.get("max_new_tokens"), held)
        if method == "instruct":
            middle = instruct_fill(engine, prefix, suffix, marker, **gen)
        else:
            middle = engine.infill(prefix, suffix, held_tokens=held, **gen)
        out = out[:start] + middle + out[end:]
        shift += len(middle) - (hole.end - hole.start)
        if not middle:
            empty.append(line_of(text, hole.start))
    if empty and warn:
        warn(f"dgemma: {name}: {empty_note(empty, len(holes))}")
    return out


def empty_note(lines: list[int], total: int) -> str:
    """What to say when holes were filled with nothing (lines: where each such hole starts in the input)."""
    if total == 1:
        return f"the model produced no text for the hole on line {lines[0]}; it is now empty"
    where = f"line {lines[0]}" if len(lines) == 1 else f"lines {', '.join(map(str, lines))}"
    it = "it is" if len(lines) == 1 else "they are"
    return f"the model produced no text for {len(lines)} of {total} holes ({where}); {it} now empty"


def fit_prefix(engine, prefix: str, name: str, warn, max_new_tokens, held: int = 0) -> str:
    """Keep the end of a prefix too long for the context (the text nearest the hole matters most).

    The budget leaves room for <bos> and every canvas the hole may take (each yields C - held tokens). The
    instruct method's instruction and chat template are not counted."""
    settings = engine.settings.override(max_new_tokens=max_new_tokens)
    C = engine.config.canvas_length
    budget = engine.config.text.max_position_embeddings - settings.canvases_for(C - held) * C - 1
    ids = engine.tokenizer.encode_text(prefix)
    if len(ids) <= budget:
        return prefix
    if budget < 1:
        raise UsageError(f"{name}: --max-new-tokens leaves no room for text before the hole in the context")
    kept = engine.tokenizer.decode(ids[-budget:])
    if warn:
        warn(f"dgemma: {name}: kept the last {budget} of {len(ids)} tokens before the hole (context limit)")
    return kept


def instruct_fill(engine, prefix: str, suffix: str, marker: str, **gen) -> str:
    prompt = (f"Replace {marker} in this text with the missing part. Answer with the missing part only.\n\n"
              f"{prefix}{marker}{suffix}")
    return engine.generate(prompt, **gen).texts[0]


def unified_diff(old: str, new: str, name: str) -> str:
    a, b = (name, name) if os.path.isabs(name) else (f"a/{name}", f"b/{name}")
    out = []
    for line in difflib.unified_diff(split_lines(old), split_lines(new), fromfile=a, tofile=b):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write to a temporary file beside `path`, then rename over it: readers see the old or the new file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def backup_path(path: Path) -> Path:
    """Where this run keeps the file as it was: FILE.orig; when that exists (an earlier run's original, which
    is never overwritten), the first free name of FILE.orig.1, FILE.orig.2, ... (the highest is the newest)."""
    candidate, n = path.with_name(path.name + ".orig"), 0
    while os.path.lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}.orig.{n}")
    return candidate


def check_writable(path: Path, backup: bool) -> None:
    """Before any model loads: can `--in-place` write beside `path` (its temporary file, the backup) and replace
    it? Tried, not guessed from permission bits (which root ignores and a read-only mount overrides)."""
    where = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=where)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        what = "the backup and the new file" if backup else "the new file"
        raise FileError(f"{path}: --in-place cannot write {what} in {where} ({e.strerror or e})") from None


def save_in_place(path: Path, old: str, new: str, backup: bool) -> Path | None:
    """Write `new` over `path` atomically, after keeping `old` in a new backup file (returned) unless told not to.
    The backup is complete before the file is replaced, so an interruption at any point loses neither."""
    mode = path.stat().st_mode & 0o7777
    kept = None
    try:
        if backup:
            kept = backup_path(path)
            write_atomically(kept, old.encode("utf-8"), mode)
        write_atomically(path, new.encode("utf-8"), mode)
    except OSError as e:  # the directory changed under us since check_writable: the file itself is untouched
        raise FileError(f"{path}: cannot write the filled file ({e.strerror or e}); {path} is unchanged"
                        + (f", its backup is {kept}" if kept is not None and kept.exists() else "")) from None
    return kept


# ----------------------------------------------------------------------------- the command

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
    be_quiet(quiet)
    if in_place and file == "-":
        raise UsageError("--in-place needs a file, not stdin")
    if in_place and to_stdout:
        raise UsageError("--in-place and --stdout exclude each other")
    if no_backup and not in_place:
        raise UsageError("--no-backup only applies with --in-place (without it, no file is written)")
    if held_tokens < 0:
        raise UsageError("--held-tokens must be >= 0")
    if method not in METHODS:
        raise UsageError(f"--method must be one of {', '.join(METHODS)} (got {method!r})")
    from pathlib import Path

    text = read_source(file)
    if in_place:
        check_writable(Path(file), backup=not no_backup)
    name = "stdin" if file == "-" else file
    holes = [lines_hole(text, lines, name)] if lines else marker_holes(text, marker, name)
    model_dir = model_arg(model, quiet)  # before torch is imported
    from ..engine import load  # heavy: torch

    engine = load(model_dir, device=device, dtype=dtype)
    new = fill_holes(engine, text, holes, method=method, held_tokens=held_tokens, name=name, marker=marker,
                       warn=lambda m: None if quiet else sys.stderr.write(m + "\n"), seed=seed,
                       max_new_tokens=max_new_tokens,
                       max_denoising_steps=steps)
    if in_place:
        kept = save_in_place(Path(file), text, new, backup=not no_backup)
        if kept is not None and kept.name != f"{Path(file).name}.orig":
            note(f"{file}.orig holds an earlier original and is kept; this run's original is in {kept}")
    elif to_stdout:
        sys.stdout.buffer.write(new.encode("utf-8"))
    else:
        sys.stdout.write(unified_diff(text, new, name))
    sys.stdout.flush()
