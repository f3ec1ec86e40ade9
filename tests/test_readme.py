"""README.md, checked: every command in its ```sh blocks runs as written, and every link in the documentation leads
somewhere.

The commands run in README order through `bash -c`, in one scratch directory that holds links to the repository's
top-level entries (so that `make demo`, `.venv/bin/dgemma` and `python scripts/...` work there, while the files the
examples write land in the scratch directory), with this Python's bin directory first on PATH (`dgemma` and
`python` are the venv's), HOME and DGEMMA_HOME in a scratch home and HF_HUB_OFFLINE=1. Each must exit 0, and where
the README states the output (a `# -> TEXT` comment on the command's line, or alone on the line after it) stdout
must be that text: stdout's lines joined by single spaces, `...` standing for any text.

Commands that need more than a plain run:

* `dgemma serve` runs in the background until it says `serving ... at` on stderr; the commands after it in its
  block (the client example) run against it; then SIGTERM, and it must exit 0. If something else holds port 8000,
  the server and its client move to a free port together: the only change ever made to a command.
* `dgemma chat` runs in a pseudo-terminal: the test types what the README says to type, waits for the answer and
  leaves with Ctrl-D, expecting exit 0.
* `dgemma pull` runs against tests/fake_hub.py (HF_ENDPOINT), which serves the bundled demo model under the
  repository id the README pulls.

NOT_RUN lists the commands that are not run, each with its reason.
"""

from __future__ import annotations

import os
import pty
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_hub import FakeHub, serve_directory

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the venv's bin directory: `make test` runs the tests with .venv/bin/python

# The commands the README shows that this test does not run (keyed by their words, comments left out), and why.
NOT_RUN = {
    "make": "installs torch and dgemma into .venv from the package index",
    "make test": "the whole test suite, this file included: it would run itself",
    "make test-slow": "the slow checks, this file's commands included: it would run itself",
}

# What the test types into `dgemma chat`, and the answer it waits for (the README says to type the prompt).
CHAT_PROMPT, CHAT_ANSWER = "upper: hello diffusions", "HELLO DIFFUSIONS"

OUTPUT = re.compile(r"(?:^|\s)#\s*->\s*(.*)$")  # `# -> TEXT`: what the command prints


@dataclass
class Command:
    text: str  # as written (continuation lines joined with their backslash-newlines kept), comments included
    expect: str | None = None  # the README's `# -> TEXT`, if any

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text.replace("\\\n", " "), comments=True)

    @property
    def key(self) -> str:
        return " ".join(self.words)


def sh_blocks(markdown: str) -> list[list[Command]]:
    """The commands of each ```sh block, in order."""
    blocks = []
    for body in re.findall(r"^```sh\n(.*?)^```", markdown, re.S | re.M):
        commands: list[Command] = []
        pending = ""
        for line in body.splitlines():
            if pending:
                line, pending = pending + "\n" + line, ""
            if line.endswith("\\"):
                pending = line
                continue
            stripped = line.strip()
            if not stripped:
                continue
            if stripped.startswith("#"):
                match = OUTPUT.match(stripped)
                if match:  # the output of the command on the line before
                    assert commands and commands[-1].expect is None, f"a `# ->` line follows no command: {line!r}"
                    commands[-1].expect = match.group(1)
                continue
            match = OUTPUT.search(line.splitlines()[-1])
            commands.append(Command(line, match.group(1) if match else None))
        assert not pending, f"a ```sh block ends in a continuation line: {pending!r}"
        blocks.append(commands)
    return blocks


BLOCKS = sh_blocks(README.read_text())
ALL = [c for block in BLOCKS for c in block]


def steps() -> list[list[Command]]:
    """What runs, in README order: each command alone, except a `dgemma serve` with the commands after it in its block
    (its clients)."""
    out = []
    for block in BLOCKS:
        runnable = [c for c in block if c.key not in NOT_RUN]
        for i, c in enumerate(runnable):
            if c.words[:2] == ["dgemma", "serve"]:
                out.append(runnable[i:])
                break
            out.append([c])
    return out


STEPS = steps()


def matches(expect: str, stdout: str) -> bool:
    """stdout is `expect` (lines joined by single spaces; `...` stands for any text)."""
    flat = " ".join(stdout.split())
    pattern = ".*".join(re.escape(" ".join(part.split())) for part in expect.split("..."))
    return re.fullmatch(pattern, flat, re.S) is not None


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A scratch directory that looks like the repository's root, a scratch home, and the environment to run in."""
    cwd = tmp_path_factory.mktemp("readme")
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (cwd / entry.name).symlink_to(entry)
    home = tmp_path_factory.mktemp("home")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DGEMMA_", "HF_", "HUGGING_FACE_")) and k not in ("VIRTUAL_ENV", "TRITON_INTERPRET")}
    env.update(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", HOME=str(home), DGEMMA_HOME=str(home / "dgemma"),
               HF_HOME=str(home / ".cache" / "huggingface"), HF_HUB_OFFLINE="1", TMPDIR=str(home))
    return cwd, env


