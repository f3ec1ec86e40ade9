"""`dgemma run` as a new user meets it: finished work survives Ctrl-C and arrives as it is done, an
empty answer is said, no flag is silently ignored, cheap flags fail before torch loads, and what people coming
from ollama, llm or llama.cpp type works (-h, unquoted words, --quiet).

The demo model answers `upper: <16 characters>` prompts; with --seed 0 each batch of LINES is answered exactly.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
from pathlib import Path
import sys
import threading
import time

import pytest
import torch

from cli_helpers import interrupt_after_first_canvas, run_main

LINES = ["upper: hello diffusions", "", "upper: abc def 12 ghijk", "upper: 940 c wzvu 505 h"]
EXPECTED = ["HELLO DIFFUSIONS", "", "ABC DEF 12 GHIJK", "940 C WZVU 505 H"]
DEMO = ["--model", "demo", "--device", "cpu", "--seed", "0"]


def cli(capsys, monkeypatch, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    """`dgemma ARGS` in-process: (exit code, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()
    code = run_main(args)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, *fragments: str) -> str:
    assert "Traceback" not in err, err
    assert err.startswith("dgemma: error: ") and err.count("\n") == 1 and err.endswith("\n"), repr(err)
    for f in fragments:
        assert f in err, (f, err)
    return err


# ------------------------------------------------------------------ 1. Ctrl-C keeps finished work; per batch


def _reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)  # end of output


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_each_line_writes_each_batch_when_done_and_ctrl_c_keeps_them(as_json):
    """A real process in a pipe: the first batch's answers arrive while later batches are still being generated
    (the process is still running); Ctrl-C (SIGINT to its process group, as a terminal sends it) then ends it
    with 130 and one line on stderr, and every answer written so far is there, whole and in input order."""
    repeats = 500  # 500 batches of 3 prompts (about 15 ms each on an idle CPU): seconds of work after the first
    stdin = "\n".join(LINES * repeats) + "\n"
    args = [sys.executable, "-m", "dgemma_cli", "run", "--each-line", *DEMO, "--batch-size", "3"]
    args += ["--json"] if as_json else []
    # SIGINT as a terminal leaves it, whatever this test run inherited: a shell's background job (`make test &`)
    # ignores SIGINT, and an ignored signal stays ignored across exec, in the child too
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(p.stdout, q), daemon=True).start()
    try:
        p.stdin.write(stdin)
        p.stdin.close()
        first = [q.get(timeout=300) for _ in range(len(LINES))]  # one batch: its 3 answers and the blank line
        assert None not in first, first
        running = p.poll() is None  # the answers came before the work was done: per batch, not at the end
        os.killpg(p.pid, signal.SIGINT)
        code = p.wait(timeout=120)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    rest = []
    while (line := q.get(timeout=30)) is not None:
        rest.append(line)
    out = first + rest
    assert running, "the first batch's answers arrived only when the whole input was done"
    assert code == 130, (code, err)
    n = len(out)
    one_error_line(err, "interrupted", f"answering {n} of {len(LINES) * repeats} lines")
    assert all(line.endswith("\n") for line in out), out[-1:]  # whole lines only
    assert n % len(LINES) == 0 and len(LINES) <= n < len(LINES) * repeats, n  # whole batches, not all of them
    for i, line in enumerate(out):
        if as_json:
            row = json.loads(line)
            assert (row["prompt"], row["text"]) == (LINES[i % 4], EXPECTED[i % 4]), (i, row)
        else:
            assert line == EXPECTED[i % 4] + "\n", (i, line)


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_each_line_writes_a_batch_before_the_next_is_generated(capsys, monkeypatch, as_json):
    """In-process and without timing: when batch k starts, stdout holds exactly the answers of batches 1..k-1."""
    from dgemma_cli.engine import Engine

    real = Engine.generate
    new_output = []  # what reached stdout since the previous batch started

    def spy(self, prompts, **kwargs):
        new_output.append(capsys.readouterr().out)
        return real(self, prompts, **kwargs)

    monkeypatch.setattr(Engine, "generate", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(LINES * 3) + "\n"))
    capsys.readouterr()
    code = run_main(["run", "--each-line", *DEMO, "--batch-size", "3", *(["--json"] if as_json else [])])
    new_output.append(capsys.readouterr().out)
    assert code == 0
    assert len(new_output) == 4 and new_output[0] == ""  # nothing before the first batch; then one batch each
    for chunk in new_output[1:]:
        rows = chunk.splitlines()
        got = [json.loads(r).get("text") for r in rows] if as_json else rows
        assert got == EXPECTED, chunk


