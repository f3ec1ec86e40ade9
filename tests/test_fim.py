"""`dgemma fim`: holes filled, every other byte kept, files rewritten safely, bad input refused in one line.

All runs go through the console entry point in-process (`dgemma_cli.cli.main`) on files under tmp_path, with the
bundled demo model on the CPU and a fixed seed. The demo model upper-cases 16-character texts and was trained on
the layout `upper: <text>\\n<TEXT>\\n` with a hole in the answer line.

Speed: the demo model is loaded once for the module (`dgemma_cli.engine.load` is wrapped with a cache for
`--model demo --device cpu`; any other model still goes through the real loader), and torch runs on one thread
for this module (on a busy 2-core machine, 2 threads were ~100x slower for this tiny model).
"""

from __future__ import annotations

import io
import os
import re
import stat
import sys
from pathlib import Path

import pytest

import dgemma_cli.engine as engine_mod
from cli_helpers import run_main
from dgemma_cli.cli import main

DEMO = ["--model", "demo", "--device", "cpu", "--seed", "0"]
MARKER = b"<FILL>"
BLOCK = b"upper: hello diffusions\nHELLO <FILL>USIONS\n"  # filled as HELLO DIFFUSIONS with --seed 0
BLOCK2 = b"upper: abc def 12 ghijk\nABC D<FILL>HIJK\n"


# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def demo_engine():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield engine_mod.load("demo", device="cpu", dtype="float32")
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _cached_demo(demo_engine, monkeypatch):
    """`--model demo --device cpu` reuses the module's engine; anything else goes to the real loader."""
    real = engine_mod.load

    def load(model, device="auto", dtype="auto"):
        if str(model) == "demo" and device == "cpu" and dtype in ("auto", "float32"):
            return demo_engine
        return real(model, device=device, dtype=dtype)

    monkeypatch.setattr(engine_mod, "load", load)


# ----------------------------------------------------------------------------------------------- helpers


def cli(capsysbinary, *args: str) -> tuple[int, bytes, str]:
    """Run `dgemma ARGS` in-process: (exit code, stdout bytes, stderr text)."""
    capsysbinary.readouterr()
    code = run_main(args)
    out, err = capsysbinary.readouterr()
    return code, out, err.decode("utf-8")


def fim(capsysbinary, path, *extra: str) -> tuple[int, bytes, str]:
    return cli(capsysbinary, "fim", str(path), *DEMO, *extra)


def assert_error(result: tuple[int, bytes, str], code: int, *fragments: str) -> str:
    """Exactly one stderr line starting `dgemma: error:`, the exit code, nothing on stdout, no traceback."""
    got, out, err = result
    assert "Traceback" not in err, err
    assert got == code, (got, err)
    assert out == b"", out
    assert err.startswith("dgemma: error: "), err
    assert err.endswith("\n") and err.count("\n") == 1, f"not exactly one line: {err!r}"
    msg = err[len("dgemma: error: "):].strip()
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def middles(original: bytes, output: bytes, marker: bytes = MARKER) -> list[bytes]:
    """The bytes that replaced each marker, asserting that every byte outside the markers is unchanged."""
    parts = original.split(marker)
    assert len(parts) >= 2, "no marker in the original"
    assert output.startswith(parts[0]), "bytes before the first hole changed"
    assert output.endswith(parts[-1]), "bytes after the last hole changed"
    pattern = b"(.*?)".join(re.escape(p) for p in parts)
    m = re.fullmatch(pattern, output, re.S)
    assert m is not None, "bytes between the holes changed"
    out = list(m.groups())
    for mid in out:
        mid.decode("utf-8")  # the filled file is still UTF-8
    return out


def snapshot(directory) -> dict[str, tuple[bytes, int]]:
    """Every entry of a directory: bytes (files) and mode bits."""
    out = {}
    for p in sorted(directory.iterdir()):
        st = p.lstat()
        out[p.name] = (p.read_bytes() if p.is_file() else b"", stat.S_IMODE(st.st_mode))
    return out


# ----------------------------------------------------------------------------------------------- 1. bytes kept

