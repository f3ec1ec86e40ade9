"""`dgemma chat`: a multi-turn conversation that keeps the encoder's KV cache between turns.

`Conversation` is the engine side: the conversation is one growing token stream, encoded once. A turn encodes only
what is new since the last one: the end of the previous answer (its last canvas is never encoded during
generation, and its pad tokens are dropped), then the user's turn rendered by the chat template, then the model's
generation prompt. When the stream would outgrow the context, the oldest turns are dropped and the rest is encoded
again (said in a notice); the dropped turns stay in the transcript /save writes (`Conversation.dropped`). Cancelling a turn, /retry, /system and /think rebuild the cache from the kept turns on
the next turn (the sliding layers' windows cannot be rolled back). Images attached with /image go with the next
message; their soft tokens are kept with the turn, so a rebuild encodes them again without the vision tower.

`run_chat` is the terminal: a prompt_toolkit session (history file, multi-line input: Enter sends, Alt-Enter or
Ctrl-J adds a line), slash commands, the live canvas view. Ctrl-C cancels the answer in progress and keeps the
session; Ctrl-D (or /exit) leaves with status 0.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .errors import DgemmaError, UsageError
from .sampler import CanvasDone, Done, Event, Step
from .tokenizer import Control

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


@dataclass
class Turn:
    user: str
    user_ids: list[int]  # the user turn as encoded: template text after the previous answer
    answer: str = ""
    thought: str = ""
    answer_ids: list[int] = field(default_factory=list)  # generated, through the end-of-turn token, no pads
    images: list = field(default_factory=list)  # image.Patches sent with the message
    features: torch.Tensor | None = None  # their soft tokens [N, H], kept to encode the turn again on a rebuild


@dataclass
class TurnStats:
    encoded: int  # tokens encoded for this turn (new ones only, or everything after a rebuild)
    rebuilt: bool
    seconds_to_first_step: float
    dropped_turns: int = 0


class Conversation:
    """One conversation's token stream in one KV cache (batch 1)."""

    def __init__(self, engine, context: int, system: str | None = None, enable_thinking: bool = False):
        if engine.tokenizer is None:
            raise UsageError(f"{engine.path}: no tokenizer.json, so there is nothing to chat with")
        self.engine = engine
        self.tok = engine.tokenizer
        self.context = min(context, engine.config.text.max_position_embeddings)
        self.system = system
        self.enable_thinking = enable_thinking
        self.structure = None  # constrain.Structure the answers are held to (/set json-schema, regex, grammar)
        self.turns: list[Turn] = []
        # Turns the context dropped (the oldest, when the conversation outgrew it): the model no longer sees them,
        # but they are still the conversation the user had, and /save writes them before the others.
        self.dropped: list[Turn] = []
        self.denoiser = None
        self.cached: list[int] = []  # ids in the cache, in order
        self.pending: list[int] = []  # generated ids of the last answer not yet in the cache
        self.stale = True  # the cache must be rebuilt from the turns before the next one
        self.notices: list[str] = []
        self.cancelled: str | None = None  # the message of a cancelled turn, for /retry
        self.attached: list = []  # image.Patches for the next message (/image)
        self.cancelled_images: list = []  # the cancelled message's images, for /retry
        self.image_tokens: int | None = None  # soft tokens per image (None: the model's default)

    # -- token stream -----------------------------------------------------------------------------------

    def head_ids(self) -> list[int]:
        """<bos>, the system turn (and the thinking switch), as the template renders an empty conversation."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        return self.tok.encode_chat(messages, add_generation_prompt=False, enable_thinking=self.enable_thinking)

    def attach_image(self, source) -> int:
        """Attach an image (a path or the file's bytes) to the next message; returns its soft-token count."""
        from .store import check_images

        if self.engine.path is not None:
            check_images(self.engine.path)  # a store entry holding only the text model: the line naming a re-pull
        patches = self.engine.image_patches([source], self.image_tokens)[0]
        self.attached.append(patches)
        return patches.soft_tokens

    def user_turn_ids(self, text: str, first: bool, images: list = ()) -> list[int]:
        """The template's rendering of one user turn and the generation prompt, without <bos> (the stream has
        it); after an answer, the newline the template puts after every turn comes first. Images go before the
        text, each as begin-of-image, its image tokens, end-of-image."""
        content = [Control(self.engine.image_placeholder())] * len(images) + [text] if images else text
        ids = self.tok.encode_chat([{"role": "user", "content": content}], add_generation_prompt=True)
        if images:
            ids = self.engine.with_images(ids, images)
        if ids and ids[0] == self.tok.bos_id:
            ids = ids[1:]
        return ids if first else self.tok.encode("\n") + ids

    def full_ids(self, turns: list[Turn]) -> list[int]:
        out = self.head_ids()
        for t in turns:
            out += t.user_ids + t.answer_ids
        return out

    # -- turns --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self.turns.clear()
        self.dropped.clear()
        self.stale = True

    def _reserve(self, settings) -> int:
        C = self.engine.config.canvas_length
        return settings.canvases_for(C) * C

    def _rebuild(self, text: str, settings, images: list = ()) -> tuple[list[int], list[int], int]:
        """(ids to encode from an empty cache, the new user turn's ids, turns dropped): the oldest turns go while
        the stream and a full answer do not fit the context."""
        kept = list(self.turns)  # worked out on a copy: a message that cannot fit leaves the conversation alone
        first_ids = None
        while True:
            user_ids = self.user_turn_ids(text, first=not kept, images=images)
            stream = self.head_ids()
            for i, t in enumerate(kept):
                stream += (first_ids if i == 0 and first_ids is not None else t.user_ids) + t.answer_ids
            ids = stream + user_ids
            if len(ids) + self._reserve(settings) <= self.context or not kept:
                break
            kept.pop(0)
            if kept:  # the first kept turn now follows the head directly
                first_ids = self.user_turn_ids(kept[0].user, first=True, images=kept[0].images)
        if len(ids) + self._reserve(settings) > self.context:
            raise UsageError(f"this message needs {len(ids) + self._reserve(settings)} positions with a full answer; "
                             f"the chat context is {self.context}" +
                             (" (--context)" if self.context < self.engine.config.text.max_position_embeddings
                              else ", the model's most"))
        dropped = len(self.turns) - len(kept)
        if dropped:
            # kept for the transcript only: their text (ids, images and soft tokens are not needed any more)
            self.dropped += [Turn(t.user, [], t.answer, t.thought) for t in self.turns[:dropped]]
            if first_ids is not None:
                kept[0].user_ids = first_ids
            self.turns[:] = kept
        return ids, user_ids, dropped

    def turn_events(self, text: str, settings, seed: int | None = None) -> tuple[Iterator[Event], TurnStats]:
        """Start a turn: returns its events (consume them all, or call `cancel`) and the encoding stats."""
        from .engine import _in_inference_mode, make_denoiser
        from .sampler import generate_events

        t0 = time.perf_counter()
        images = self.attached
        features = self.engine.image_features(images) if images else None
        reuse = not self.stale and self.denoiser is not None and self.turns
        if reuse:
            user_ids = self.user_turn_ids(text, first=False, images=images)
            new = self.pending + user_ids
            reuse = len(self.cached) + len(new) + self._reserve(settings) <= self.context
        dropped = 0
        if not reuse:
            new, user_ids, dropped = self._rebuild(text, settings, images)
            if dropped:
                self.notices.append(f"the conversation outgrew the {self.context}-token context: dropped the "
                                    f"oldest {dropped} turn{'s' if dropped > 1 else ''}")
            self.denoiser = make_denoiser(self.engine.model, 1, self.context)
            self.cached = []
        self.pending = []
        self.stale = True  # until the answer is complete
        self.cancelled = None
        self.attached = []
        self.turns.append(Turn(text, user_ids, images=images, features=features))
        # The images in the encoded ids: this turn's, or after a rebuild every kept turn's, in order.
        sent = [features] if reuse else [t.features for t in self.turns]
        sent = [f for f in sent if f is not None]
        self.denoiser.image_features = torch.cat(sent) if sent else None
        if seed is not None:
            torch.manual_seed(seed)
        prompt = torch.tensor([new], dtype=torch.long, device=self.engine.model.device)
        stats = TurnStats(len(new), not reuse, 0.0, dropped)
        constraints = None  # /set json-schema, regex, grammar: the answer held to it
        if self.structure is not None:
            auto = self.engine.automaton(self.structure)
            constraints = [auto.row(settings.max_new_tokens, settings.eos_token_ids, settings.pad_token_id)]
        events = _in_inference_mode(generate_events(self.denoiser, prompt, settings, constraints=constraints))
        return self._track(events, new, stats, t0), stats

    def _track(self, events: Iterator[Event], new: list[int], stats: TurnStats, t0: float) -> Iterator[Event]:
        """Pass events through; keep the cached stream in step with what the sampler encodes."""
        eot = self.tok.end_of_turn_id
        pad = self.engine.settings.pad_token_id
        self.cached += new
        canvases: list[list[int]] = []
        for ev in events:
            if isinstance(ev, Step) and stats.seconds_to_first_step == 0.0:
                stats.seconds_to_first_step = time.perf_counter() - t0
            if isinstance(ev, CanvasDone):
                canvases.append(ev.tokens[0].tolist())
            if isinstance(ev, Done):
                for c in canvases[:-1]:  # every canvas but the last was encoded as the next one started
                    self.cached += c
                answer = ev.token_ids[0]
                last = canvases[-1] if canvases else []
                # the last canvas's kept part (pads after the end of turn dropped), ending with the end of turn
                keep = [t for t in last if t != pad]
                if eot in keep:
                    keep = keep[: keep.index(eot) + 1]
                else:
                    keep = keep + [eot]
                self.pending = keep
                turn = self.turns[-1]
                turn.answer_ids = [t for c in canvases[:-1] for t in c] + keep
                turn.thought, turn.answer = self.tok.decode_answer(answer)
                self.stale = False
            yield ev

    def cancel(self) -> None:
        """Forget the turn in progress (its tokens may be half in the cache: rebuild next time)."""
        if self.turns and self.stale:
            turn = self.turns.pop()
            self.cancelled, self.cancelled_images = turn.user, turn.images
        self.pending = []
        self.stale = True

    def retry(self) -> str | None:
        """The message to send again: a cancelled one, else the last turn's (that turn is dropped)."""
        if self.cancelled is not None:
            text, self.cancelled = self.cancelled, None
            self.attached = list(self.cancelled_images)
            return text
        if not self.turns:
            return None
        last = self.turns.pop()
        self.pending = []
        self.stale = True
        self.attached = list(last.images)  # the images go again with the message
        return last.user

    def markdown(self) -> str:
        lines = ["# dgemma chat", ""]
        if self.system:
            lines += [f"**System:** {self.system}", ""]
        for i, t in enumerate(self.dropped + self.turns):
            if i == len(self.dropped) and self.dropped:
                lines += [self._dropped_note(), ""]
            lines += ["## User", "", t.user, "", "## Model", ""]
            if t.thought:
                lines += ["> " + line for line in t.thought.splitlines()] + [""]
            lines += [t.answer, ""]
        if self.dropped and not self.turns:
            lines += [self._dropped_note(), ""]
        return "\n".join(lines)

    def _dropped_note(self) -> str:
        n = len(self.dropped)
        return (f"*({'The turn' if n == 1 else f'The {n} turns'} above fell out of the model's {self.context}-token "
                f"context: the model no longer saw {'it' if n == 1 else 'them'} when it answered what follows.)*")


# ----------------------------------------------------------------------------- the terminal


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

    from .constrain import Structure

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
    from .config import SAMPLER_FLAGS

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