def test_ctrl_c_with_json_prints_the_finished_canvases_as_a_json_object(capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--json")
    assert code == 0, err
    whole = json.loads(out)
    interrupt_after_first_canvas(monkeypatch)
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--json")
    assert code == 130
    one_error_line(err, "interrupted")
    part = json.loads(out)
    assert part["interrupted"] is True
    assert part["text"] == "HELLO DIFFUSIONS"
    # the demo's answer fits one canvas: what was finished is the whole answer, cut and counted the same way
    for key in ("text", "thought", "token_ids", "prompt_token_ids", "canvases", "tokens_per_forward"):
        assert part[key] == whole[key], key


def _interrupted_run(args: list[str], needle: bytes) -> tuple[int, str, str]:
    """`dgemma run ARGS` as a real process: stdout a pipe, stderr a terminal (a pseudo-terminal, so that the live
    view draws; with --view-delay it pauses after each step). Ctrl-C (SIGINT to its process group, as a terminal
    sends it) once `needle` is on the screen -> (exit code, stdout, stderr)."""
    import pty
    import select

    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "100", "LINES": "40"}
    p = subprocess.Popen([sys.executable, "-m", "dgemma_cli", "run", *args], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=slave, env=env, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    screen = b""
    try:
        deadline = time.monotonic() + 300
        while needle not in screen and time.monotonic() < deadline and p.poll() is None:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    screen += os.read(master, 65536)
                except OSError:
                    break
        assert needle in screen, screen[-2000:]
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=120)
        while select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            screen += chunk
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)
    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace")).replace("\r", "")
    return p.returncode, out.decode(), err


def test_ctrl_c_before_the_first_canvas_still_prints_the_json_object():
    """A real Ctrl-C while the first canvas is being denoised (the live view paused after its first step): stdout
    gets the JSON object docs/run.md promises, with nothing finished in it and "interrupted": true; exit 130."""
    code, out, err = _interrupted_run(["upper: hello diffusions", *DEMO, "--json", "--view", "live",
                                       "--view-delay", "60"], b"step 1/")
    assert code == 130, (code, out, err)
    assert err.strip().splitlines()[-1] == "dgemma: error: interrupted" and "Traceback" not in err, err
    part = json.loads(out)
    assert part["interrupted"] is True
    assert (part["text"], part["thought"], part["token_ids"], part["canvases"]) == ("", "", [], [])
    assert part["tokens_per_forward"] == 0.0 and part["prompt_token_ids"], part


@pytest.mark.slow  # make test's time: the slow suite (CI) runs it
def test_ctrl_c_mid_answer_prints_the_finished_canvases_as_a_json_object():
    """A real Ctrl-C during the third canvas: the JSON object holds the first two, as the whole run's begins."""
    args = ["hello there, how are you doing today", *DEMO, "--raw", "--max-new-tokens", "96", "--json"]
    whole = subprocess.run([sys.executable, "-m", "dgemma_cli", "run", *args], capture_output=True, text=True,
                           timeout=300, stdin=subprocess.DEVNULL)
    assert whole.returncode == 0, whole.stderr
    whole = json.loads(whole.stdout)
    assert len(whole["canvases"]) >= 3, whole  # the answer spans canvases (the demo model rambles on raw text)
    # a second's pause after each step drawn: the third canvas (48 steps here) is still running when Ctrl-C comes
    code, out, err = _interrupted_run([*args, "--view", "live", "--view-delay", "1"], b"canvas 3 ")
    assert code == 130, (code, out, err)
    assert err.strip().splitlines()[-1] == "dgemma: error: interrupted" and "Traceback" not in err, err
    part = json.loads(out)
    assert part["interrupted"] is True and part["canvases"] == whole["canvases"][:2], (part, whole)
    assert part["token_ids"] and whole["token_ids"][: len(part["token_ids"])] == part["token_ids"]
    assert part["prompt_token_ids"] == whole["prompt_token_ids"]


