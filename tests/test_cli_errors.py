"""Bad input to `dgemma run`: exactly one `dgemma: error: ...` line on stderr, nothing on stdout, no traceback,
and the documented exit code (2 usage error, 1 model/runtime error, 130 interrupted).

Damaged checkpoints are always copies (shutil.copytree into tmp_path) of the shared session fixtures.
Most tests run the console entry point in-process (fast); a few run the real console script in a subprocess.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import run_main

CPU = ["--device", "cpu", "--dtype", "float32"]
PROMPT = "Why is the sky blue?"
UP_PROJ = "model.decoder.layers.0.mlp.up_proj.weight"


# ----------------------------------------------------------------------------------------------- helpers


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `dgemma ARGS` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()  # drop anything earlier (e.g. fixture building)
    code = run_main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_error(result: tuple[int, str, str], code: int, *fragments: str) -> str:
    """Exactly one stderr line starting `dgemma: error:`, the given exit code, empty stdout, no traceback."""
    got, out, err = result
    assert "Traceback" not in err, err
    assert got == code, (got, err)
    assert out == "", out
    assert err.startswith("dgemma: error: "), err
    assert err.endswith("\n") and err.count("\n") == 1, f"not exactly one line: {err!r}"
    msg = err[len("dgemma: error: "):].strip()
    assert msg, "empty error message"
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def copy_checkpoint(checkpoints, tmp_path: Path, name: str = "five_to_one", dest: str = "model") -> Path:
    dst = tmp_path / dest
    shutil.copytree(checkpoints[name], dst)
    return dst


def run_model(capsys, model: Path, *extra: str) -> tuple[int, str, str]:
    return cli(capsys, "run", PROMPT, "--model", str(model), *CPU, *extra)


def edit_config(model: Path, edit) -> None:
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def load_tensors(model: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(model / "model.safetensors"))


def save_tensors(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


def shard(model: Path, n: int = 3) -> list[str]:
    """Replace model.safetensors by n shards and a model.safetensors.index.json (Hugging Face layout)."""
    tensors = load_tensors(model)
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for i, f in enumerate(files):
        part = {k: tensors[k] for k in names[i::n]}
        save_tensors(part, model / f)
        for k, v in part.items():
            weight_map[k] = f
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (model / "model.safetensors").unlink()
    return files


def rewrite_header(path: Path, edit) -> None:
    """Edit the JSON header of a safetensors file in place, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header = edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def generate_json(capsys, model: Path) -> dict:
    code, out, err = cli(capsys, "run", "The quick brown fox jumps over the lazy dog", "--model", str(model),
                         *CPU, "--seed", "5", "--raw", "--json", "--max-new-tokens", "32", "--steps", "6")
    assert code == 0, err
    assert "Traceback" not in err
    obj = json.loads(out)
    assert obj["token_ids"], "the run generated nothing: the comparison would be vacuous"
    return obj


# ----------------------------------------------------------------------------------------------- model paths


