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
    # as the README says, from the user's shell, which typer detects (shellingham: the parent process); `; exit` keeps
    # bash from exec-ing the command in its place, which would leave make's sh as the parent under `make test`
    r = subprocess.run(["bash", "-c", '"$0" --install-completion; exit $?', script], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "_DGEMMA_COMPLETE" in (tmp_path / ".bash_completions" / "dgemma.sh").read_text()
    assert ".bash_completions/dgemma.sh" in (tmp_path / ".bashrc").read_text()


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_bench_takes_a_bundled_model_as_its_config():
    r = dgemma("bench", "--config", "demo", "--device", "cpu", "--steps", "5", "--json", "-q")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["config"].endswith("demo_model") and d["ms_per_step"] > 0


# ----------------------------------------------------------------------------- what people type most: no torch

HEAVY = ("torch", "transformers", "triton")
# Runs `dgemma ARGS` as the console script does (main(), argv[0] "dgemma" so that completion keys on it) and writes,
# however it ends, its exit status and which heavy modules were imported to the file named by $DGEMMA_TEST_REPORT.
NO_TORCH_CHILD = """
import json, os, sys
sys.argv = ["dgemma", *sys.argv[1:]]
code = 0
try:
    from dgemma_cli.cli import main
    main()
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
finally:
    with open(os.environ["DGEMMA_TEST_REPORT"], "w") as f:
        json.dump({"code": code, "heavy": [m for m in %r if m in sys.modules]}, f)
""" % (HEAVY,)


@pytest.mark.parametrize("args,complete", [
    (["--version"], None), (["--help"], None), (["-h"], None), (["run", "--help"], None),
    (["show", "demo-sudoku"], None), (["show", "demo", "--json"], None), (["show", "demo-sudoku", "--template"], None),
    (["show", "demo", "--parameters"], None), (["info", "demo-sudoku"], None),
    (["info", "demo", "--json"], None), (["list"], None), (["list", "--json"], None), (["ls"], None),
    ([], ("dgemma sh", 1)), ([], ("dgemma show de", 2)), ([], ("dgemma run --tem", 2)), ([], ("dgemma ", 1)),
], ids=lambda v: " ".join(v) if isinstance(v, list) else (f"complete '{v[0]}'" if v else ""))
def test_what_people_type_most_never_imports_torch(tmp_path, args, complete):
    """--version, --help, show, info, list/ls and every Tab press of shell completion answer without importing
    torch (seconds on a busy machine: `dgemma show demo-sudoku` took 6 s with it, 0.6 s without)."""
    report = tmp_path / "report.json"
    env = {**os.environ, "DGEMMA_TEST_REPORT": str(report), "DGEMMA_HOME": str(tmp_path / "home"),
           "HF_HUB_OFFLINE": "1"}
    if complete is not None:
        env.update(_DGEMMA_COMPLETE="complete_bash", COMP_WORDS=complete[0], COMP_CWORD=str(complete[1]))
    p = subprocess.run([sys.executable, "-c", NO_TORCH_CHILD, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=env, stdin=subprocess.DEVNULL)
    got = json.loads(report.read_text())
    assert got["code"] == 0 and p.stdout and "Traceback" not in p.stderr, (got, p.stdout[-500:], p.stderr)
    assert got["heavy"] == [], f"dgemma {' '.join(args) or complete} imported {got['heavy']}"


def test_show_and_info_of_a_quantized_checkpoint_say_the_same_as_before():
    """describe() reads headers without torch: its answer for quantized fixtures, the bundled models and a model
    with a vision tower is the one the loader's own readers give (weights.index_checkpoint, torch dtypes)."""
    from dgemma_cli.config import ModelConfig
    from dgemma_cli.checkpoint.layout import DTYPE_SIZES
    from dgemma_cli.checkpoint.names import BUNDLED
    from dgemma_cli.store.models import _TORCH_DTYPE_NAMES, describe
    from dgemma_cli.checkpoint.weights import _DTYPES, index_checkpoint, read_format, text_prefix

    assert set(DTYPE_SIZES) == set(_DTYPES) == set(_TORCH_DTYPE_NAMES)
    assert all(DTYPE_SIZES[k] == _DTYPES[k].itemsize and _TORCH_DTYPE_NAMES[k] == str(_DTYPES[k])[6:] for k in _DTYPES)
    fixtures = ROOT / "tests" / "fixtures"
    for path in [*BUNDLED.values(), *(p for p in fixtures.iterdir() if (p / "config.json").is_file())]:
        d = describe(path)
        records = index_checkpoint(path)
        fmt = read_format(path, ModelConfig.from_dir(path).raw)
        assert d["format"] == (fmt.label if fmt else "unquantized"), path
        assert d["dtype_on_disk"] == str(records[text_prefix(records) + "embed_tokens.weight"].dtype)[6:], path


@pytest.mark.parametrize("config", ["real", "mid", "tiny", "demo", "demo-sudoku", "demo-shapes"])
def test_weight_bytes_counted_from_the_config_equal_the_built_models(config):
    """footprint.weight_bytes counts the parameters from the config's shapes (no torch, for `dgemma show`): the same
    bytes, part by part, as the modules model.DiffusionGemma builds (on the meta device)."""
    import torch

    from dgemma_cli.bench import config_for
    from dgemma_cli.config import ModelConfig
    from dgemma_cli.checkpoint.footprint import DEFAULT_POLICY, packed_bytes, weight_bytes
    from dgemma_cli.model import DiffusionGemma, Experts

    cfg = ModelConfig.from_dict(config_for(config)[1])
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    for fmt in ("bf16", "fp8", "int8", "nvfp4"):
        for policy in ("experts", "all", None):
            want = {"experts": 0, "dense": 0, "embedding": 0, "other": 0}
            counted = set()
            for path, mod in model.named_modules():
                if isinstance(mod, Experts):
                    E, two_i, H = mod.gate_up_proj.shape
                    want["experts"] += E * (packed_bytes(fmt, two_i, H) + packed_bytes(fmt, H, two_i // 2))
                    counted.update({f"{path}.gate_up_proj", f"{path}.down_proj"})
                elif isinstance(mod, torch.nn.Linear) and path.split(".")[-2] in ("self_attn", "mlp"):
                    q = fmt if (policy or DEFAULT_POLICY[fmt]) == "all" else "bf16"
                    want["dense"] += packed_bytes(q, mod.out_features, mod.in_features)
                    counted.add(f"{path}.weight")
            for name, p in model.named_parameters():
                if name not in counted:
                    want["embedding" if name.startswith("embed_tokens") else "other"] += 2 * p.numel()
            assert weight_bytes(cfg, fmt, policy) == want, (config, fmt, policy)


def test_show_of_an_adapter_says_what_it_adapts():
    """`dgemma list` names the bundled adapter: `show` of it answers as `info` does, not "no such model"."""
    r = dgemma("show", "demo-sudoku-lora")
    assert r.returncode == 0 and "lora (PEFT)" in r.stdout and r.stderr == "", (r.stdout, r.stderr)
    r = dgemma("show", "demo-sudoku-lora", "--template")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "LoRA adapter" in r.stderr, r.stderr