def test_tokens_per_forward_counts_the_answers_tokens_only():
    """16 letters in 2 steps are 8.0 tokens per forward pass: the end token is not the answer's (it was 8.5)."""
    r = subprocess.run([sys.executable, "-m", "dgemma_cli", "run", "upper: hello diffusions", *DEMO, "--json"],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["text"] == "HELLO DIFFUSIONS" and len(d["token_ids"]) == 16, d
    assert d["tokens_per_forward"] == len(d["token_ids"]) / sum(d["canvases"]), d


# ------------------------------------------------------------------ 2. an empty answer is said


def _answers_end_at_once(monkeypatch) -> None:
    """The model ends every answer at its first position (what an empty answer is), through the real engine."""
    import dgemma_cli.engine as engine_mod
    from dgemma_cli.sampler import CanvasDone, Done

    real = engine_mod.generate_events

    def empty(*args, **kwargs):
        for ev in real(*args, **kwargs):
            if isinstance(ev, CanvasDone):  # an end-of-sequence id first, then pads
                ev.tokens = torch.zeros_like(ev.tokens)
                ev.tokens[:, 0] = 1
                ev.kept = [1] * len(ev.kept)
            if isinstance(ev, Done):
                ev.token_ids = [[] for _ in ev.token_ids]
            yield ev

    monkeypatch.setattr(engine_mod, "generate_events", empty)


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_empty_answer_is_said_on_stderr(capsys, monkeypatch, as_json):
    _answers_end_at_once(monkeypatch)
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO,
                         *(["--json"] if as_json else []))
    assert code == 0, err
    if as_json:
        assert json.loads(out)["text"] == ""
    else:
        assert out == "\n"  # stdout stays an answer: the empty one
    assert err == "dgemma: the model produced no text\n"
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--quiet",
                         *(["--json"] if as_json else []))
    assert (code, err) == (0, "")


def test_empty_answers_in_each_line_are_said_by_line(capsys, monkeypatch):
    _answers_end_at_once(monkeypatch)
    code, out, err = cli(capsys, monkeypatch, "run", "--each-line", *DEMO, stdin="\n".join(LINES) + "\n")
    assert code == 0, err
    assert out == "\n" * 4
    assert err.splitlines() == [f"dgemma: line {i}: the model produced no text" for i in (1, 3, 4)]


def test_an_answer_with_text_has_no_notice(capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO)
    assert (code, out, err) == (0, "HELLO DIFFUSIONS\n", "")


# ------------------------------------------------------------------ 3. no flag silently ignored


def test_batch_size_without_each_line_is_refused(capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--batch-size", "4")
    assert (code, out) == (2, "")
    one_error_line(err, "--batch-size", "--each-line")


@pytest.mark.parametrize("view", ["live", "plain"])
def test_view_with_each_line_is_refused(capsys, monkeypatch, view):
    """--view draws one prompt's canvas: with --each-line it did nothing, so it is refused there."""
    code, out, err = cli(capsys, monkeypatch, "run", "--each-line", *DEMO, "--view", view, stdin=LINES[0] + "\n")
    assert (code, out) == (2, "")
    one_error_line(err, "--view", "--each-line")


def test_view_without_each_line_is_used(capsys, monkeypatch):
    """Without --each-line --view does what it says (so it is not refused there): plain prints progress."""
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--view", "plain")
    assert (code, out) == (0, "HELLO DIFFUSIONS\n")
    assert err.startswith("dgemma: canvas 1 done in ")
    code, out, err = cli(capsys, monkeypatch, "run", "--each-line", *DEMO, "--view", "none", stdin=LINES[0] + "\n")
    assert (code, out, err) == (0, "HELLO DIFFUSIONS\n", "")


def test_raw_does_not_need_the_chat_template(capsys, monkeypatch, tmp_path):
    """--raw never renders the chat template, so a broken one does not stop it; chat mode names the file."""
    from dgemma_cli.engine import DEMO_MODEL

    model = tmp_path / "demo-broken-template"
    shutil.copytree(DEMO_MODEL, model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}")  # does not compile
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", "--model", str(model), "--raw",
                         "--device", "cpu", "--seed", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["prompt_token_ids"]
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", "--model", str(model),
                         "--device", "cpu")
    assert (code, out) == (1, "")
    one_error_line(err, "chat_template.jinja", "syntax error")


@pytest.mark.parametrize("value", ["bogus", "/no/such/model/dir"])
def test_bad_dgemma_model_names_the_variable(capsys, monkeypatch, value):
    monkeypatch.setenv("DGEMMA_MODEL", value)
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", "--device", "cpu")
    assert (code, out) == (1, "")
    one_error_line(err, "DGEMMA_MODEL", value)


