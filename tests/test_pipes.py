"""`dgemma run` in a pipe: only answers on stdout, --each-line batches in input order, JSON Lines."""

import io
import json
import sys

import pytest

from cli_helpers import interrupt_after_first_canvas, run_main

LINES = "upper: hello diffusions\n\nupper: abc def 12 ghijk\nupper: 940 c wzvu 505 h\n"
EXPECTED = ["HELLO DIFFUSIONS", "", "ABC DEF 12 GHIJK", "940 C WZVU 505 H"]


def run(capsys, monkeypatch, stdin, *args):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = run_main(["run", "--model", "demo", "--device", "cpu", "--seed", "0", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("batch", ["1", "3", "8"])
def test_each_line_answers_in_input_order(capsys, monkeypatch, batch):
    code, out, err = run(capsys, monkeypatch, LINES, "--each-line", "--batch-size", batch)
    assert code == 0, err
    assert out.split("\n")[:-1] == EXPECTED
    assert "\x1b" not in out + err  # no colour codes or live view when nobody watches a terminal


def test_each_line_json_lines(capsys, monkeypatch):
    code, out, err = run(capsys, monkeypatch, LINES, "--each-line", "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["text"] for r in rows] == EXPECTED
    assert [r["prompt"] for r in rows] == LINES.splitlines()
    assert rows[1] == {"prompt": "", "text": "", "skipped": True}
    assert all(r["tokens_per_forward"] > 0 for r in rows if not r.get("skipped"))


def test_plain_stdin_prompt_prints_only_the_answer(capsys, monkeypatch):
    code, out, err = run(capsys, monkeypatch, "upper: hello diffusions\n")
    assert (code, out) == (0, "HELLO DIFFUSIONS\n")


@pytest.mark.parametrize("stdin,args", [("\n\n", ["--each-line"]), (LINES, ["--each-line", "--batch-size", "0"])])
def test_each_line_usage_errors(capsys, monkeypatch, stdin, args):
    code, out, err = run(capsys, monkeypatch, stdin, *args)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("dgemma: error:")


def test_ctrl_c_keeps_the_finished_canvases_and_exits_130(capsys, monkeypatch):
    """Ctrl-C while a second canvas is being denoised: the first canvas's text is printed, then exit 130."""
    interrupt_after_first_canvas(monkeypatch)
    code, out, err = run(capsys, monkeypatch, "upper: hello diffusions\n", "--view", "none")
    assert code == 130
    assert out == "HELLO DIFFUSIONS\n"
    assert err.strip().splitlines()[-1] == "dgemma: error: interrupted"


@pytest.mark.parametrize("args", [["--each-line", "--batch-size", "1"], ["--each-line", "--json"]])
def test_a_reader_that_leaves_early_is_no_failure(args):
    """`dgemma run --each-line ... | head -n 1`: once the reader has closed the pipe, the next write fails; that
    ends the run with exit 0 and nothing on stderr (click alone would make it exit 1, silently)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    lines = "".join(f"upper: line {i}\n" for i in range(40))
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_cli", "run", "-q", "--model", "demo", "--device", "cpu",
                             *args], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    proc.stdin.write(lines.encode())
    proc.stdin.close()
    first = proc.stdout.readline()  # as head -n 1: one line, then the pipe is closed
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 0, err
    assert first and err == ""