CASES = {
    "crlf": b"# notes\r\n" + BLOCK.replace(b"\n", b"\r\n") + b"after\r\n",
    "no-trailing-newline": b"first line\n" + BLOCK + b"last line, no newline",
    "tabs": b"\tindented\t\ttabs\n" + BLOCK + b"\t\tafter\t\n\t",
    "non-ascii": ("caf\u00e9 \u65e5\u672c \U0001F600\n".encode() + BLOCK
                  + "na\u00efve \u65e5\u672c\u8a9e \U0001F389 \u00e9\n".encode()),
    "everything": ("# \u00e9\t\u65e5\u672c \U0001F600\r\n\tcaf\u00e9\r\n".encode()
                   + b"upper: hello diffusions\r\nHELLO <FILL>USIONS\r\n"
                   + "\t\u00e9 \u65e5\u672c \U0001F389\r\nend \u00e9".encode()),
    # characters str.splitlines() treats as line breaks, and a lone CR
    "odd-line-breaks": ("page\x0cbreak \x85 \u2028 \u2029 \x1c\rlone cr\n".encode() + BLOCK
                        + "\x0c\u2028after\r".encode()),
}


@pytest.mark.parametrize("content", CASES.values(), ids=CASES.keys())
def test_stdout_keeps_every_byte_outside_the_hole(capsysbinary, tmp_path, content):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f, "--stdout")
    assert code == 0, err
    (mid,) = middles(content, out)
    assert MARKER not in mid
    assert f.read_bytes() == content  # --stdout never writes the file
    assert sorted(os.listdir(tmp_path)) == ["home", "in.txt"]


@pytest.mark.parametrize("content", CASES.values(), ids=CASES.keys())
def test_in_place_keeps_bytes_mode_and_a_backup(capsysbinary, tmp_path, content):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    f.chmod(0o640)
    code, out, err = fim(capsysbinary, f, "--in-place")
    assert code == 0, err
    assert out == b""
    middles(content, f.read_bytes())
    assert stat.S_IMODE(f.stat().st_mode) == 0o640
    orig = tmp_path / "in.txt.orig"
    assert orig.read_bytes() == content
    assert sorted(os.listdir(tmp_path)) == ["home", "in.txt", "in.txt.orig"]  # no temporary files left