def test_dgemma_model_is_used(capsys, monkeypatch):
    monkeypatch.setenv("DGEMMA_MODEL", "demo")
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", "--device", "cpu", "--seed", "0")
    assert (code, out, err) == (0, "HELLO DIFFUSIONS\n", "")


@pytest.mark.parametrize("flag,value", [("--device", "tpu"), ("--device", "cuda:x"), ("--dtype", "float64")])
def test_bad_device_or_dtype_fails_before_torch_is_imported(flag, value):
    code = ("import sys\nfrom dgemma_cli.cli import main\n"
            f"try:\n    main(['run', 'upper: hello diffusions', '--model', 'demo', {flag!r}, {value!r}])\n"
            "except SystemExit as e:\n    sys.stdout.write(f'{e.code} {\"torch\" in sys.modules}')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert p.stdout == "2 False", (p.stdout, p.stderr)
    one_error_line(p.stderr, flag, value)


# ------------------------------------------------------------------ 4. what people coming from ollama/llm expect


def test_dash_h_is_help_on_every_command(capsys, monkeypatch):
    import typer

    from dgemma_cli.cli import app

    commands = sorted(typer.main.get_command(app).commands)
    assert {"run", "chat", "fim", "pull", "list", "info", "rm", "quantize", "bench"} <= set(commands)
    for args in [["-h"]] + [[c, "-h"] for c in commands]:
        code, out, err = cli(capsys, monkeypatch, *args)
        assert (code, err) == (0, ""), (args, err)
        assert out.startswith("Usage") and "-h, --help" in out, args


def test_several_unquoted_words_are_one_prompt(capsys, monkeypatch):
    code, quoted, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--json")
    assert code == 0, err
    code, words, err = cli(capsys, monkeypatch, "run", "upper:", "hello", "diffusions", *DEMO, "--json")
    assert code == 0, err
    assert json.loads(words)["prompt_token_ids"] == json.loads(quoted)["prompt_token_ids"]
    assert json.loads(words)["text"] == "HELLO DIFFUSIONS"
    code, out, err = cli(capsys, monkeypatch, "run", *DEMO, "upper:", "hello", "diffusions")
    assert (code, out) == (0, "HELLO DIFFUSIONS\n")  # options before the words too


@pytest.mark.parametrize("args", [[], ["-"]], ids=["absent", "dash"])
def test_stdin_prompt_still_works(capsys, monkeypatch, args):
    code, out, err = cli(capsys, monkeypatch, "run", *args, *DEMO, stdin="upper: hello diffusions\n")
    assert (code, out) == (0, "HELLO DIFFUSIONS\n"), err


def test_quiet_leaves_stderr_to_errors(capsys, monkeypatch):
    # without --model the demo model is announced on stderr; --quiet drops that notice
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", "--device", "cpu", "--seed", "0")
    assert code == 0 and "demo model" in err
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", "--device", "cpu", "--seed", "0",
                         "--quiet")
    assert (code, out, err) == (0, "HELLO DIFFUSIONS\n", "")
    code, out, err = cli(capsys, monkeypatch, "run", "--each-line", "-q", "--device", "cpu", "--seed", "0",
                         stdin="\n".join(LINES) + "\n")
    assert (code, out.splitlines(), err) == (0, EXPECTED, "")
    # errors still speak
    code, out, err = cli(capsys, monkeypatch, "run", "x", "--quiet", "--model", "demo", "--device", "tpu")
    assert (code, out) == (2, "")
    one_error_line(err, "--device")


def test_quiet_refuses_a_view(capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch, "run", "x", *DEMO, "--quiet", "--view", "plain")
    assert (code, out) == (2, "")
    one_error_line(err, "--quiet and --view plain exclude each other")


# ------------------------------------------------------------------ 10. each finished canvas streams to stdout


def test_a_pipe_receives_the_answer_before_generation_ends(capsys, monkeypatch):
    """stdout (a pipe here) holds the first canvas's text when the sampler reports it is done, before the run ends;
    the whole output is still exactly the answer and one newline."""
    import dgemma_cli.engine as engine_mod
    from dgemma_cli.sampler import Done

    real = engine_mod.generate_events
    seen_at_done = []

    def watched(*args, **kwargs):
        for ev in real(*args, **kwargs):
            if isinstance(ev, Done):
                seen_at_done.append(sys.stdout.getvalue())
            yield ev

    monkeypatch.setattr(engine_mod, "generate_events", watched)
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO)
    assert code == 0, err
    assert seen_at_done == ["HELLO DIFFUSIONS"]  # written as its canvas finished (the newline ends the run)
    assert out == "HELLO DIFFUSIONS\n"


