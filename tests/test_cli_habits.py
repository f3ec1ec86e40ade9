"""What people bring from ollama, llama.cpp and mlx-lm: completion, list, show, --version, -q everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_main

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["run", "chat", "fim", "serve", "pull", "list", "info", "show", "rm", "quantize", "bench"]


def dgemma(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma_cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_list_shows_the_bundled_demos_beside_the_store(capsys):
    assert run_main(["list"]) == 0
    out = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.out.splitlines()[1:]}
    assert {"demo", "demo-sudoku", "demo-shapes"} <= set(rows) and all("bundled" in rows[n] for n in rows)
    assert "store is empty" in out.err
    assert run_main(["list", "--json", "-q"]) == 0
    out = capsys.readouterr()
    names = [json.loads(line)["name"] for line in out.out.splitlines()]
    assert names[:3] == ["demo", "demo-sudoku", "demo-shapes"] and out.err == ""


def test_show_gives_format_parameters_and_template(capsys):
    template = (ROOT / "dgemma_cli" / "demo_sudoku" / "chat_template.jinja").read_text()
    generation = json.loads((ROOT / "dgemma_cli" / "demo_sudoku" / "generation_config.json").read_text())
    assert run_main(["show", "demo-sudoku"]) == 0
    out = capsys.readouterr().out
    assert "format:" in out and "parameters" in out and "template" in out and template.splitlines()[0] in out
    assert run_main(["show", "demo-sudoku", "--template"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == template.rstrip("\n")
    assert run_main(["show", "demo-sudoku", "--parameters"]) == 0
    params = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert params["t-max"] == str(generation["t_max"]) and params["steps"] == str(generation["max_denoising_steps"])
    assert run_main(["show", "demo-sudoku", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["template"] == template and d["parameters"]["t-max"] == generation["t_max"]
    assert run_main(["show", "/no/such/model"]) == 1


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_quiet(command):
    out = dgemma(command, "-h", COLUMNS="200").stdout
    assert "-q, --quiet" in out, out


def test_quiet_leaves_stderr_to_errors():
    r = dgemma("run", "-q", "--device", "cpu", "upper: hello diffusions")  # no --model: the demo, said without -q
    assert (r.returncode, r.stdout, r.stderr) == (0, "HELLO DIFFUSIONS\n", "")
    r = dgemma("info", "demo", "-q")
    assert r.returncode == 0 and r.stderr == "" and "format:" in r.stdout
    r = dgemma("run", "-q", "--model", "/no/such/model", "hi")
    assert r.returncode == 1 and r.stderr.startswith("dgemma: error:")


def test_version_and_shell_completion(tmp_path):
    from dgemma_cli import __version__

    assert dgemma("--version").stdout.strip() == f"dgemma {__version__}"
    script = str(Path(sys.executable).parent / "dgemma")  # completion keys on the program's name, as a shell runs it

    def complete(words: str, cword: int) -> list[str]:
        env = {**os.environ, "_DGEMMA_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}
        return subprocess.run([script], capture_output=True, text=True, timeout=60, env=env).stdout.split()

    assert complete("dgemma ru", 1) == ["run"]
    assert "--temperature" in complete("dgemma run --tem", 2)
    r = subprocess.run([script, "--install-completion", "bash"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "_DGEMMA_COMPLETE" in (tmp_path / ".bash_completions" / "dgemma.sh").read_text()
    assert ".bash_completions/dgemma.sh" in (tmp_path / ".bashrc").read_text()


def test_bench_takes_a_bundled_model_as_its_config():
    r = dgemma("bench", "--config", "demo", "--device", "cpu", "--steps", "5", "--json", "-q")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["config"].endswith("demo_model") and d["ms_per_step"] > 0