def run(command: Command, workspace, extra_env: dict | None = None, timeout: float = 120):
    """The command through `bash -c`, as written; extra_env's None values remove a variable."""
    cwd, env = workspace
    env = {**env, **(extra_env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(["bash", "-c", command.text], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def check(command: Command, done: subprocess.CompletedProcess) -> None:
    said = f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert done.returncode == 0, f"{command.text}\nexit {done.returncode}\n{said}"
    if command.expect is not None:
        assert matches(command.expect, done.stdout), \
            f"{command.text}\nthe README says: {command.expect}\n{said}"


def test_the_readme_shows_each_command_and_not_run_is_current():
    """The README has an example of every command (each one run below), and every entry of NOT_RUN is in it."""
    shown = {c.words[1] for c in ALL if c.words[:1] == ["dgemma"] and len(c.words) > 1}
    for name in ("run", "chat", "fim", "serve", "pull", "list", "show", "info", "quantize", "bench", "plan"):
        assert name in shown, f"README.md has no `dgemma {name}` example"
    assert any("|" in c.words and "dgemma" in c.words for c in ALL), "README.md has no pipe into dgemma"
    keys = {c.key for c in ALL}
    assert set(NOT_RUN) <= keys, f"NOT_RUN lists commands README.md no longer has: {set(NOT_RUN) - keys}"
    assert "make test" in keys and any(k.startswith(".venv/bin/dgemma ") for k in keys)
    assert any(c.expect for c in ALL)


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS, ids=[s[0].key[:60] for s in STEPS])
def test_readme_command(step, workspace):
    first = step[0]
    if first.words[:2] == ["dgemma", "serve"]:
        return serve_and_ask(step, workspace)
    (command,) = step
    if command.words[:2] == ["dgemma", "chat"]:
        return chat(command, workspace)
    if command.words[:2] == ["dgemma", "pull"]:
        return pull(command, workspace)
    if command.words[:1] == ["make"]:
        stamp, project = ROOT / ".venv" / ".installed", ROOT / "pyproject.toml"
        if not stamp.exists() or stamp.stat().st_mtime < project.stat().st_mtime:
            pytest.skip("the venv is older than pyproject.toml: this make would reinstall it (run `make` first)")
    check(command, run(command, workspace))


# ----------------------------------------------------------------------------- dgemma pull, against a fake Hub


def pull(command: Command, workspace) -> None:
    options_with_values = {"--quant", "--revision", "--policy"}
    words = command.words[2:]
    positional = [w for i, w in enumerate(words) if not w.startswith("-")
                  and not (i and words[i - 1] in options_with_values)]
    assert len(positional) <= 1, command.text
    from dgemma_cli.store.models import DEFAULT_REPO

    repo = positional[0] if positional else DEFAULT_REPO
    hub = FakeHub().start()
    try:
        serve_directory(hub, repo, ROOT / "dgemma_cli" / "demo_model")
        done = run(command, workspace, {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": None})
        check(command, done)
        assert hub.file_requests("model.safetensors", "GET"), "nothing was downloaded from the fake Hub"
        assert done.stdout.strip().startswith(repo + ":"), done.stdout  # the store name it made
    finally:
        hub.stop()


# ----------------------------------------------------------------------------- dgemma serve and its client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def serve_and_ask(step: list[Command], workspace) -> None:
    server, clients = step[0], step[1:]
    assert clients, "the README shows no client for `dgemma serve`"
    assert "--port" not in server.words
    if not port_is_free(8000):  # something else holds the default port: move server and clients together
        port = free_port()
        server = Command(server.text.replace("dgemma serve", f"dgemma serve --port {port}", 1), server.expect)
        clients = [Command(c.text.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), c.expect) for c in clients]
    cwd, env = workspace
    proc = subprocess.Popen(["bash", "-c", server.text], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err: list[str] = []
    ready = threading.Event()

    def read_stderr():
        for line in proc.stderr:
            err.append(line)
            if re.search(r"serving .* at http://", line):
                ready.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        end = time.time() + 90
        while not ready.wait(0.2):
            assert proc.poll() is None and time.time() < end, f"the server never said it serves:\n{''.join(err)}"
        for client in clients:
            check(client, run(client, workspace, timeout=60))
        proc.send_signal(signal.SIGTERM)  # bash -c runs one command by exec: this is dgemma's pid
        assert proc.wait(timeout=60) == 0, "".join(err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)


# ----------------------------------------------------------------------------- dgemma chat, in a pseudo-terminal


def chat(command: Command, workspace) -> None:
    pyte = pytest.importorskip("pyte")
    import fcntl
    import struct
    import termios

    cwd, env = workspace
    env = {**env, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1", "COLUMNS": "80", "LINES": "48"}
    screen = pyte.Screen(80, 48)
    stream = pyte.ByteStream(screen)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 48, 80, 0, 0))
    proc = subprocess.Popen(["bash", "-c", command.text], cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)

    def pump(timeout=0.1):
        while select.select([master], [], [], timeout)[0]:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            stream.feed(data)

    def prompts() -> int:
        return sum(line.startswith("›") for line in screen.display)

    def wait(what, condition, timeout=60.0):
        end = time.time() + timeout
        while time.time() < end:
            pump()
            if condition():
                return
        raise AssertionError(f"{what} never came; screen:\n" + "\n".join(screen.display))

    try:
        wait("the prompt", lambda: prompts() >= 1)
        os.write(master, (CHAT_PROMPT + "\r").encode())
        wait("the answer", lambda: prompts() >= 2 and any(CHAT_ANSWER in line for line in screen.display))
        os.write(master, b"\x04")  # Ctrl-D leaves
        end = time.time() + 30
        while proc.poll() is None and time.time() < end:
            pump()
        assert proc.poll() == 0, "\n".join(screen.display)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)


# ----------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    body = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", body, re.M)}


DOC_PAGES = [README] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("page", DOC_PAGES, ids=[p.relative_to(ROOT).as_posix() for p in DOC_PAGES])
def test_links_lead_somewhere(page):
    """Every relative link in the README and the docs pages names a file that exists, and an anchor its page has."""
    body = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", body):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} leads nowhere"
        assert ROOT in dest.parents or dest == ROOT, f"{page.name}: {target} leaves the repository"
        if anchor:
            assert dest.suffix == ".md" and anchor in anchors(dest), f"{page.name}: no heading for {target}"
