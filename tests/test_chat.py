"""`dgemma chat`: the conversation's cache reuse (unit), and the real command under a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dgemma_cli.conversation import Conversation
from dgemma_cli.engine import load
from dgemma_cli.sampler import Done, Step

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo():
    return load("demo", device="cpu", dtype="float32")


def run_turn(conv, text, seed=0, settings=None):
    events, stats = conv.turn_events(text, settings or conv.engine.settings, seed=seed)
    first = None
    for ev in events:
        if isinstance(ev, Step) and first is None:
            first = ev
    return first, stats


def test_the_cache_holds_exactly_the_conversation(demo):
    conv = Conversation(demo, 4096)
    _, s1 = run_turn(conv, "upper: hello diffusions")
    assert s1.rebuilt and conv.turns[0].answer == "HELLO DIFFUSIONS"
    _, s2 = run_turn(conv, "upper: abc def 12 ghijk")
    assert not s2.rebuilt
    # the second turn encoded only the first answer (one canvas: never encoded while generating) and its own turn
    assert s2.encoded == len(conv.turns[0].answer_ids) + len(conv.turns[1].user_ids)
    assert demo.tokenizer.pad_id not in conv.turns[0].answer_ids  # the last canvas's pads are not in the cache
    assert conv.cached + conv.pending == conv.full_ids(conv.turns)
    # the stream is the chat template's rendering of the conversation (up to the newline after the last turn)
    messages = []
    for t in conv.turns:
        messages += [{"role": "user", "content": t.user}, {"role": "assistant", "content": t.answer}]
    rendered = demo.tokenizer.encode_chat(messages, add_generation_prompt=False)
    assert rendered == conv.full_ids(conv.turns) + demo.tokenizer.encode("\n")


def test_reusing_the_cache_computes_what_encoding_everything_computes(demo):
    reuse, fresh = Conversation(demo, 4096), Conversation(demo, 4096)
    for conv in (reuse, fresh):
        run_turn(conv, "upper: hello diffusions")
    fresh.stale = True  # the next turn re-encodes the whole conversation from an empty cache
    a, sa = run_turn(reuse, "upper: abc def 12 ghijk", seed=3)
    b, sb = run_turn(fresh, "upper: abc def 12 ghijk", seed=3)
    assert not sa.rebuilt and sb.rebuilt and sa.encoded < sb.encoded
    assert torch.equal(a.argmax, b.argmax)
    torch.testing.assert_close(a.entropy, b.entropy, rtol=1e-4, atol=1e-5)
    assert reuse.turns[-1].answer == fresh.turns[-1].answer


def test_outgrowing_the_context_drops_the_oldest_turns(demo):
    conv = Conversation(demo, 150)  # room for about two turns plus a canvas
    for text in ("upper: hello diffusions", "upper: abc def 12 ghijk", "upper: 940 c wzvu 505 h"):
        run_turn(conv, text)
    assert conv.notices and "dropped the oldest" in conv.notices[-1]
    assert conv.turns[0].user != "upper: hello diffusions"
    assert len(conv.cached) + len(conv.pending) + demo.config.canvas_length <= 150
    assert conv.cached + conv.pending == conv.full_ids(conv.turns)
    # a message that cannot fit even alone is refused and the conversation is left as it was
    before = [t.user for t in conv.turns]
    from dgemma_cli.errors import UsageError

    with pytest.raises(UsageError):
        conv.turn_events("upper: " + "x" * 400, demo.settings)
    assert [t.user for t in conv.turns] == before


def test_cancel_retry_and_transcript(demo, tmp_path):
    conv = Conversation(demo, 4096)
    run_turn(conv, "upper: hello diffusions")
    events, _ = conv.turn_events("upper: abc def 12 ghijk", demo.settings, seed=0)
    next(events)  # interrupted after one event
    conv.cancel()
    assert [t.user for t in conv.turns] == ["upper: hello diffusions"] and conv.stale
    _, stats = run_turn(conv, "upper: abc def 12 ghijk")
    assert stats.rebuilt and len(conv.turns) == 2  # the cache was rebuilt from the kept turn
    assert conv.retry() == "upper: abc def 12 ghijk" and len(conv.turns) == 1
    # /retry after a cancel sends the cancelled message again and keeps the answered turns
    events, _ = conv.turn_events("upper: 940 c wzvu 505 h", demo.settings, seed=0)
    next(events)
    conv.cancel()
    assert conv.retry() == "upper: 940 c wzvu 505 h" and len(conv.turns) == 1
    md = conv.markdown()
    assert "## User\n\nupper: hello diffusions" in md and "HELLO DIFFUSIONS" in md
    from dgemma_cli.cli.chat import save_markdown

    target = tmp_path / "chat.md"
    save_markdown(target, md)
    assert target.read_text() == md
    target.chmod(0o600)
    save_markdown(target, md + "more\n")  # an existing file is replaced whole and keeps its mode
    assert target.read_text().endswith("more\n") and (target.stat().st_mode & 0o777) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".chat.md")] == []
    with pytest.raises(OSError):
        save_markdown(tmp_path / "no" / "such" / "dir.md", md)


# ----------------------------------------------------------------------------- the real command in a terminal


class Terminal:
    """`dgemma chat` in a pseudo-terminal of 80 x 48, its output fed to a terminal emulator (pyte). Tall enough that
    a test's whole conversation stays on the screen."""

    def __init__(self, args: list[str], env: dict, controlling: bool = False):
        """controlling: the terminal becomes the child's controlling terminal, so that Ctrl-C typed while the
        terminal is not in raw mode signals the child as a real terminal does."""
        import pyte

        self.screen = pyte.Screen(80, 48)
        self.stream = pyte.ByteStream(self.screen)
        self.master, slave = pty.openpty()
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 48, 80, 0, 0))
        def controlling_terminal() -> None:
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # As a terminal leaves it: a test run started as a background job inherits an ignored SIGINT, and an
            # ignored signal stays ignored across exec (Python would then never raise KeyboardInterrupt).
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                                     start_new_session=True, preexec_fn=controlling_terminal if controlling else None)
        os.close(slave)
        self.log = b""

    def pump(self, timeout: float = 0.1) -> None:
        while True:
            ready, _, _ = select.select([self.master], [], [], timeout)
            if not ready:
                return
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.log += data
            self.stream.feed(data)

    def text(self) -> str:
        return "\n".join(self.screen.display)

    def wait_for(self, needle: str, timeout: float = 60.0) -> None:
        end = time.time() + timeout
        while time.time() < end:
            self.pump()
            if needle in self.text():
                return
        raise AssertionError(f"{needle!r} never appeared; screen:\n{self.text()}")

    def wait_for_prompts(self, n: int, timeout: float = 60.0) -> None:
        """Until n input prompts are on the screen: the answers to the first n-1 messages are complete (a prompt
        line stays on the screen; the live view, which is not one, is erased when its answer is printed)."""
        end = time.time() + timeout
        while time.time() < end:
            self.pump()
            if sum(line.startswith("›") for line in self.screen.display) >= n:
                return
        raise AssertionError(f"the prompt never came back {n} times; screen:\n{self.text()}")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> None:
        """The session killed if it still runs (a failed test's), and the terminal closed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        os.close(self.master)


def terminal_env(tmp_path: Path) -> dict:
    """The environment of a dgemma command in Terminal: an 80 x 48 xterm, a home of its own, no $DGEMMA_MODEL."""
    env = dict(os.environ, TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", DGEMMA_HOME=str(tmp_path / "dgemma"),
               COLUMNS="80", LINES="48", PYTHONPATH=str(ROOT))
    env.pop("DGEMMA_MODEL", None)
    return env


@pytest.mark.slow
def test_chat_in_a_pseudo_terminal(tmp_path):
    pytest.importorskip("pyte")
    env = terminal_env(tmp_path)
    term = Terminal([sys.executable, "-m", "dgemma_cli", "chat", "--model", "demo", "--device", "cpu", "--seed", "0",
                     "--context", "100000"], env)
    try:
        term.wait_for("/help for commands")
        term.wait_for("is more than this model's 4096 positions")  # a --context above the model's is said at once
        term.wait_for("›")
        term.type("upper: hello diffusions\r")
        term.wait_for_prompts(2)  # the answer is in and the prompt is back: nothing typed ahead in this turn
        assert "HELLO DIFFUSIONS" in term.text()
        # Typed ahead, without waiting: the second message goes in while the first is (or may be) generated; each
        # Enter sends its own message, and nothing typed shows inside the answer being drawn
        term.type("upper: abc def 12 ghijk\r")
        term.type("upper: typed ahead 123\r")
        term.wait_for_prompts(4)  # (the demo model answers single turns only: these answers are not checked)
        prompts = [line.rstrip() for line in term.screen.display if line.startswith("›")]
        assert prompts == ["› upper: hello diffusions", "› upper: abc def 12 ghijk", "› upper: typed ahead 123",
                           "›"], term.text()
        term.type(f"/save {tmp_path / 'talk.md'}\r")
        term.wait_for("(saved")
        term.type("/reset\r")
        term.wait_for("(new conversation)")
        term.type("/bogus\r")
        term.wait_for("unknown command /bogus")
        shown = sum(line.startswith("›") for line in term.screen.display)
        term.type("\x03")  # Ctrl-C at the prompt clears the line; the session goes on, with a new prompt
        term.wait_for_prompts(shown + 1)
        term.type("/help\r")
        term.wait_for("/save FILE")
        term.type("\x04")  # Ctrl-D leaves
        assert term.proc.wait(timeout=30) == 0
        term.pump()
        screen = term.text()
        assert "Traceback" not in term.log.decode(errors="replace")
        assert "HELLO DIFFUSIONS" in screen or b"HELLO DIFFUSIONS" in term.log
        transcript = (tmp_path / "talk.md").read_text()
        assert "upper: hello diffusions" in transcript and "HELLO DIFFUSIONS" in transcript
        assert transcript.count("## User") == 3 and "\nupper: typed ahead 123\n" in transcript, transcript
        history = (tmp_path / "dgemma" / "chat_history").read_text()
        assert "upper: hello diffusions" in history  # prompts persist across sessions
    finally:
        term.close()


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_save_writes_the_turns_the_context_dropped_too(tmp_path):
    """The real command with a small --context: three messages drop the first turn from the model's context, and
    /save still writes the whole conversation the user saw, the dropped turn marked as such."""
    pytest.importorskip("pyte")
    env = terminal_env(tmp_path)
    term = Terminal([sys.executable, "-m", "dgemma_cli", "chat", "--model", "demo", "--device", "cpu", "--seed", "0",
                     "--context", "150", "--view", "none"], env)
    messages = ["upper: hello diffusions", "upper: abc def 12 ghijk", "upper: 940 c wzvu 505 h"]
    try:
        term.wait_for("›")
        for i, message in enumerate(messages):
            term.type(message + "\r")
            term.wait_for_prompts(i + 2)
        term.wait_for("dropped the oldest")  # the context outgrown: the notice the chat gives
        target = tmp_path / "talk.md"
        term.type(f"/save {target}\r")
        term.wait_for("(saved")
        term.wait_for("marked as dropped")  # the line says the file holds more than the model still sees
        term.type("\x04")
        assert term.proc.wait(timeout=60) == 0
    finally:
        term.close()
    transcript = target.read_text()
    assert transcript.count("## User") == 3, transcript
    assert all(f"\n{m}\n" in transcript for m in messages) and "HELLO DIFFUSIONS" in transcript, transcript
    note = transcript.index("above fell out of the model's 150-token context")
    assert transcript.index(messages[0]) < note < transcript.index(messages[-1]), transcript


def test_a_transcript_keeps_dropped_turns_until_reset(demo):
    conv = Conversation(demo, 150)
    for text in ("upper: hello diffusions", "upper: abc def 12 ghijk", "upper: 940 c wzvu 505 h"):
        run_turn(conv, text)
    assert conv.dropped and conv.dropped[0].user == "upper: hello diffusions"
    assert conv.dropped[0].answer == "HELLO DIFFUSIONS" and conv.dropped[0].features is None
    md = conv.markdown()
    assert md.count("## User") == len(conv.dropped) + len(conv.turns) == 3
    conv.reset()
    assert conv.dropped == [] and "## User" not in conv.markdown()


TYPE_AHEAD_CHILD = """
import sys, time
from dgemma_cli.cli.chat import TypeAheadKept, prompt_session
keep = sys.argv[1] != "cooked"
print("generating", flush=True)
try:
    if keep:
        with TypeAheadKept():
            time.sleep(2.0 if sys.argv[1] == "kept" else 30)  # an answer being generated: the test types meanwhile
    else:
        time.sleep(2.0)