def _demo_tokenizer():
    from dgemma_cli.engine import load

    return load("demo", device="cpu", dtype="float32").tokenizer


@pytest.mark.parametrize("canvas", [1, 2, 3, 5, 8])
def test_streamed_canvases_add_up_to_the_answer(canvas):
    """An answer cut into canvases of any size: each write is text no later canvas changes (no trailing
    whitespace, no half character before the end), and the writes plus `finish` are exactly the answer's line."""
    from dgemma_cli.answer import FinishedCanvases
    from dgemma_cli.config import GenerationSettings

    tok = _demo_tokenizer()
    text = "Upper case:  two  spaces, tabs\tand\nnew lines; é ü ß 😀 end  "
    ids = tok.encode(text)
    settings = GenerationSettings(max_new_tokens=1000, eos_token_ids=(1,), pad_token_id=0)
    answer = tok.decode_answer(ids)[1]
    writes: list[str] = []
    stream = FinishedCanvases(tok, settings, write=writes.append)
    body = ids + [1]  # the end-of-sequence id, then pads to a whole canvas
    body += [0] * (-len(body) % canvas)
    for k in range(0, len(body), canvas):
        stream.add(body[k : k + canvas], steps=1, kept=0)
        so_far = "".join(writes)
        assert answer.startswith(so_far)
        if not stream.ended:
            assert so_far == so_far.rstrip() and not so_far.endswith("\ufffd")
    stream.finish(answer)
    assert "".join(writes) == answer + "\n"
    assert len(writes) > 2  # it did stream


def test_an_interrupted_stream_keeps_the_finished_canvases(capsys, monkeypatch):
    interrupt_after_first_canvas(monkeypatch)
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO)
    assert code == 130
    assert out == "HELLO DIFFUSIONS\n"  # streamed, then completed and ended with its newline, once


# ------------------------------------------------------------------ 10. the sampler's settings as flags


def test_sampler_flags_reach_the_sampler(capsys, monkeypatch):
    """--confidence-threshold 0 turns the early stop off: every canvas takes exactly --steps steps."""
    code, out, _ = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--json")
    assert code == 0 and json.loads(out)["canvases"][0] < 7  # the demo stops early by itself
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, "--json", "--steps", "7",
                         "--confidence-threshold", "0", "--t-max", "0.9", "--t-min", "0.1", "--entropy-bound", "0.2",
                         "--stability-threshold", "2")
    assert code == 0, err
    assert json.loads(out)["canvases"] == [7]


UNSURE = "what is this? ~~"  # a prompt the demo is unsure of: it takes several steps, and the settings matter


@pytest.fixture(scope="module")
def demo_engine():
    from dgemma_cli.engine import load

    return load("demo", device="cpu", dtype="float32")


@pytest.mark.parametrize("args,settings", [
    (["--t-max", "2"], {"t_max": 2.0}),
    (["--t-max", "0.1"], {"t_max": 0.1, "t_min": 0.1}),  # alone under the model's t_min: t_min moves with it
    (["--t-min", "1.5"], {"t_min": 1.5, "t_max": 1.5}),  # alone over the model's t_max: t_max moves with it
    (["--entropy-bound", "2"], {"entropy_bound": 2.0}),
    (["--stability-threshold", "4"], {"stability_threshold": 4}),
    (["--temperature", "1.8"], {"t_max": 0.8 * 1.8, "t_min": 0.4 * 1.8}),
    (["--temp", "0"], {"greedy": True}),
])
def test_each_sampler_flag_changes_the_answer_as_the_engine_does(capsys, monkeypatch, demo_engine, args, settings):
    """Each flag reaches the sampler: the run equals the engine's with that setting, and differs from the run
    without it (in tokens or in steps), so a flag that were checked and then dropped would fail here."""
    base = demo_engine.generate(UNSURE, seed=3, max_new_tokens=48)
    want = demo_engine.generate(UNSURE, seed=3, max_new_tokens=48, **settings)
    assert (want.token_ids, want.steps_per_canvas) != (base.token_ids, base.steps_per_canvas)
    code, out, err = cli(capsys, monkeypatch, "run", UNSURE, *DEMO[:4], "--json", "--seed", "3", "--max-new-tokens",
                         "48", *args)
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == want.token_ids[0] and got["canvases"] == want.steps_per_canvas[0]


