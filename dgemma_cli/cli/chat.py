"""`dgemma chat`: the terminal around a Conversation (dgemma_cli/conversation.py).

A prompt_toolkit session (history file, multi-line input: Enter sends, Alt-Enter or Ctrl-J adds a line), slash
commands, the live canvas view. Ctrl-C cancels the answer in progress and keeps the session; Ctrl-D (or /exit) leaves
with status 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

import typer

from ..errors import DgemmaError, UsageError
from .options import (
    ADAPTER_OPTION,
    DEVICES_OPTION,
    GPU_MEMORY_OPTION,
    MODEL_HELP,
    QUIET_OPTION,
    TEMPERATURE_OPTION,
    adapter_args,
    be_quiet,
    check_device_dtype,
    devices_arg,
    gpu_memory_arg,
    model_arg,
    note_placement,
    sampler_option,
    sampler_settings,
)

if TYPE_CHECKING:  # torch: imported by run_chat, after the command's checks
    from ..conversation import Conversation

HELP = """\
/help              this list
/reset             start a new conversation (keeps the system prompt and settings)
/system TEXT       set the system prompt (and start a new conversation); /system alone clears it
/steps N           most denoising steps per canvas
/settings          the sampler's settings and the chat's
/set NAME VALUE    change a sampler setting (names as /settings shows them), e.g. /set t-max 0.9
/set json-schema FILE, /set regex PATTERN, /set grammar FILE
                   hold the answers to a structure (docs/run.md); /set structure off frees them
/think on|off      let the model think first (its thoughts show dimmed, apart from the answer)
/retry             answer the last message again
/image PATH        attach an image (PNG, JPEG, WebP, GIF) to the next message; repeat for several
/save FILE         write the whole conversation as Markdown (turns the context dropped too)
/view live|plain|none   how generation is shown
/exit              leave (Ctrl-D also); Ctrl-C cancels an answer in progress
Enter sends; Alt-Enter or Ctrl-J starts a new line."""


def history_file() -> Path:
    base = os.environ.get("DGEMMA_HOME") or os.path.join(os.environ.get("XDG_STATE_HOME") or
                                                         os.path.join(Path.home(), ".local", "state"), "dgemma")
    path = Path(base) / "chat_history"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def save_markdown(path: Path, text: str) -> None:
    """Write the transcript atomically; an existing file keeps its permissions, a new one gets the umask's."""
    from .fim import write_atomically

    if path.is_dir():
        raise OSError(21, "is a directory", str(path))
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    write_atomically(path, text.encode("utf-8"), mode)