except KeyboardInterrupt:  # as chat cancels an answer
    print("cancelled", flush=True)
print("generated", flush=True)
session = prompt_session(None)
for _ in range(2):
    print("sent", repr(session.prompt("> ")), flush=True)
"""


@pytest.mark.slow
def test_keys_typed_before_a_cancelling_ctrl_c_wait_for_the_next_prompt(tmp_path):
    """Text typed during an answer, then Ctrl-C to cancel it: the text is in the next prompt's line, not lost (the
    terminal flushes its input queue at Ctrl-C unless told not to)."""
    pytest.importorskip("pyte")
    env = dict(os.environ, TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", PYTHONPATH=str(ROOT))
    term = Terminal([sys.executable, "-c", TYPE_AHEAD_CHILD, "ctrl-c"], env, controlling=True)
    try:
        term.wait_for("generating")
        term.type("typed ahead")
        time.sleep(0.3)
        term.type("\x03")  # Ctrl-C: the child's "answer" is cancelled
        term.wait_for("cancelled", timeout=30)
        term.wait_for("> ", timeout=30)
        term.type(" and more\r")
        end = time.time() + 20
        while time.time() < end and b"sent " not in term.log:
            term.pump()
        assert re.findall(r"sent ('[^']*')", term.log.decode(errors="replace"))[:1] == ["'typed ahead and more'"], \
            term.log
    finally:
        term.close()


@pytest.mark.slow
@pytest.mark.parametrize("kept", [True, False], ids=["kept", "cooked"])
def test_keys_typed_during_an_answer_wait_for_the_next_prompt(tmp_path, kept):
    """Two messages typed while an answer is generated, each ended by Enter, in a real pseudo-terminal: with the
    terminal as chat sets it during an answer, nothing is echoed meanwhile and each Enter sends its own message.
    Without it (the terminal's cooked mode, `cooked`), the keys are echoed into the answer being drawn and Enter
    becomes a new line inside one unsent message: this case shows what the test detects."""
    pytest.importorskip("pyte")
    env = dict(os.environ, TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", PYTHONPATH=str(ROOT))
    term = Terminal([sys.executable, "-c", TYPE_AHEAD_CHILD, "kept" if kept else "cooked"], env)
    try:
        term.wait_for("generating")
        term.type("first message\rsecond message\r")
        term.wait_for("generated", timeout=30)
        echoed = b"first message" in term.log.split(b"generated")[0]
        end = time.time() + (20 if kept else 4)
        while time.time() < end and term.log.count(b"sent ") < 2:
            term.pump()
        sent = re.findall(r"sent ('[^']*')", term.log.decode(errors="replace"))
        if kept:
            assert not echoed, term.log
            assert sent == ["'first message'", "'second message'"], term.log
        else:
            assert echoed and sent == [], term.log
    finally:
        term.close()


def test_chat_refuses_a_pipe(capsys, monkeypatch):
    import io

    from cli_helpers import run_main

    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert run_main(["chat", "--model", "demo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a terminal" in err[0]


def test_set_and_settings_commands(demo):
    from dgemma_cli.cli.chat import set_setting, settings_text
    from dgemma_cli.errors import UsageError

    conv = Conversation(demo, 100000)
    assert conv.context == demo.config.text.max_position_embeddings  # capped (run_chat says so once)
    s = set_setting(demo.settings, "t-max 0.9")
    s = set_setting(s, "steps 12")
    assert (s.t_max, s.max_denoising_steps) == (0.9, 12) and demo.settings.t_max != 0.9  # the model's kept
    shown = dict(line.split(None, 1) for line in settings_text(s, conv, "live", 3).splitlines())
    assert shown["t-max"] == "0.9" and shown["steps"] == "12" and shown["seed"] == "3" and shown["view"] == "live"
    assert shown["context"] == str(conv.context) and shown["think"] == "off"
    moved = set_setting(s, "t-min 0.95")  # above t-max: t-max moves up with it, as the flags do
    assert (moved.t_min, moved.t_max) == (0.95, 0.95)
    for bad, said in [("bogus 1", "usage: /set NAME VALUE"), ("steps x", "not an integer"),
                      ("t-max 0", "--t-max must be > 0"), ("entropy-bound 0", "--entropy-bound must be > 0")]:
        with pytest.raises(UsageError, match=said.replace("+", r"\+")):
            set_setting(s, bad)


def test_a_dumb_terminal_gets_plain_progress_lines(demo, monkeypatch):
    """/view live where the terminal cannot move the cursor (TERM=dumb): a line per canvas, as `dgemma run`."""
    import io

    from dgemma_cli.cli.chat import answer_turn

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TERM", "dumb")
    out, err = io.StringIO(), Tty()
    answer_turn(Conversation(demo, 4096), "upper: hello diffusions", demo.settings, "live", 0, out, err)
    assert out.getvalue() == "HELLO DIFFUSIONS\n"
    assert "dgemma: canvas 1 done in" in err.getvalue() and "\x1b[" not in err.getvalue()


@pytest.mark.slow
def test_run_with_no_prompt_on_a_terminal_starts_a_chat(tmp_path):
    """`dgemma run` with neither a prompt nor a pipe, at a terminal: a conversation, as `ollama run` starts one."""
    pytest.importorskip("pyte")
    env = terminal_env(tmp_path)
    term = Terminal([sys.executable, "-m", "dgemma_cli", "run", "--model", "demo", "--device", "cpu", "--seed", "0"],
                    env)
    try:
        term.wait_for("starting `dgemma chat`")
        term.wait_for("›")
        term.type("upper: hello diffusions\r")
        term.wait_for_prompts(2)
        assert "HELLO DIFFUSIONS" in term.text()
        term.type("\x04")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.close()


def test_set_holds_the_answers_to_a_structure(demo, tmp_path):
    """/set regex, /set json-schema FILE, /set structure off: the next answers are held, the conversation goes on."""
    import json
    import re

    from dgemma_cli.cli.chat import set_structure, settings_text
    from dgemma_cli.errors import UsageError

    conv = Conversation(demo, 4096)
    conv.structure = set_structure(demo, "regex [A-Z]{5}")
    run_turn(conv, "upper: hello diffusions")
    assert re.fullmatch("[A-Z]{5}", conv.turns[-1].answer), conv.turns[-1].answer
    shown = dict(line.split(None, 1) for line in settings_text(demo.settings, conv, "live", None).splitlines())
    assert shown["structure"] == "regex"
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"w": {"type": "string", "maxLength": 4}},
                                  "required": ["w"]}))
    conv.structure = set_structure(demo, f"json-schema {schema}")
    run_turn(conv, "upper: abc def 12 ghijk", seed=1)  # the cache of the first turn reused
    assert set(json.loads(conv.turns[-1].answer)) == {"w"}
    assert set_structure(demo, "structure off") is None
    for bad, said in [("regex [a-", "not a regular expression"), ("grammar /nonexistent", "cannot read it"),
                      ("regex", "usage: /set regex PATTERN"), ("structure on", "usage: /set structure off")]:
        with pytest.raises(UsageError, match=re.escape(said)):
            set_structure(demo, bad)
