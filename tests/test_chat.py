"""`dgemma chat`: the conversation's cache reuse (unit), and the real command under a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dgemma_cli.chat import Conversation
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
    from dgemma_cli.chat import save_markdown

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
    """`dgemma chat` in a pseudo-terminal of 80 x 24, its output fed to a terminal emulator (pyte)."""

    def __init__(self, args: list[str], env: dict):
        import pyte

        self.screen = pyte.Screen(80, 24)
        self.stream = pyte.ByteStream(self.screen)
        self.master, slave = pty.openpty()
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=ROOT,
                                     start_new_session=True)
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

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())


@pytest.mark.slow
def test_chat_in_a_pseudo_terminal(tmp_path):
    pytest.importorskip("pyte")
    env = dict(os.environ, TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1", DGEMMA_HOME=str(tmp_path / "dgemma"),
               COLUMNS="80", LINES="24", PYTHONPATH=str(ROOT))
    env.pop("DGEMMA_MODEL", None)
    term = Terminal([sys.executable, "-m", "dgemma_cli", "chat", "--model", "demo", "--device", "cpu", "--seed", "0"],
                    env)
    try:
        term.wait_for("/help for commands")
        term.wait_for("›")
        term.type("upper: hello diffusions\r")
        term.wait_for("HELLO DIFFUSIONS")
        term.type("upper: abc def 12 ghijk\r")
        term.wait_for("upper: abc def 12 ghijk")
        deadline = time.time() + 60
        while time.time() < deadline:  # the second answer arrives: the prompt comes back a third time
            term.pump()
            if term.text().count("›") >= 3:
                break
        assert term.text().count("›") >= 3, term.text()
        term.type(f"/save {tmp_path / 'talk.md'}\r")
        term.wait_for("(saved")
        term.type("/reset\r")
        term.wait_for("(new conversation)")
        term.type("/bogus\r")
        term.wait_for("unknown command /bogus")
        term.type("\x03")  # Ctrl-C at the prompt clears the line; the session goes on
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
        history = (tmp_path / "dgemma" / "chat_history").read_text()
        assert "upper: hello diffusions" in history  # prompts persist across sessions
    finally:
        if term.proc.poll() is None:
            os.killpg(term.proc.pid, signal.SIGKILL)
        os.close(term.master)


def test_chat_refuses_a_pipe(capsys, monkeypatch):
    import io

    from cli_helpers import run_main

    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert run_main(["chat", "--model", "demo", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a terminal" in err[0]