def test_in_place_no_backup_leaves_no_orig(capsysbinary, tmp_path):
    content = CASES["everything"]
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    f.chmod(0o640)
    code, out, err = fim(capsysbinary, f, "--in-place", "--no-backup")
    assert code == 0, err
    middles(content, f.read_bytes())
    assert stat.S_IMODE(f.stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["home", "in.txt"]


def test_a_second_in_place_run_never_overwrites_the_first_original(capsysbinary, tmp_path):
    """FILE.orig keeps the file as it was before the first run; each later run keeps its own input in the next free
    FILE.orig.N, and says where in one line."""
    content = CASES["everything"]
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    f.chmod(0o640)
    code, _, err = fim(capsysbinary, f, "--in-place")
    assert code == 0 and ".orig" not in err, err  # the first run's backup is the expected FILE.orig: not said
    orig = tmp_path / "in.txt.orig"
    assert orig.read_bytes() == content
    second = f.read_bytes() + BLOCK2  # the user adds a new hole and fills again
    f.write_bytes(second)
    code, _, err = fim(capsysbinary, f, "--in-place")
    assert code == 0, err
    assert orig.read_bytes() == content  # the true original, byte for byte
    assert (tmp_path / "in.txt.orig.1").read_bytes() == second
    (said,) = [line for line in err.splitlines() if ".orig" in line]  # one line
    assert said.startswith("dgemma: ") and "in.txt.orig " in said and "in.txt.orig.1" in said and "kept" in said
    third = f.read_bytes()
    code, _, err = fim(capsysbinary, f, "--in-place", "--lines", "2:2")
    assert code == 0, err
    assert orig.read_bytes() == content and (tmp_path / "in.txt.orig.1").read_bytes() == second
    assert (tmp_path / "in.txt.orig.2").read_bytes() == third and "in.txt.orig.2" in err
    assert stat.S_IMODE((tmp_path / "in.txt.orig.2").stat().st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["home", "in.txt", "in.txt.orig", "in.txt.orig.1", "in.txt.orig.2"]


def test_a_users_own_orig_file_is_kept(capsysbinary, tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes(BLOCK)
    (tmp_path / "in.txt.orig").write_bytes(b"mine")
    code, _, err = fim(capsysbinary, f, "--in-place")
    assert code == 0, err
    assert (tmp_path / "in.txt.orig").read_bytes() == b"mine"
    assert (tmp_path / "in.txt.orig.1").read_bytes() == BLOCK


def test_no_backup_without_in_place_is_refused(capsysbinary, tmp_path):
    f, before = _setup_file(tmp_path, BLOCK)
    for extra in ([], ["--stdout"]):
        result = cli(capsysbinary, "fim", str(f), "--no-backup", *extra, "--model", str(tmp_path / "no-model"))
        assert_error(result, 2, "--no-backup", "--in-place")  # before loading a model
    assert snapshot(tmp_path) == before


def test_in_place_and_stdout_give_the_same_file(capsysbinary, tmp_path):
    content = CASES["non-ascii"]
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f, "--stdout")
    assert code == 0, err
    code, _, err = fim(capsysbinary, f, "--in-place")
    assert code == 0, err
    assert f.read_bytes() == out


# ----------------------------------------------------------------------------------------------- 2. outputs


def test_the_documented_example(capsysbinary, tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes(BLOCK)
    code, out, err = fim(capsysbinary, f, "--stdout")
    assert code == 0, err
    assert out == b"upper: hello diffusions\nHELLO DIFFUSIONS\n"


def test_default_output_is_a_unified_diff(capsysbinary, tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes(BLOCK)
    code, out, err = fim(capsysbinary, f)
    assert code == 0, err
    text = out.decode()
    assert text.startswith(f"--- {f}\n+++ {f}\n@@ "), text
    assert "\n-HELLO <FILL>USIONS\n" in text
    assert "\n+HELLO DIFFUSIONS\n" in text
    assert " upper: hello diffusions\n" in text
    assert f.read_bytes() == BLOCK


def test_relative_path_diff_has_a_b_prefixes(capsysbinary, tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_bytes(BLOCK)
    monkeypatch.chdir(tmp_path)
    code, out, err = fim(capsysbinary, "in.txt")
    assert code == 0, err
    assert out.startswith(b"--- a/in.txt\n+++ b/in.txt\n@@ "), out


def test_diff_of_a_last_line_without_newline_is_well_formed(capsysbinary, tmp_path):
    content = b"upper: hello diffusions\nHELLO <FILL>USIONS"
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f)
    assert code == 0, err
    lines = out.decode().split("\n")
    # every line of a unified diff starts with a header, a hunk mark, ' ', '-', '+' or '\'
    assert all(re.match(r"(--- |\+\+\+ |@@ | |-|\+|\\|$)", x) for x in lines), lines
    removed = [x for x in lines if x.startswith("-") and not x.startswith("--- ")]
    assert removed == ["-HELLO <FILL>USIONS"], removed  # not "-HELLO <FILL>USIONS+HELLO ..."
    assert "\\ No newline at end of file" in lines


def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


def test_dash_reads_stdin(capsysbinary, monkeypatch):
    content = CASES["everything"]
    _stdin(monkeypatch, content)
    code, out, err = cli(capsysbinary, "fim", "-", *DEMO, "--stdout")
    assert code == 0, err
    middles(content, out)
    _stdin(monkeypatch, content)
    code, out, err = cli(capsysbinary, "fim", "-", *DEMO)
    assert code == 0, err
    assert out.startswith(b"--- a/stdin\n+++ b/stdin\n@@ "), out


def _empty_infill(monkeypatch, which: set[int]) -> None:
    """Engine.infill returns nothing for the calls numbered in `which` (0-based) and generates the others."""
    real, calls = engine_mod.Engine.infill, []

    def infill(self, prefix, suffix, **kw):
        calls.append(prefix)
        return "" if len(calls) - 1 in which else real(self, prefix, suffix, **kw)

    monkeypatch.setattr(engine_mod.Engine, "infill", infill)


def test_holes_filled_with_nothing_are_named_on_stderr(capsysbinary, tmp_path, monkeypatch):
    content = BLOCK + b"\n" + BLOCK2 + b"\n" + BLOCK  # holes on lines 2, 5 and 8
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    _empty_infill(monkeypatch, {1, 2})
    code, out, err = fim(capsysbinary, f, "--stdout")
    assert code == 0, err  # the exit code is unchanged
    first, second, third = middles(content, out)
    assert first and second == b"" and third == b""
    assert err == "dgemma: " + str(f) + ": the model produced no text for 2 of 3 holes (lines 5, 8); they are " \
                  "now empty\n", err


def test_a_single_empty_hole_is_named(capsysbinary, tmp_path, monkeypatch):
    f = tmp_path / "in.txt"
    f.write_bytes(BLOCK)
    _empty_infill(monkeypatch, {0})
    code, out, err = fim(capsysbinary, f, "--in-place")
    assert code == 0, err
    assert f.read_bytes() == b"upper: hello diffusions\nHELLO USIONS\n"
    assert err == f"dgemma: {f}: the model produced no text for the hole on line 2; it is now empty\n", err


def test_filled_holes_say_nothing(capsysbinary, tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes(BLOCK)
    code, out, err = fim(capsysbinary, f)
    assert code == 0 and err == "", err
    assert b"\n+HELLO DIFFUSIONS\n" in out


# ----------------------------------------------------------------------------------------------- 3. holes, lines


def _record_infill(monkeypatch) -> list[tuple[str, str, str]]:
    """Wrap Engine.infill: every call's (prefix, suffix, middle) is recorded, generation is real."""
    calls = []
    real = engine_mod.Engine.infill

    def infill(self, prefix, suffix, **kw):
        middle = real(self, prefix, suffix, **kw)
        calls.append((prefix, suffix, middle))
        return middle

    monkeypatch.setattr(engine_mod.Engine, "infill", infill)
    return calls


def test_several_markers_fill_in_order(capsysbinary, tmp_path, monkeypatch):
    content = "head \u00e9\n".encode() + BLOCK + b"\n" + BLOCK2 + "tail \u65e5\u672c".encode()
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    calls = _record_infill(monkeypatch)
    code, out, err = fim(capsysbinary, f, "--stdout")
    assert code == 0, err
    first, second = middles(content, out)
    assert len(calls) == 2
    (p1, s1, m1), (p2, s2, m2) = calls
    assert (m1.encode(), m2.encode()) == (first, second)
    # the first hole sees the text up to the next marker; the second sees the first already filled
    assert p1.endswith("HELLO ") and s1 == "USIONS\n\nupper: abc def 12 ghijk\nABC D"
    assert p2.endswith(f"HELLO {m1}USIONS\n\nupper: abc def 12 ghijk\nABC D")
    assert s2 == "HIJK\ntail \u65e5\u672c"


LINES = b"upper: hello diffusions\nxxxxxxxxxxxxxxxx\nupper: abc def 12 ghijk\nABC DEF 12 GHIJK\n"


@pytest.mark.parametrize("spec,before,after", [
    ("2:2", 1, 2),  # the first block's answer line
    ("4:4", 3, 0),  # the last line
    ("2:3", 1, 1),
], ids=["middle-line", "last-line", "two-lines"])
def test_lines_regenerates_only_those_lines(capsysbinary, tmp_path, monkeypatch, spec, before, after):
    f = tmp_path / "in.txt"
    f.write_bytes(LINES)
    lines = LINES.splitlines(keepends=True)
    # The last regenerated line keeps its own line ending: it belongs to the suffix the model sees.
    head, tail = b"".join(lines[:before]), b"\n" + b"".join(lines[len(lines) - after:])
    calls = _record_infill(monkeypatch)
    code, out, err = fim(capsysbinary, f, "--stdout", "--lines", spec)
    assert code == 0, err
    assert out.startswith(head) and out.endswith(tail)
    assert out[len(head):len(out) - len(tail)] == calls[0][2].encode()
    assert len(calls) == 1
    assert calls[0][0] == head.decode() and calls[0][1] == tail.decode()
    # --in-place writes the same file
    code, _, err = fim(capsysbinary, f, "--in-place", "--lines", spec)
    assert code == 0, err
    assert f.read_bytes() == out and (tmp_path / "in.txt.orig").read_bytes() == LINES


def test_lines_ignores_markers(capsysbinary, tmp_path):
    content = b"keep <FILL> this\n" + LINES
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f, "--stdout", "--lines", "3:3")
    assert code == 0, err
    assert out.startswith(b"keep <FILL> this\nupper: hello diffusions\n")
    assert out.endswith(b"upper: abc def 12 ghijk\nABC DEF 12 GHIJK\n")


def test_lines_keeps_the_line_structure(capsysbinary, tmp_path):
    content = LINES.replace(b"\n", b"\r\n")
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f, "--stdout", "--lines", "2:2")
    assert code == 0, err
    got = out.split(b"\r\n")
    assert len(got) == len(content.split(b"\r\n")), out
    assert got[2] == b"upper: abc def 12 ghijk", out


FORM_FEED = b"page one\x0cstill line one\nupper: hello diffusions\n"


def test_lines_are_counted_by_newlines(capsysbinary, tmp_path, monkeypatch):
    content = FORM_FEED + b"xxxxxxxxxxxxxxxx\nend\n"
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    calls = _record_infill(monkeypatch)
    code, out, err = fim(capsysbinary, f, "--stdout", "--lines", "3:3")  # line 3 as wc -l / editors count
    assert code == 0, err
    assert calls[0][0] == FORM_FEED.decode() and calls[0][1] == "\nend\n", calls[0][:2]


def test_diff_around_a_form_feed_is_well_formed(capsysbinary, tmp_path):
    content = FORM_FEED + b"HELLO <FILL>USIONS\n"
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f)
    assert code == 0, err
    assert b"\n page one\x0cstill line one\n upper: hello diffusions\n-HELLO <FILL>USIONS\n" in out, out
    assert b"\n@@ -1,3 +1,3 @@\n" in out, out


# ----------------------------------------------------------------------------------------------- 4. failures


def _failing_infill(monkeypatch, exc) -> None:
    def infill(self, prefix, suffix, **kw):
        raise exc

    monkeypatch.setattr(engine_mod.Engine, "infill", infill)


def _setup_file(tmp_path, content=CASES["everything"]):
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    f.chmod(0o640)
    return f, snapshot(tmp_path)


def test_in_place_interrupted_during_generation(capsysbinary, tmp_path, monkeypatch):
    f, before = _setup_file(tmp_path)
    _failing_infill(monkeypatch, KeyboardInterrupt())
    assert_error(fim(capsysbinary, f, "--in-place"), 130, "interrupted")
    assert snapshot(tmp_path) == before  # same bytes, same mode, no .orig, no temporary files


def test_in_place_generation_error_leaves_the_file(capsysbinary, tmp_path, monkeypatch):
    """An unexpected exception in generation is one 'internal error' line, exit 1; the file is untouched."""
    f, before = _setup_file(tmp_path)
    _failing_infill(monkeypatch, RuntimeError("boom"))
    monkeypatch.delenv("DGEMMA_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["fim", str(f), *DEMO, "--in-place"])
    assert exit_info.value.code == 1
    err = capsysbinary.readouterr().err.decode()
    assert err.count("\n") == 1 and err.startswith("dgemma: error: internal error: RuntimeError: boom")
    assert snapshot(tmp_path) == before


def test_in_place_second_hole_failing_writes_nothing(capsysbinary, tmp_path, monkeypatch):
    content = BLOCK + b"\n" + BLOCK2
    f, before = _setup_file(tmp_path, content)
    real, calls = engine_mod.Engine.infill, []

    def infill(self, prefix, suffix, **kw):
        calls.append(prefix)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, prefix, suffix, **kw)

    monkeypatch.setattr(engine_mod.Engine, "infill", infill)
    assert_error(fim(capsysbinary, f, "--in-place"), 130, "interrupted")
    assert len(calls) == 2
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("target", ["backup", "file"])
def test_in_place_interrupted_while_writing(capsysbinary, tmp_path, monkeypatch, target):
    """Ctrl-C at the rename of the backup or of the file itself: the file keeps its bytes and mode and the
    temporary file is removed."""
    import dgemma_cli.cli.fim as fim_mod

    # a hole the demo model fills (text before `upper:` makes it fill nothing, which is said on stderr)
    f, before = _setup_file(tmp_path, BLOCK + "\t\u00e9 \u65e5\u672c \U0001F389\r\nend \u00e9".encode())
    real_replace = os.replace
    victim = f.name + ".orig" if target == "backup" else f.name

    def replace(src, dst):
        if os.path.basename(dst) == victim:
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(fim_mod.os, "replace", replace)
    assert_error(fim(capsysbinary, f, "--in-place"), 130, "interrupted")
    after = snapshot(tmp_path)
    assert after["in.txt"] == before["in.txt"]
    expected = set(before) | ({"in.txt.orig"} if target == "file" else set())
    assert set(after) == expected, after  # no .in.txt.*.tmp left
    if target == "file":
        assert after["in.txt.orig"][0] == f.read_bytes()


# ----------------------------------------------------------------------------------------------- 5. bad input

BAD = {
    # id: (file content or None, extra args, exit code, fragments)
    "missing-file": (None, [], 2, ["no such file"]),
    "binary": (b"upper: x\0y\nHELLO <FILL>\n", [], 2, ["binary"]),
    "not-utf8": (b"\xff\xfeupper: hello\n<FILL>\n", [], 2, ["UTF-8"]),
    "no-marker": (b"upper: hello diffusions\nHELLO DIFFUSIONS\n", [], 2, ["<FILL>", "marker"]),
    "other-marker": (BLOCK, ["--marker", "@@HOLE@@"], 2, ["@@HOLE@@"]),
    "empty-file": (b"", [], 2, ["empty"]),
    "marker-in-held-window": (b"upper: hello diffusions\nHELLO <FILL>US<FILL>IONS\n", [], 2,
                              ["held suffix", "line 2"]),
    "lines-past-end": (BLOCK, ["--lines", "2:3"], 2, ["--lines", "2 lines"]),
    "lines-zero": (BLOCK, ["--lines", "0:1"], 2, ["--lines", "count from 1"]),
    "lines-reversed": (BLOCK, ["--lines", "2:1"], 2, ["--lines", "before the start"]),
    "lines-word": (BLOCK, ["--lines", "abc"], 2, ["--lines", "A:B"]),
    "lines-single": (BLOCK, ["--lines", "1"], 2, ["--lines", "A:B"]),
    "lines-three": (BLOCK, ["--lines", "1:2:3"], 2, ["--lines", "A:B"]),
    "lines-dash": (BLOCK, ["--lines", "1-2"], 2, ["--lines", "A:B"]),
    "unknown-method": (BLOCK, ["--method", "magic"], 2, ["--method", "held"]),
    "empty-marker": (BLOCK, ["--marker", ""], 2, ["--marker"]),
    "negative-held-tokens": (BLOCK, ["--held-tokens", "-1"], 2, ["--held-tokens"]),
}


@pytest.mark.parametrize("content,extra,code,fragments", BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_error_line(capsysbinary, tmp_path, content, extra, code, fragments):
    f = tmp_path / "in.txt"
    if content is not None:
        f.write_bytes(content)
        f.chmod(0o640)
    before = snapshot(tmp_path)
    msg = assert_error(fim(capsysbinary, f, "--in-place", *extra), code, *fragments)
    if code == 1:
        assert str(f) in msg, msg  # file errors name the file
    assert snapshot(tmp_path) == before
    # without --in-place as well (diff output): the same error, still nothing on stdout
    assert_error(fim(capsysbinary, f, *extra), code, *fragments)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("spec,says", [
    ("3:1", "the end (1) is before the start (3)"),
    ("0:1", "lines count from 1"),
    ("1:0", "lines count from 1"),
    ("5:11", "ten.txt has only 10 lines"),
    ("11:12", "ten.txt has 10 lines, so line 11 is past its end"),
])
def test_a_bad_line_range_says_what_is_wrong(tmp_path, spec, says):
    """The real command on a ten-line file: a reversed range or a line 0 is not "ten.txt has 10 lines"."""
    import subprocess

    (tmp_path / "ten.txt").write_text("".join(f"{i}\n" for i in range(1, 11)))
    p = subprocess.run([sys.executable, "-m", "dgemma_cli", "fim", "--lines", spec, "ten.txt", "--model", "demo"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert (p.returncode, p.stdout) == (2, ""), (p.returncode, p.stdout, p.stderr)
    assert p.stderr.startswith(f"dgemma: error: --lines {spec}: {says}") and p.stderr.count("\n") == 1, p.stderr


def test_directory_is_refused(capsysbinary, tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    assert_error(fim(capsysbinary, d, "--in-place"), 2, "not a regular file")
    assert_error(fim(capsysbinary, d), 2, "not a regular file")
    assert list(d.iterdir()) == []


def test_in_place_with_stdin_is_refused(capsysbinary, monkeypatch):
    _stdin(monkeypatch, BLOCK)
    assert_error(cli(capsysbinary, "fim", "-", *DEMO, "--in-place"), 2, "--in-place", "stdin")
    assert sys.stdin.buffer.read() == BLOCK  # refused before reading anything


def test_in_place_with_stdout_is_refused(capsysbinary, tmp_path):
    f, before = _setup_file(tmp_path, BLOCK)
    assert_error(fim(capsysbinary, f, "--in-place", "--stdout"), 2, "--in-place", "--stdout")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("data,fragment", [(b"", "empty"), (b"\xff\xfe<FILL>", "UTF-8"), (b"no hole\n", "marker")],
                         ids=["empty", "not-utf8", "no-marker"])
def test_bad_stdin(capsysbinary, monkeypatch, data, fragment):
    _stdin(monkeypatch, data)
    msg = assert_error(cli(capsysbinary, "fim", "-", *DEMO), 2, fragment)
    assert msg.startswith("stdin:"), msg


def test_unknown_method_is_refused_before_loading_a_model(capsysbinary, tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes(BLOCK)
    result = cli(capsysbinary, "fim", str(f), "--method", "magic", "--model", str(tmp_path / "no-model"),
                 "--device", "cpu")
    assert_error(result, 2, "--method")


# ----------------------------------------------------------------------------------------------- 6. methods


@pytest.mark.parametrize("method", ["prefix", "instruct", "held"])
def test_methods_run_and_produce_a_diff(capsysbinary, tmp_path, method):
    content = CASES["everything"]
    f = tmp_path / "in.txt"
    f.write_bytes(content)
    code, out, err = fim(capsysbinary, f, "--method", method)
    assert code == 0, err
    assert out.startswith(f"--- {f}\n+++ {f}\n@@ ".encode()), out
    assert b"\n-HELLO <FILL>USIONS\r\n" in out
    code, out, err = fim(capsysbinary, f, "--method", method, "--stdout")
    assert code == 0, err
    middles(content, out)
    assert f.read_bytes() == content


def _as_another_user(cmd: list[str]) -> list[str]:
    """Permissions bind only a user who is not root: as root, run the command as nobody (setpriv)."""
    import os
    import shutil

    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file permissions cannot be made to bind")
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd]


@pytest.mark.parametrize("case", ["unreadable file", "read-only directory"])
def test_permission_problems_are_one_line_before_any_model_loads(case):
    """An unreadable file, or --in-place in a directory that cannot be written: one line, exit 2, checked before the
    model is loaded (the model named here does not exist, so reaching the load would say so instead)."""
    import os
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    d = Path(tempfile.mkdtemp(prefix="dgemma-perm-"))
    try:
        f = d / "code.py"
        f.write_bytes(BLOCK)
        if case == "unreadable file":
            f.chmod(0o000)
        d.chmod(0o555 if case == "read-only directory" else 0o755)
        cmd = _as_another_user([sys.executable, "-m", "dgemma_cli", "fim", str(f), "--in-place", "--model",
                                str(d / "no-such-model"), "--device", "cpu"])
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "HOME": str(d), "HF_HUB_OFFLINE": "1"})
        assert p.returncode == 2, p.stderr
        assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr and "internal error" not in p.stderr
        assert ("cannot read" if case == "unreadable file" else "--in-place cannot write") in p.stderr, p.stderr
        assert "no-such-model" not in p.stderr
        d.chmod(0o755)
        f.chmod(0o644)
        assert sorted(x.name for x in d.iterdir()) == ["code.py"] and f.read_bytes() == BLOCK
    finally:
        d.chmod(0o755)
        for x in d.iterdir():
            x.chmod(0o644)
            x.unlink()
        d.rmdir()