def test_missing_model_directory(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    assert_error(run_model(capsys, missing), 1, str(missing), "no such model directory")


def test_model_path_is_a_file(capsys, tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0" * 16)
    assert_error(run_model(capsys, f), 1, str(f), "not a directory")


def test_model_directory_without_config(capsys, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    assert_error(run_model(capsys, d), 1, "config.json")


# ----------------------------------------------------------------------------------------------- config.json


def test_config_not_diffusion_gemma(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
    }))
    assert_error(run_model(capsys, model), 1, "not a DiffusionGemma checkpoint", "llama")


def test_config_invalid_json(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "config.json").write_text('{"model_type": "diffusion_gemma", "text_config": {')
    assert_error(run_model(capsys, model), 1, "config.json", "JSON")


def test_config_not_an_object(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "config.json").write_text("[1, 2, 3]")
    assert_error(run_model(capsys, model), 1, "config.json")


def test_config_missing_text_config_keys(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)

    def drop(cfg):
        del cfg["text_config"]["vocab_size"]
        del cfg["text_config"]["num_experts"]

    edit_config(model, drop)
    assert_error(run_model(capsys, model), 1, "text_config is missing", "vocab_size", "num_experts")


def test_config_without_text_config(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    edit_config(model, lambda cfg: cfg.pop("text_config"))
    assert_error(run_model(capsys, model), 1, "text_config")


def test_invalid_generation_config(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "generation_config.json").write_text("{not json")
    assert_error(run_model(capsys, model), 1, "generation_config.json")


# ----------------------------------------------------------------------------------------------- tensor files


def test_missing_tensor_file(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "model.safetensors").unlink()
    assert_error(run_model(capsys, model), 1, "model.safetensors")


def test_sharded_checkpoint_with_a_missing_shard(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    files = shard(model)
    (model / files[1]).unlink()
    assert_error(run_model(capsys, model), 1, files[1], "missing")


def test_sharded_checkpoint_with_invalid_index(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    shard(model)
    (model / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert_error(run_model(capsys, model), 1, "model.safetensors.index.json")


def test_truncated_tensor_file(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    f = model / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    assert_error(run_model(capsys, model), 1, "model.safetensors", "truncated")


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03", b"this is not a safetensors file at all"],
                         ids=["empty", "three-bytes", "garbage"])
def test_corrupt_tensor_file(capsys, checkpoints, tmp_path, content):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "model.safetensors").write_bytes(content)
    assert_error(run_model(capsys, model), 1, "model.safetensors")


def test_checkpoint_missing_a_text_tensor(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    tensors = load_tensors(model)
    del tensors[UP_PROJ]
    save_tensors(tensors, model / "model.safetensors")
    assert_error(run_model(capsys, model), 1, "missing tensor", UP_PROJ)


def test_checkpoint_missing_the_embedding(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    tensors = load_tensors(model)
    del tensors["model.decoder.embed_tokens.weight"]
    save_tensors(tensors, model / "model.safetensors")
    assert_error(run_model(capsys, model), 1, "embed_tokens")


def test_tensor_with_wrong_shape(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    tensors = load_tensors(model)
    good = list(tensors[UP_PROJ].shape)
    tensors[UP_PROJ] = tensors[UP_PROJ].t().contiguous()
    save_tensors(tensors, model / "model.safetensors")
    assert_error(run_model(capsys, model), 1, UP_PROJ, str(good[::-1]), str(good))


def test_tensor_with_integer_dtype(capsys, checkpoints, tmp_path):
    import torch

    model = copy_checkpoint(checkpoints, tmp_path)
    tensors = load_tensors(model)
    tensors[UP_PROJ] = torch.zeros(tensors[UP_PROJ].shape, dtype=torch.int32)
    save_tensors(tensors, model / "model.safetensors")
    assert_error(run_model(capsys, model), 1, UP_PROJ, "dtype")


@pytest.mark.parametrize("edit", [
    lambda h: {**h, UP_PROJ: {k: v for k, v in h[UP_PROJ].items() if k != "data_offsets"}},
    lambda h: {**h, UP_PROJ: 5},
    lambda h: {**h, UP_PROJ: {**h[UP_PROJ], "data_offsets": "ab"}},
], ids=["no-data_offsets", "entry-not-an-object", "offsets-not-numbers"])
def test_malformed_safetensors_header(capsys, checkpoints, tmp_path, edit):
    model = copy_checkpoint(checkpoints, tmp_path)
    rewrite_header(model / "model.safetensors", edit)
    assert_error(run_model(capsys, model), 1, "model.safetensors")


def test_tensor_whose_bytes_do_not_match_its_shape(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)

    def shrink(h):
        a, b = h[UP_PROJ]["data_offsets"]
        h[UP_PROJ]["data_offsets"] = [a, a + (b - a) // 2]  # header shape unchanged: bytes for half of it
        return h

    rewrite_header(model / "model.safetensors", shrink)
    assert_error(run_model(capsys, model), 1, UP_PROJ)


def test_missing_tokenizer_for_text_prompt(capsys, checkpoints, tmp_path):
    model = copy_checkpoint(checkpoints, tmp_path)
    (model / "tokenizer.json").unlink()
    assert_error(run_model(capsys, model, "--max-new-tokens", "16"), 1, "tokenizer.json")


# ----------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("prompt", ["", "   ", " \n\t \n"], ids=["empty", "spaces", "whitespace-newlines"])
def test_empty_or_whitespace_prompt(capsys, checkpoints, prompt):
    code = cli(capsys, "run", prompt, "--model", str(checkpoints["five_to_one"]), *CPU)
    assert_error(code, 2, "empty prompt")


@pytest.mark.parametrize("stdin", ["", "  \n\n"], ids=["empty", "whitespace"])
def test_empty_stdin(capsys, checkpoints, monkeypatch, stdin):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert_error(cli(capsys, "run", "-", "--model", str(checkpoints["five_to_one"]), *CPU), 2, "empty prompt")
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert_error(cli(capsys, "run", "--model", str(checkpoints["five_to_one"]), *CPU), 2, "empty prompt")


def test_prompt_from_stdin_works(capsys, checkpoints, monkeypatch):
    """Control for the stdin cases: a real prompt on stdin runs and prints only the JSON answer."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n"))
    code, out, err = cli(capsys, "run", "-", "--model", str(checkpoints["five_to_one"]), *CPU, "--raw",
                         "--json", "--max-new-tokens", "16", "--steps", "2", "--seed", "0")
    assert code == 0, err
    assert json.loads(out)["prompt_token_ids"]


def test_prompt_longer_than_context(capsys, checkpoints):
    model = checkpoints["short_context"]
    assert json.loads((model / "config.json").read_text())["text_config"]["max_position_embeddings"] == 64
    long_prompt = " ".join(["word"] * 200)
    msg = assert_error(cli(capsys, "run", long_prompt, "--model", str(model), *CPU, "--raw",
                           "--max-new-tokens", "16"), 2, "context is 64")
    assert "prompt is" in msg
    # control: the same model runs a short prompt, so it is the prompt's length that was refused
    code, out, err = cli(capsys, "run", "hi", "--model", str(model), *CPU, "--raw", "--json",
                         "--max-new-tokens", "16", "--steps", "2", "--seed", "0")
    assert code == 0, err


def test_system_prompt_with_raw_is_a_usage_error(capsys, checkpoints):
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), "--raw",
                     "--system", "be brief"), 2, "--system", "--raw")


# ----------------------------------------------------------------------------------------------- options


def test_unknown_option(capsys, checkpoints):
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), "--bogus"), 2,
                 "--bogus")


def test_unknown_command(capsys):
    assert_error(cli(capsys, "frobnicate"), 2, "frobnicate")


def test_bad_dtype(capsys, checkpoints):
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), "--device", "cpu",
                     "--dtype", "float64"), 2, "--dtype", "float64")


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda0"])
def test_bad_device(capsys, checkpoints, device):
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), "--device", device,
                     "--dtype", "float32"), 2, "--device", device)


def test_cuda_requested_without_cuda(capsys, checkpoints):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), "--device", "cuda"), 2,
                 "CUDA")


def test_non_integer_option(capsys, checkpoints):
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), "--max-new-tokens",
                     "many"), 2, "--max-new-tokens")


@pytest.mark.parametrize("flag", ["--max-new-tokens", "--steps"])
def test_zero_budget_is_a_usage_error(capsys, checkpoints, flag):
    assert_error(cli(capsys, "run", PROMPT, "--model", str(checkpoints["five_to_one"]), *CPU, flag, "0"), 2,
                 flag)


def test_interrupt_exits_130(capsys, checkpoints, monkeypatch):
    import dgemma_cli.engine as engine

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "load", interrupted)
    assert_error(run_model(capsys, checkpoints["five_to_one"]), 130, "interrupted")


def test_help_in_process(capsys):
    for args in (["--help"], [], ["run", "--help"]):
        code, out, err = cli(capsys, *args)
        assert code == 0, (args, err)
        assert "Usage" in out and err == "", args


# ----------------------------------------------------------------------------------------------- layouts


def test_sharded_checkpoint_generates_the_same_tokens(capsys, checkpoints, tmp_path):
    single = checkpoints["five_to_one"]
    model = copy_checkpoint(checkpoints, tmp_path)
    shard(model)
    assert not (model / "model.safetensors").exists()
    want, got = generate_json(capsys, single), generate_json(capsys, model)
    for key in ("prompt_token_ids", "token_ids", "text", "canvases"):
        assert got[key] == want[key], key


def test_encoder_layout_generates_the_same_tokens(capsys, checkpoints, tmp_path):
    """The same weights stored the other way round: the stack shared by encoder and decoder under
    `model.encoder.language_model.*`; decoder-only tensors (self_conditioning, the decoder's per-layer
    layer_scalar) stay under `model.decoder.*`. transformers loads this layout to identical parameters."""
    single = checkpoints["five_to_one"]
    model = copy_checkpoint(checkpoints, tmp_path)
    tensors = load_tensors(model)
    moved = {}
    for k, v in tensors.items():
        if (k.startswith("model.decoder.") and not k.startswith("model.decoder.self_conditioning.")
                and not k.endswith(".layer_scalar")):
            moved["model.encoder.language_model." + k[len("model.decoder."):]] = v
        else:
            moved[k] = v
    assert not any(k.startswith("model.decoder.embed_tokens") for k in moved)
    save_tensors(moved, model / "model.safetensors")
    want = generate_json(capsys, single)
    got = generate_json(capsys, model)
    for key in ("prompt_token_ids", "token_ids", "text", "canvases"):
        assert got[key] == want[key], key


# ----------------------------------------------------------------------------------------------- real processes


def console_script() -> list[str]:
    script = Path(sys.executable).parent / ("dgemma.exe" if os.name == "nt" else "dgemma")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dgemma_cli"]


def test_console_script_error_has_no_traceback(tmp_path):
    missing = tmp_path / "no-such-model"
    p = subprocess.run(console_script() + ["run", PROMPT, "--model", str(missing)], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert_error((p.returncode, p.stdout, p.stderr), 1, "no such model directory")


def test_module_usage_error_has_no_traceback_and_no_torch():
    """`python -m dgemma_cli` with a usage error: one line, exit 2, and torch was never imported."""
    code = ("import sys\nfrom dgemma_cli.cli import main\n"
            "try:\n    main(['run', '', '--model', 'nowhere'])\n"
            "except SystemExit as e:\n    sys.stdout.write(f'{e.code} {\"torch\" in sys.modules}')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr
    assert p.stdout == "2 False", p.stdout
    assert p.stderr == "dgemma: error: empty prompt\n"
    p = subprocess.run([sys.executable, "-m", "dgemma_cli", "run", "--bogus"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert_error((p.returncode, p.stdout, p.stderr), 2, "--bogus")


def test_help_is_fast():
    cmd = console_script() + ["--help"]
    times = []
    for _ in range(3):  # best of three: the first run may pay for writing .pyc files
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        times.append(time.perf_counter() - t0)
        assert p.returncode == 0, p.stderr
        assert "Usage" in p.stdout and p.stderr == ""
    assert min(times) < 0.5, times


def test_importing_the_cli_does_not_import_torch():
    p = subprocess.run([sys.executable, "-c", "import sys, dgemma_cli.cli.commands; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False"


@pytest.mark.parametrize("args", [
    ["run", "--model", "/nonexistent", "hi"],
    ["run", "--model", "/nonexistent", "--each-line"],
    ["fim", "README.md", "--model", "/nonexistent"],
    ["serve", "--model", "/nonexistent"],
    ["serve", "--header-timeout", "0"],
    ["serve", "--header-timeout", "nan"],
    ["info", "/nonexistent"],
    ["quantize", "/nonexistent", "--out", "/tmp/x", "--quant", "nvfp4"],
    ["quantize", "demo", "--out", "/tmp/x", "--quant", "q7"],
    ["pull", "not-a-repo-id"],
    ["pull", "a/b", "--quant", "q7"],
    ["run", "--temperature", "9", "hi"],
    ["run", "--bogus"],
])
def test_errors_that_need_no_model_come_before_torch(args):
    """A missing model, a bad --quant, a bad flag: said before torch is imported (which takes seconds)."""
    code = ("import sys\nfrom dgemma_cli.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    sys.stdout.write(f'{e.code} {\"torch\" in sys.modules}')\n")
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=root, capture_output=True, text=True, timeout=120,
                       input="", env={**os.environ, "DGEMMA_HOME": "/nonexistent-home", "HF_HUB_OFFLINE": "1"})
    status, torch_imported = p.stdout.split()
    assert status in ("1", "2") and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    assert torch_imported == "False", p.stderr


# ----------------------------------------------------------------------------------------------- said in its terms


def dgemma_process(*args: str) -> tuple[int, str, str]:
    """The real console script in a subprocess: (exit code, stdout, stderr)."""
    p = subprocess.run(console_script() + list(args), capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("pattern,says", [
    (r"(a)\1", "backreferences"),
    (r"(?P<x>a)(?P=x)", "backreferences"),
    (r"(?=a)a", "lookarounds"),
    (r"b(?<!a)", "lookarounds"),
    (r"x(?:y|(?!z)z)", "lookarounds"),
    (r"(a)?(?(1)b|c)", "conditionals"),
    (r"ab^c", "anchors"),
    (r"\bword", "word boundaries"),
    ("[a-z]{100000}", "the repeat count 100,000 is over the limit of 512"),
    ("(.{1,100}){1,100}", "nested repeat counts multiply to 10,000, over the limit of 512"),
])
def test_a_regex_the_answer_cannot_be_held_to_is_said_in_its_terms(pattern, says):
    """Not "Failed to build DFA error building NFA", nor a JSON schema's words: what in the expression is the
    trouble, before the model loads."""
    msg = assert_error(dgemma_process("run", "--model", "demo", "--regex", pattern, "hi"), 2, "--regex", says)
    assert "DFA" not in msg and "NFA" not in msg and "maxLength" not in msg and "schema" not in msg, msg


@pytest.mark.parametrize("regex", ["^[A-Z ]{16}$",  # the other anchors in make test-slow (make test's time)
                                   pytest.param("[A-Z ]{16}$", marks=pytest.mark.slow),
                                   pytest.param(r"\A[A-Z ]{16}\Z", marks=pytest.mark.slow)])
def test_a_regex_anchored_around_the_whole_answer_still_runs(regex):
    """The anchors people write around a whole-answer regex are what it means already: taken, not refused."""
    code, out, err = dgemma_process("run", "--model", "demo", "--device", "cpu", "--seed", "0", "-q", "--regex",
                                    regex, "upper: hello diffusions")
    assert (code, out, err) == (0, "HELLO DIFFUSIONS\n", ""), (code, out, err)


@pytest.mark.parametrize("value,says", [
    ("demo-sudoku-lora:abc", "SCALE (after ':') must be a number"),
    ("demo-sudoku-lora:", "SCALE (after ':') must be a number"),
    ("demo-sudoku-lora:nan", "finite number"),
    ("no-such-adapter:abc", "no such adapter directory"),
])
def test_an_adapter_scale_that_is_no_number_is_said_so(value, says):
    """`--adapter demo-sudoku-lora:abc` names an adapter that exists: the scale is wrong, not the directory."""
    msg = assert_error(dgemma_process("run", "--model", "demo-sudoku", "--adapter", value, "hi"), 2, says)
    if "SCALE" in says:
        assert "no such" not in msg, msg


def test_an_adapter_named_as_the_model_says_to_run_it_on_its_base(capsys):
    """`dgemma list` shows demo-sudoku-lora: as --model it is not "not found" but an adapter, run on its base."""
    msg = assert_error(cli(capsys, "run", "--model", "demo-sudoku-lora", "hi"), 2,
                       "adapter", "--model demo --adapter demo-sudoku-lora")
    assert "not in the store" not in msg and "no such" not in msg, msg


def test_a_json_schema_file_that_is_not_json_is_named(capsys, tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text("{bad")
    assert_error(cli(capsys, "run", "--json-schema", str(schema), "hi"), 2, str(schema), "is not JSON")