def settings_text(settings, conv: Conversation, view: str, seed: int | None) -> str:
    """What /settings shows: each sampler setting under its flag's name, then the chat's own."""
    rows = settings.describe() + [("think", "on" if conv.enable_thinking else "off"), ("view", view),
                                  ("seed", "none" if seed is None else str(seed)), ("context", str(conv.context)),
                                  ("system", repr(conv.system) if conv.system else "none"),
                                  ("structure", "none" if conv.structure is None else conv.structure.kind.replace(
                                      "_", " "))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


STRUCTURE_NAMES = ("json-schema", "regex", "grammar", "structure")


def set_structure(engine, arg: str):
    """`/set json-schema FILE`, `/set regex PATTERN`, `/set grammar FILE`, `/set structure off` -> the structure
    the next answers are held to (None: free), compiled for the model now (UsageError, said as one line)."""
    from pathlib import Path

    from ..structured.constrain import Structure

    name, _, value = arg.strip().partition(" ")
    value = value.strip()
    if name == "structure" or value == "off":
        if value != "off":
            raise UsageError("usage: /set structure off")
        return None
    if not value:
        raise UsageError(f"usage: /set {name} {'PATTERN' if name == 'regex' else 'FILE'}")
    if name == "regex":
        structure = Structure("regex", value)
    else:
        try:
            source = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"/set {name} {value}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
        structure = Structure("json_schema" if name == "json-schema" else "grammar", source)
    engine.automaton(structure)  # checks and compiles it (cached for the turns)
    return structure


def set_setting(settings, arg: str):
    """`/set NAME VALUE`: the settings with one sampler setting changed (UsageError, said as a usage line)."""
    from ..config import SAMPLER_FLAGS

    name, _, value = arg.strip().partition(" ")
    if name not in SAMPLER_FLAGS:
        raise UsageError(f"usage: /set NAME VALUE, NAME one of {', '.join(SAMPLER_FLAGS)}")
    field_name, kind, _ = SAMPLER_FLAGS[name]
    try:
        parsed = kind(value.strip())
    except ValueError:
        raise UsageError(f"/set {name}: {value.strip()!r} is not {'an integer' if kind is int else 'a number'}")
    try:
        return settings.override(**{field_name: parsed})
    except UsageError as e:
        raise UsageError(f"/set {name}: {e}") from None


def prompt_session(history: Path | None):
    """The input line: Enter sends, Alt-Enter or Ctrl-J adds a line; entries persist in `history`."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    bindings = KeyBindings()

    @bindings.add("enter")
    def _(event):
        event.current_buffer.validate_and_handle()

    @bindings.add("escape", "enter")
    @bindings.add("c-j")
    def _(event):
        event.current_buffer.insert_text("\n")

    return PromptSession(history=FileHistory(str(history)) if history else InMemoryHistory(), multiline=True,
                         key_bindings=bindings,
                         prompt_continuation=lambda width, line, wrap: "." * (width - 1) + " ")


DEFAULT_CONTEXT = 8192  # tokens of conversation kept when --context is not given (capped at the model's context)


def run_chat(engine, *, system: str | None, settings, think: bool, view: str, context: int | None,
             seed: int | None, out=None, err=None, quiet: bool = False) -> int:
    """The interactive loop; returns the exit status. `settings`: the sampler's (GenerationSettings); `context`:
    --context, None when not given; quiet: no greeting or notices on stderr (errors still are)."""
    out, err = out or sys.stdout, err or sys.stderr
    asked, context = context is not None, context or DEFAULT_CONTEXT
    from ..conversation import Conversation

    conv = Conversation(engine, context, system, think)
    session = prompt_session(history_file())
    if not quiet:
        err.write("dgemma chat: /help for commands, Ctrl-D to leave\n")
    if asked and conv.context < context and not quiet:  # said only for a --context the user gave
        err.write(f"(--context {context} is more than this model's {conv.context} positions: the chat keeps "
                  f"{conv.context})\n")
    err.flush()
    resend: str | None = None
    while True:
        if resend is None:
            try:
                text = session.prompt("› ")
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt clears the line
            except EOFError:
                return 0
        else:
            text, resend = resend, None
        if not text.strip():
            continue
        if text.startswith("/"):
            cmd, _, arg = text.strip().partition(" ")
            arg = arg.strip()
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/help":
                out.write(HELP + "\n")
            elif cmd == "/reset":
                conv.reset()
                err.write("(new conversation)\n")
            elif cmd == "/system":
                conv.system = arg or None
                conv.reset()
                err.write(f"(system prompt {'set' if arg else 'cleared'}; new conversation)\n")
            elif cmd == "/steps":
                try:
                    settings = settings.override(max_denoising_steps=int(arg))
                    err.write(f"(at most {settings.max_denoising_steps} steps per canvas)\n")
                except (ValueError, UsageError):
                    err.write("usage: /steps N (N >= 1)\n")
            elif cmd == "/settings":
                out.write(settings_text(settings, conv, view, seed) + "\n")
            elif cmd == "/set" and arg.partition(" ")[0] in STRUCTURE_NAMES:
                try:
                    conv.structure = set_structure(engine, arg)
                    err.write("(answers free)\n" if conv.structure is None else
                              f"(answers held to the {conv.structure.kind.replace('_', ' ')})\n")
                except UsageError as e:
                    err.write(f"{e}\n")
            elif cmd == "/set":
                try:
                    settings = set_setting(settings, arg)
                    name = arg.split()[0]
                    err.write(f"({name} {dict(settings.describe())[name]})\n")
                except UsageError as e:
                    err.write(f"{e}\n")
            elif cmd == "/think":
                if arg not in ("on", "off"):
                    err.write("usage: /think on|off\n")
                else:
                    conv.enable_thinking = arg == "on"
                    conv.stale = True
                    err.write(f"(thinking {arg})\n")
            elif cmd == "/retry":
                resend = conv.retry()
                if resend is None:
                    err.write("(nothing to retry)\n")
            elif cmd == "/image":
                if not arg:
                    err.write("usage: /image PATH\n")
                else:
                    try:
                        n = conv.attach_image(arg)
                        err.write(f"(image attached to the next message: {n} image tokens)\n")
                    except DgemmaError as e:
                        err.write(f"dgemma: {e}\n")
            elif cmd == "/save":
                if not arg:
                    err.write("usage: /save FILE\n")
                else:
                    try:
                        save_markdown(Path(arg).expanduser(), conv.markdown())
                        n, k = len(conv.dropped) + len(conv.turns), len(conv.dropped)
                        err.write(f"(saved {arg}: all {n} turns, the {k} oldest marked as dropped from the model's "
                                  "context)\n" if k else f"(saved {arg})\n")
                    except OSError as e:
                        err.write(f"(cannot save {arg}: {e.strerror or e})\n")
            elif cmd == "/view":
                if arg not in ("live", "plain", "none"):
                    err.write("usage: /view live|plain|none\n")
                else:
                    view = arg
                    err.write(f"(view {arg})\n")
            else:
                err.write(f"unknown command {cmd}; /help lists them\n")
            err.flush()
            out.flush()
            continue
        answer_turn(conv, text, settings, view, seed, out, err)


class TypeAheadKept:
    """While an answer is generated, what the user types waits, unseen, for the next prompt.

    The terminal is in its cooked mode between prompts: it would echo keys into the live view, and turn Enter
    (carriage return) into a newline, which the prompt reads as "new line", not "send". Within this block the
    terminal neither echoes nor buffers lines nor translates Enter; Ctrl-C still interrupts, without the terminal
    discarding what was typed before it (NOFLSH): a cancelled answer leaves the typed text for the next prompt.
    Nothing is read, so the keys stay queued and the next prompt receives them as typed: the text, and Enter
    sending it. Leaving restores the settings without discarding queued input. Does nothing when stdin is not a
    terminal."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin
        self.saved = None

    def __enter__(self) -> TypeAheadKept:
        try:
            import termios
        except ImportError:  # not a POSIX terminal
            return self
        try:
            fd = self.stream.fileno()
            if not os.isatty(fd):
                return self
            self.saved = termios.tcgetattr(fd)
            attrs = termios.tcgetattr(fd)
            attrs[0] &= ~(termios.ICRNL | termios.INLCR | termios.IGNCR)  # iflag: Enter stays a carriage return
            attrs[3] &= ~(termios.ECHO | termios.ICANON)  # lflag: no echo, no line editing; ISIG kept (Ctrl-C)
            attrs[3] |= termios.NOFLSH  # Ctrl-C's signal does not flush the keys typed ahead
            termios.tcsetattr(fd, termios.TCSANOW, attrs)
            self.fd = fd
        except (AttributeError, OSError, ValueError, termios.error):  # no file descriptor, or not ours to set
            self.saved = None
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSANOW, self.saved)  # TCSANOW: queued keys are kept