@pytest.mark.parametrize("args,fragment", [
    (["--t-min", "-1"], "--t-min"),
    (["--t-max", "0"], "--t-max must be > 0"),
    (["--temperature", "2.5"], "--temperature must be between 0"),
    (["--temp", "0.5", "--t-max", "0.9"], "not both"),
    (["--entropy-bound", "0"], "--entropy-bound must be > 0"),
    (["--confidence-threshold", "-0.1"], "--confidence-threshold must be >= 0"),
    (["--stability-threshold", "-1"], "--stability-threshold must be >= 0"),
    (["--t-min", "0.9", "--t-max", "0.5"], "--t-min must be between 0 and --t-max"),
])
def test_sampler_flags_out_of_range_fail_before_the_model_loads(capsys, monkeypatch, args, fragment):
    import dgemma_cli.engine as engine_mod

    monkeypatch.setattr(engine_mod, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = cli(capsys, monkeypatch, "run", "upper: hello diffusions", *DEMO, *args)
    assert code == 2 and out == ""
    one_error_line(err, fragment)


def test_sampler_flags_in_help():
    for command in ("run", "chat"):
        out = subprocess.run([sys.executable, "-m", "dgemma_cli", command, "-h"], capture_output=True, text=True,
                             env=dict(os.environ, COLUMNS="200")).stdout
        for flag in ("--max-new-tokens", "--steps", "--t-max", "--t-min", "--entropy-bound",
                     "--confidence-threshold", "--stability-threshold"):
            assert flag in out, (command, flag)
    out = subprocess.run([sys.executable, "-m", "dgemma_cli", "bench", "-h"], capture_output=True, text=True,
                         env=dict(os.environ, COLUMNS="200")).stdout
    assert "at least 5" in out  # the minimum that `bench --steps 4` is refused by


@pytest.mark.parametrize("how", [["--view", "plain"], []])  # asked for, and TERM=dumb's default
def test_plain_progress_and_the_answer_never_share_a_line_on_a_terminal(how):
    """stdout and stderr on one terminal: the answer's text streams to stdout as canvases finish, without a newline
    until it ends; each progress line must start a line of its own, not follow the answer's partial line."""
    import pty
    import select

    master, slave = pty.openpty()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_cli", "run", *DEMO[:4], "--seed", "0", "--max-new-tokens",
                             "64", "--raw", *how, "hello"], cwd=root, stdin=slave, stdout=slave, stderr=slave,
                            env={**os.environ, "TERM": "dumb", "HF_HUB_OFFLINE": "1"})
    os.close(slave)
    data = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the child closed the terminal
            chunk = b""
        if not chunk:
            break
        data += chunk
    os.close(master)
    assert proc.wait(30) == 0
    lines = data.decode().replace("\r", "").split("\n")
    progress = [line for line in lines if "dgemma: canvas" in line]
    assert len(progress) >= 2, data  # several canvases, so the answer was mid-line when progress came
    assert all(line.startswith("dgemma: canvas") for line in progress), lines


@pytest.mark.parametrize("regex, limit, satisfied", [("[A-Z ]{16}", 64, True), ("[A-Z]{40}", 2, False)])
def test_run_json_marks_whether_a_structured_answer_was_completed(capsys, monkeypatch, regex, limit, satisfied):
    """A structured answer is marked in the JSON object; one whose shortest answer cannot fit --max-new-tokens at
    all is refused in one line before the first step (the server's 400), one line or each line alike."""
    code, out, err = cli(capsys, monkeypatch, "run", *DEMO, "-q", "--json", "--regex", regex, "--max-new-tokens",
                         str(limit), "upper: hello diffusions")
    if not satisfied:
        assert code == 2 and out == "" and err.count("\n") == 1 and "raise max_tokens" in err, err
    else:
        assert code == 0 and json.loads(out)["satisfied"] is True, err
    code, out, err = cli(capsys, monkeypatch, "run", *DEMO, "-q", "--json", "--each-line", "--regex", regex,
                         "--max-new-tokens", str(limit), stdin="upper: hello diffusions\n")
    if not satisfied:
        assert code == 2 and out == "" and err.count("\n") == 1 and "raise max_tokens" in err, err
    else:
        assert code == 0 and json.loads(out)["satisfied"] is True, err
    code, out, err = cli(capsys, monkeypatch, "run", *DEMO, "-q", "--json", "upper: hello diffusions")
    assert code == 0 and "satisfied" not in json.loads(out)  # no structure, nothing to satisfy