def answer_turn(conv: Conversation, text: str, settings, view: str, seed: int | None, out, err) -> None:
    """Generate one answer with the chosen view; Ctrl-C cancels it and keeps the session; keys typed meanwhile
    wait for the next prompt."""
    with TypeAheadKept():
        _answer_turn(conv, text, settings, view, seed, out, err)


def _answer_turn(conv: Conversation, text: str, settings, view: str, seed: int | None, out, err) -> None:
    try:
        events, stats = conv.turn_events(text, settings, seed)
    except UsageError as e:
        err.write(f"dgemma: {e}\n")
        return
    for note in conv.notices:
        err.write(f"({note})\n")
    conv.notices.clear()
    from .view import Board, PlainProgress, choose_view, view_for

    # /view live on a terminal that cannot move the cursor (TERM=dumb) shows plain lines, as `dgemma run` does
    view = choose_view(view, stdout_tty=True, stderr_tty=err.isatty(), term=os.environ.get("TERM"))
    engine = conv.engine
    board = Board.from_hint(engine.view_hints.get("board"), engine.config.canvas_length)  # the checkpoint's layout
    if board is not None:
        board, warning = board.read_prompt(text)
        if warning:
            err.write(f"({warning})\n")
    show = view_for(conv.tok, board=board) if view == "live" else PlainProgress(err) if view == "plain" else None
    try:
        if view == "live":
            with show:
                for ev in events:
                    show(ev)
        else:
            for ev in events:
                if show is not None:
                    show(ev)
    except KeyboardInterrupt:
        conv.cancel()
        err.write("(cancelled)\n")
        err.flush()
        return
    turn = conv.turns[-1]
    if turn.thought:
        err.write("\x1b[2m" + turn.thought + "\x1b[0m\n" if err.isatty() else turn.thought + "\n")
    out.write(turn.answer + "\n")
    out.flush()


# ----------------------------------------------------------------------------- the command

def chat(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
    max_new_tokens: Optional[int] = sampler_option("max-new-tokens"),
    steps: Optional[int] = sampler_option("steps"),
    t_max: Optional[float] = sampler_option("t-max"),
    t_min: Optional[float] = sampler_option("t-min"),
    temperature: Optional[float] = TEMPERATURE_OPTION,
    entropy_bound: Optional[float] = sampler_option("entropy-bound"),
    confidence_threshold: Optional[float] = sampler_option("confidence-threshold"),
    stability_threshold: Optional[int] = sampler_option("stability-threshold"),
    think: bool = typer.Option(False, "--think", help="Let the model think before answering."),
    view: str = typer.Option("live", "--view", help="live, plain or none."),
    context: Optional[int] = typer.Option(None, "--context", show_default=False,
                                          help="Tokens of conversation kept (oldest turns drop). Default: 8192, or "
                                               "the model's context if smaller."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed each turn's generation."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto."),
    adapter: Optional[List[str]] = ADAPTER_OPTION,
    gpu_memory: Optional[str] = GPU_MEMORY_OPTION,
    devices: Optional[str] = DEVICES_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Chat in the terminal; the KV cache carries over between turns. /help lists the commands.

    The sampler's settings (--max-new-tokens to --stability-threshold) default to the model's
    generation_config.json; /settings shows them and /set changes them during the chat."""
    sampler = sampler_settings(max_new_tokens=max_new_tokens, max_denoising_steps=steps, t_max=t_max,
                                t_min=t_min, temperature=temperature, entropy_bound=entropy_bound,
                                confidence_threshold=confidence_threshold, stability_threshold=stability_threshold)
    check_device_dtype(device, dtype)
    if view not in ("live", "plain", "none"):
        raise UsageError(f"--view must be live, plain or none (got {view!r})")
    if context is not None and context < 64:
        raise UsageError("--context must be at least 64")
    if not sys.stdin.isatty():
        raise UsageError("dgemma chat needs a terminal; for pipes use `dgemma run` (--each-line for many prompts)")
    adapters = adapter_args(adapter)
    card_bytes = gpu_memory_arg(gpu_memory)
    cards = devices_arg(devices)
    be_quiet(quiet)
    model_dir = model_arg(model, quiet)
    from ..engine import load

    engine = load(model_dir, device=device, dtype=dtype, adapters=adapters, gpu_memory=card_bytes, devices=cards)
    note_placement(engine)
    settings = engine.settings.override(**sampler)
    raise typer.Exit(run_chat(engine, system=system, settings=settings, think=think, view=view, context=context,
                              seed=seed, quiet=quiet))
