"""`dgemma pull / list / info / rm / quantize` through the command line, against a local fake Hub.

The converter's promises are checked here: interrupted and rerun it continues (same bytes as one uninterrupted
run), a full disk or a bad source leaves nothing half-made, a model already in the store is not pulled again.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch
from fake_hub import fake_hub, serve_directory  # noqa: F401  (the fixture)
from safetensors.torch import load_file, save_file

import quant.convert as convert
from cli_helpers import run_main
from dgemma_cli.checkpoint import footprint
from dgemma_cli.store import models as store
from dgemma_cli.config import ModelConfig
from test_quantized import write_modelopt_checkpoint

REPO = "acme/tiny-dgemma"


def one_error_line(capsys) -> str:
    """The one error line on stderr (progress notes may come before it, never after)."""
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    errors = [line for line in lines if line.startswith("dgemma: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], cap.err
    assert all(line.startswith("dgemma: ") for line in lines), cap.err
    assert "Traceback" not in cap.err
    return errors[0]


def sharded_with_vision(src: Path, out: Path) -> Path:
    """The checkpoint split as the published one is: text shard(s) and a shard holding only the vision tower."""
    out.mkdir()
    tensors = load_file(src / "model.safetensors")
    text = {k: v for k, v in tensors.items() if not k.startswith("model.encoder.vision")}
    vision = {k: v for k, v in tensors.items() if k.startswith("model.encoder.vision")}
    assert vision
    save_file(text, out / "model-00001-of-00002.safetensors")
    save_file(vision, out / "model-00002-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in text}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in vision})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture
def served(fake_hub, checkpoints, tmp_path):  # noqa: F811
    serve_directory(fake_hub, REPO, sharded_with_vision(checkpoints["five_to_one"], tmp_path / "repo"))
    return fake_hub


def test_pull_quantizes_into_the_store_and_the_name_runs(served, capsys):
    assert run_main(["pull", REPO, "--quant", "int8"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == f"{REPO}:int8"
    assert len(served.file_requests("model-00002-of-00002.safetensors", "GET")) == 1  # the vision tower's shard
    (entry,) = store.entries()
    assert entry.quant == "int8" and entry.path == store.entry_dir(REPO, "int8")
    index = json.loads((entry.path / "model.safetensors.index.json").read_text())
    assert any(".vision_tower." in k for k in index["weight_map"])  # carried into the entry
    assert convert.verify(entry.path)["store"]["repo"] == REPO

    assert run_main(["list"]) == 0
    assert f"{REPO}:int8" in capsys.readouterr().out
    assert run_main(["info", "tiny-dgemma"]) == 0  # a short store name works when one entry matches
    info = capsys.readouterr().out
    assert "int8" in info and str(entry.path) in info and "GPU memory" in info
    assert re.search(r"images: +yes \(vision tower, [0-9.]+ [MG]B on disk\)", info)
    for name in (f"{REPO}:int8", "tiny-dgemma:int8", str(entry.path)):
        assert run_main(["run", "--model", name, "--raw", "--seed", "1", "--max-new-tokens", "4", "--device", "cpu",
                         "--view", "none", "hi"]) == 0

    # already there: nothing is downloaded, and it says so
    served.clear()
    assert run_main(["pull", REPO, "--quant", "int8"]) == 0
    assert "already in the store" in capsys.readouterr().err
    assert not [r for r in served.requests if "/resolve/" in r.path]

    assert run_main(["rm", f"{REPO}:int8", "--yes"]) == 0
    assert store.entries() == [] and not entry.path.exists()


def test_pull_bf16_links_the_download_and_loads(served, capsys):
    assert run_main(["pull", REPO, "--quant", "bf16"]) == 0
    (entry,) = store.entries()
    names = {p.name for p in entry.path.iterdir()}
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= names  # text and vision
    index = json.loads((entry.path / "model.safetensors.index.json").read_text())
    assert index == json.loads((served.repos[REPO].files["model.safetensors.index.json"]))
    assert entry.manifest["store"]["vision_tower"] is True
    assert run_main(["run", "--model", f"{REPO}:bf16", "--raw", "--seed", "1", "--max-new-tokens", "4",
                     "--device", "cpu", "--view", "none", "hi"]) == 0


def test_auto_weighs_fp8_where_the_gpu_has_fp8_units():
    """`--quant auto` on the real 26B-A4B's shapes, with fake GPU facts: the least lossy format that fits, FP8 before
    INT8 (the same size) only from sm_89 on."""
    from dgemma_cli.config import DIFFUSIONGEMMA_26B_A4B

    cfg = ModelConfig.from_dict(DIFFUSIONGEMMA_26B_A4B)
    need = {f: footprint.runtime_bytes(cfg, f) for f in footprint.FORMATS}
    assert need["nvfp4"] < need["int8"] == need["fp8"] < need["bf16"]
    ada, hopper, ampere = (8, 9), (9, 0), (8, 0)
    for cap in (None, ampere, ada, hopper):
        assert footprint.choose_format(cfg, need["bf16"], capability=cap) == "bf16"
        eight = "fp8" if cap in (ada, hopper) else "int8"
        assert footprint.choose_format(cfg, need["bf16"] - 1, capability=cap) == eight
        assert footprint.choose_format(cfg, need["int8"], capability=cap) == eight
        assert footprint.choose_format(cfg, need["int8"] - 1, capability=cap) == "nvfp4"
        assert footprint.choose_format(cfg, need["nvfp4"] - 1, capability=cap) is None
    assert footprint.candidates(ampere) == ["bf16", "int8", "nvfp4"]
    assert footprint.candidates(hopper) == ["bf16", "fp8", "int8", "nvfp4"]


@pytest.mark.parametrize("cap,want", [((8, 9), "fp8"), ((8, 6), "int8")])
def test_pull_auto_picks_by_free_memory(served, monkeypatch, capsys, checkpoints, cap, want):
    cfg = ModelConfig.from_dir(checkpoints["five_to_one"])
    need = {f: footprint.runtime_bytes(cfg, f) for f in footprint.FORMATS}
    monkeypatch.setattr(footprint, "free_memory", lambda: (need["int8"] + 1, "a test GPU"))
    monkeypatch.setattr(footprint, "capability", lambda: cap)
    assert run_main(["pull", REPO]) == 0
    assert f"--quant auto: {want}" in capsys.readouterr().err
    assert [e.quant for e in store.entries()] == [want]
    assert run_main(["pull", REPO]) == 0  # auto and an entry of this repo present: nothing to do
    assert "already in the store" in capsys.readouterr().err


def test_pull_quantizes_on_the_gpu_when_there_is_one(served, monkeypatch, capsys):
    """The device a pull quantizes on, with a fake GPU: the arithmetic is asked for on CUDA (the fake stops it
    there), and on the CPU without one."""
    import dgemma_cli.store.quantize as quantize_mod

    asked = []

    def fake_quantize(src, out, fmt, policy, device="cpu", **kw):
        asked.append(device)
        raise KeyboardInterrupt

    monkeypatch.setattr(quantize_mod, "quantize_checkpoint", fake_quantize)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert store.quantize_device() == "cuda"
    assert run_main(["pull", REPO, "--quant", "int8"]) == 130
    assert "on the GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_main(["pull", REPO, "--quant", "int8"]) == 130
    assert "on the CPU" in capsys.readouterr().err
    assert asked == ["cuda", "cpu"]


def test_pull_revision_of_an_entry_already_there_is_never_ignored(served, tmp_path, capsys):
    """`pull --revision REV` with the entry present: nothing to do when REV is the entry's commit (said, with the
    commit); otherwise one error line saying which commit is there and how to replace it. The entry is untouched."""
    assert run_main(["pull", REPO, "--quant", "int8"]) == 0
    (entry,) = store.entries()
    first = entry.manifest["store"]["revision"]
    assert first == served.repos[REPO].sha
    capsys.readouterr()
    for rev in ("main", first, first[:10].upper()):  # a branch naming it, the commit, a prefix of it
        served.clear()
        assert run_main(["pull", REPO, "--quant", "int8", "--revision", rev]) == 0
        err = capsys.readouterr().err
        assert "already in the store" in err and first[:12] in err and rev in err, err
        assert not [r for r in served.requests if "/resolve/" in r.path]  # nothing downloaded
    # main moves to a new commit: the stored entry is at another revision
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in (tmp_path / "repo").iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    (moved / "README.md").write_text("a second commit\n")
    second = serve_directory(served, REPO, moved).sha
    assert second != first
    for rev in ("main", second):
        served.clear()
        assert run_main(["pull", REPO, "--quant", "int8", "--revision", rev]) == 2
        msg = one_error_line(capsys)
        assert f"commit {first[:12]}" in msg and f"not at {rev} (commit {second[:12]})" in msg, msg
        assert f"`dgemma rm {REPO}:int8`, then `dgemma pull {REPO} --quant int8 --revision {rev}`" in msg, msg
        assert not [r for r in served.requests if "/resolve/" in r.path]
    assert run_main(["pull", REPO, "--quant", "int8", "--revision", "v9"]) == 1  # no such revision: the Hub says
    assert "no revision 'v9'" in one_error_line(capsys)
    assert store.entries() == [entry]
    # the way the message gives: the new revision replaces the entry
    assert run_main(["rm", f"{REPO}:int8", "--yes"]) == 0
    assert run_main(["pull", REPO, "--quant", "int8", "--revision", "main"]) == 0
    (entry,) = store.entries()
    assert entry.manifest["store"]["revision"] == second


def test_published_nvfp4_is_stored_as_published(fake_hub, checkpoints, tmp_path, capsys):  # noqa: F811
    write_modelopt_checkpoint(checkpoints["five_to_one"], tmp_path / "published")
    serve_directory(fake_hub, "vendor/tiny-NVFP4", tmp_path / "published")
    assert run_main(["pull", "vendor/tiny-NVFP4", "--quant", "int8"]) == 2
    assert "published in nvfp4" in one_error_line(capsys)
    assert not fake_hub.file_requests("model.safetensors")  # refused from the config, before any weights
    assert run_main(["pull", "vendor/tiny-NVFP4"]) == 0
    (entry,) = store.entries()
    assert entry.quant == "nvfp4" and entry.manifest["store"]["published"] is True
    assert run_main(["run", "--model", "vendor/tiny-NVFP4", "--raw", "--max-new-tokens", "4", "--device", "cpu",
                     "--view", "none", "hi"]) == 0


@pytest.mark.slow  # make test's time (CI runs it in make test-slow)
def test_interrupted_pull_keeps_finished_files(fake_hub, checkpoints, tmp_path, capsys):  # noqa: F811
    repo = sharded_with_vision(checkpoints["five_to_one"], tmp_path / "repo")
    serve_directory(fake_hub, REPO, repo)
    fake_hub.cut_get(REPO, "model-00001-of-00002.safetensors", after=100, times=50)  # the weights never arrive
    fake_hub.clear()
    assert run_main(["pull", REPO, "--quant", "bf16"]) == 1
    assert "cannot reach the Hub" in one_error_line(capsys)
    assert store.entries() == []
    first_run = [r for r in fake_hub.requests if r.method == "GET" and "/resolve/" in r.path]
    assert len(first_run) > 3  # small files, then the shard tried again and again
    fake_hub.repos[REPO].cuts.clear()  # the connection is back
    fake_hub.clear()
    assert run_main(["pull", REPO, "--quant", "bf16"]) == 0
    fetched = [r.path.rsplit("/", 1)[-1] for r in fake_hub.requests if r.method == "GET" and "/resolve/" in r.path]
    # config, tokenizer, index: kept from the first run; the text shard, then the vision tower's
    assert fetched == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_pull_errors_are_one_line(fake_hub, served, monkeypatch, capsys):  # noqa: F811
    assert run_main(["pull", "not a repo"]) == 2
    assert "not a repository id" in one_error_line(capsys)
    assert run_main(["pull", REPO, "--quant", "fp4"]) == 2
    assert "--quant must be auto, bf16, fp8, int8, nvfp4" in one_error_line(capsys)
    assert run_main(["pull", "acme/missing"]) == 1
    assert "no such model" in one_error_line(capsys)
    from fake_hub import set_offline

    set_offline(monkeypatch, True)
    assert run_main(["pull", REPO, "--quant", "int8"]) == 1
    assert "offline" in one_error_line(capsys)


def test_gated_repo_needs_a_token(fake_hub, checkpoints, tmp_path, monkeypatch, capsys):  # noqa: F811
    serve_directory(fake_hub, "google/gated-tiny", sharded_with_vision(checkpoints["five_to_one"], tmp_path / "r"),
                    gated_token="hf_secret")
    assert run_main(["pull", "google/gated-tiny", "--quant", "int8"]) == 1
    msg = one_error_line(capsys)
    assert "gated" in msg and "HF_TOKEN" in msg and "license" in msg
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert run_main(["pull", "google/gated-tiny", "--quant", "int8"]) == 0


def test_model_names_resolve_or_say_how(checkpoints, capsys):
    assert run_main(["info", "acme/absent:nvfp4"]) == 1
    msg = one_error_line(capsys)
    assert "dgemma pull acme/absent --quant nvfp4" in msg
    assert run_main(["info", "./no/such/dir"]) == 1
    assert "no such model directory" in one_error_line(capsys)
    assert run_main(["info", "demo"]) == 0
    info = capsys.readouterr().out
    assert "unquantized (float32 on disk)" in info
    assert "images:                 no (the checkpoint holds no vision tower tensors)" in info
    assert run_main(["rm", str(checkpoints["five_to_one"]), "--yes"]) == 1  # never a directory outside the store
    assert "not in the store" in one_error_line(capsys)
    assert Path(checkpoints["five_to_one"], "config.json").is_file()
    # a missing model is one exit code whichever command names it (errors.ModelError's)
    assert run_main(["rm", "acme/absent:nvfp4", "--yes"]) == run_main(["info", "acme/absent:nvfp4"]) == 1


def test_rm_demo_says_the_bundled_model_cannot_be_removed(capsys):
    from dgemma_cli.engine import DEMO_MODEL

    assert run_main(["rm", "demo", "--yes"]) == 2
    msg = one_error_line(capsys)
    assert "bundled demo model" in msg and "cannot be removed" in msg and "not in the store" not in msg, msg
    assert (DEMO_MODEL / "model.safetensors").is_file()
    # a store entry named demo: 'demo' still means the bundled model (as for --model); its full name removes it
    d = store.entry_dir("acme/demo", "int8")
    d.mkdir(parents=True)
    (d / store.MANIFEST).write_text(json.dumps({"store": {"repo": "acme/demo", "quant": "int8"}, "files": {}}))
    assert run_main(["rm", "demo", "--yes"]) == 2
    msg = one_error_line(capsys)
    assert "cannot be removed" in msg and "acme/demo:int8" in msg and "full name" in msg, msg
    assert d.is_dir()
    assert run_main(["rm", "acme/demo", "--yes"]) == 0
    assert not d.exists() and store.entries() == []


# ----------------------------------------------------------------------------- dgemma quantize


def test_info_and_quantize_say_the_same_size_and_the_context_estimated(tmp_path, capsys):
    """`quantize` reports the size `info` gives the directory it wrote (every file, the manifest included, rounded
    alike); `info` says the context its GPU estimate is for: the model's own where shorter than 8k (4,096 here)."""
    out = tmp_path / "q"
    assert run_main(["quantize", "demo", "--quant", "int8", "--out", str(out), "--device", "cpu"]) == 0
    wrote = re.search(r"wrote .* \(int8, policy all, (.+)\)", capsys.readouterr().err)
    assert run_main(["info", str(out)]) == 0
    said = dict(re.match(r"(.+?):\s+(.*)", line).groups() for line in capsys.readouterr().out.splitlines())
    assert wrote and wrote.group(1) == said["size on disk"], (wrote, said)
    assert store.describe(out)["size_on_disk"] == sum(f.stat().st_size for f in out.iterdir())
    assert run_main(["info", "demo"]) == 0
    said = dict(re.match(r"(.+?):\s+(.*)", line).groups() for line in capsys.readouterr().out.splitlines())
    assert said["GPU memory"].endswith(" at a 4,096-token context (estimate)"), said
    assert "8k" not in "".join(said)
    d = store.describe(store_demo())
    cfg = ModelConfig.from_dir(store_demo())
    assert cfg.text.max_position_embeddings == d["gpu_memory_context"] == 4096
    assert d["gpu_memory_estimate"] == footprint.runtime_bytes(cfg, "bf16", "experts", context=4096)


def store_demo() -> Path:
    from dgemma_cli.checkpoint.names import BUNDLED

    return Path(BUNDLED["demo"])



def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix == ".safetensors"}


def test_quantize_interrupted_then_rerun_continues_with_the_same_bytes(checkpoints, tmp_path, monkeypatch, capsys):
    src = checkpoints["five_to_one"]
    whole = tmp_path / "whole"
    assert run_main(["quantize", str(src), "--quant", "nvfp4", "--out", str(whole)]) == 0
    capsys.readouterr()

    real = convert._write_shard
    calls = []
    interrupt = [True]

    def flaky(shard, path, on_bytes):
        calls.append(shard.filename)
        if len(calls) == 3 and interrupt and interrupt.pop():
            raise KeyboardInterrupt  # Ctrl-C while the third shard is being written
        return real(shard, path, on_bytes)

    monkeypatch.setattr(convert, "_write_shard", flaky)
    out = tmp_path / "q"
    assert run_main(["quantize", str(src), "--quant", "nvfp4", "--out", str(out)]) == 130
    assert "run the same command again" in one_error_line(capsys)
    assert not out.exists()
    progress = json.loads((tmp_path / "q.partial" / convert.PROGRESS).read_text())
    assert sorted(progress["done"]) == sorted(calls[:2])

    calls.clear()
    assert run_main(["quantize", str(src), "--quant", "nvfp4", "--out", str(out)]) == 0
    assert "resuming: 2 of" in capsys.readouterr().err
    assert len(calls) == len(shard_bytes(whole)) - 2  # the two finished shards were not written again
    assert shard_bytes(out) == shard_bytes(whole)
    assert not (tmp_path / "q.partial").exists()
    convert.verify(out)


def test_quantize_rerun_after_kill_rewrites_the_unfinished_shard(checkpoints, tmp_path, capsys):
    """What a killed process leaves: finished shards recorded, one .tmp half written, nothing recorded for it."""
    src, out = checkpoints["five_to_one"], tmp_path / "q"
    assert run_main(["quantize", str(src), "--quant", "int8", "--out", str(out)]) == 0
    reference = shard_bytes(out)
    manifest = json.loads((out / convert.MANIFEST).read_text())
    # rebuild the partial directory a kill during shard 3 leaves behind
    partial = tmp_path / "q2.partial"
    partial.mkdir()
    names = sorted(reference)
    done = {n: manifest["files"][n] for n in names[:2]}
    for n in names[:2]:
        (partial / n).write_bytes(reference[n])
    (partial / (names[2] + ".tmp")).write_bytes(reference[names[2]][:100])
    (partial / convert.PROGRESS).write_text(json.dumps({"job": manifest["job"], "done": done}))
    out2 = tmp_path / "q2"
    assert run_main(["quantize", str(src), "--quant", "int8", "--out", str(out2)]) == 0
    assert shard_bytes(out2) == reference
    assert not any(p.name.endswith(".tmp") for p in out2.iterdir())


def test_quantize_full_disk_leaves_nothing(checkpoints, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    src, out = checkpoints["five_to_one"], work / "q"
    real = convert._write_shard

    def full(shard, path, on_bytes):
        if shard.filename.startswith("model-00002"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(shard, path, on_bytes)

    monkeypatch.setattr(convert, "_write_shard", full)
    assert run_main(["quantize", str(src), "--quant", "int8", "--out", str(out)]) == 1
    assert "disk full" in one_error_line(capsys)
    assert list(work.iterdir()) == []

    # not enough space from the start: refused before anything is written
    monkeypatch.setattr(convert, "_write_shard", real)
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    assert run_main(["quantize", str(src), "--quant", "int8", "--out", str(out)]) == 1
    assert "not enough disk space" in one_error_line(capsys)
    assert list(work.iterdir()) == []


def test_quantize_bad_sources_are_refused_before_writing(checkpoints, tmp_path, capsys):
    src = checkpoints["five_to_one"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 48  # the tensors say 32
    (bad / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run_main(["quantize", str(bad), "--quant", "nvfp4", "--out", str(out)]) == 1
    assert "has shape" in one_error_line(capsys)
    assert not out.exists() and not (tmp_path / "out.partial").exists()

    q = tmp_path / "q"
    assert run_main(["quantize", str(src), "--quant", "int8", "--out", str(q)]) == 0
    capsys.readouterr()
    assert run_main(["quantize", str(q), "--quant", "nvfp4", "--out", str(tmp_path / "qq")]) == 2
    assert "already quantized" in one_error_line(capsys)
    assert run_main(["quantize", str(src), "--quant", "int8", "--out", str(q)]) == 2
    assert "already exists" in one_error_line(capsys)
    assert run_main(["quantize", str(src), "--quant", "int4", "--out", str(tmp_path / "x")]) == 2
    one_error_line(capsys)
    assert run_main(["quantize", str(checkpoints["alternating"]), "--quant", "nvfp4", "--out",
                     str(tmp_path / "y")]) == 2  # moe_intermediate_size 24 does not split into 16-wide blocks
    assert "multiples of 16" in one_error_line(capsys)


def test_quantize_never_deletes_a_partial_directory_it_did_not_make(checkpoints, tmp_path, capsys):
    foreign = tmp_path / "ckpt.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert run_main(["quantize", str(checkpoints["five_to_one"]), "--quant", "int8", "--out",
                     str(tmp_path / "ckpt")]) == 1
    assert "not an unfinished conversion" in one_error_line(capsys)
    assert (foreign / "notes.txt").read_text() == "mine"
    if not torch.cuda.is_available():
        assert run_main(["quantize", str(checkpoints["five_to_one"]), "--quant", "int8", "--out",
                         str(tmp_path / "x"), "--device", "cuda"]) == 2
        assert "no CUDA device" in one_error_line(capsys)
        assert not (tmp_path / "x.partial").exists()


def test_pull_of_a_lora_adapter_stores_it_as_published(fake_hub, checkpoints, tmp_path, capsys):  # noqa: F811
    """An adapter repository (PEFT's two files): pulled as is into OWNER--NAME--lora, listed with its base, run
    by its store name with --adapter, never taken for a model."""
    from dgemma_cli.tuner.lora import new_adapter, save_adapter
    from dgemma_cli.checkpoint.weights import load_model

    model, _ = load_model(checkpoints["five_to_one"], dtype=torch.float32)
    ad = new_adapter(model, rank=2, alpha=4, generator=torch.Generator().manual_seed(0), base=REPO)
    save_adapter(ad, tmp_path / "lora")
    serve_directory(fake_hub, "acme/tiny-lora", tmp_path / "lora")
    assert run_main(["pull", "acme/tiny-lora"]) == 0
    assert capsys.readouterr().out.strip() == "acme/tiny-lora:lora"
    (entry,) = store.entries()
    assert sorted(p.name for p in entry.path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                           "dgemma-manifest.json"]
    assert run_main(["list"]) == 0
    assert f"(LoRA adapter of {REPO})" in capsys.readouterr().out
    assert run_main(["info", "tiny-lora"]) == 0
    assert f"adapts:                 {REPO}" in capsys.readouterr().out
    assert run_main(["run", "hi", "--model", str(checkpoints["five_to_one"]), "--adapter", "tiny-lora", "--raw",
                     "--device", "cpu", "--max-new-tokens", "4", "--view", "none"]) == 0
    assert run_main(["pull", "acme/tiny-lora"]) == 0
    assert "already in the store" in capsys.readouterr().err
    assert run_main(["run", "hi", "--model", "acme/tiny-lora", "--device", "cpu"]) != 0  # not a model
    assert one_error_line(capsys).endswith(f"acme/tiny-lora is a LoRA adapter, not a model: run it on its base "
                                           f"model, --model {REPO} --adapter acme/tiny-lora")


def test_pull_auto_on_a_card_too_small_plans_streamed_experts(served, monkeypatch, capsys, checkpoints):
    """Nothing fits whole: NVFP4, and the note says how many layers' experts will stream, not that it may not fit."""
    cfg = ModelConfig.from_dir(checkpoints["five_to_one"])
    from dgemma_cli.placement.cards import Card
    from dgemma_cli.placement.plan import plan, planned_context

    whole = plan(cfg, "nvfp4", [Card("x", 10**15, 0.0, 4, 16)], context=planned_context(cfg))
    c = whole.cards[0]
    free = c.fixed_bytes + 3 * c.expert_bytes  # two layer buffers and one resident layer
    assert free < footprint.runtime_bytes(cfg, "nvfp4")
    monkeypatch.setattr(footprint, "free_memory", lambda: (free, "a test GPU"))
    monkeypatch.setattr(footprint, "capability", lambda: (8, 9))
    assert run_main(["pull", REPO]) == 0
    err = capsys.readouterr().err
    assert "--quant auto: nvfp4" in err
    assert f"{len(c.layers) - 1} of {len(c.layers)} layers' experts will stream" in err


def test_a_gguf_quantization_asked_of_a_safetensors_repository_is_one_line(served, capsys):
    assert run_main(["pull", REPO, "--quant", "q4_k_m"]) == 2
    msg = one_error_line(capsys)
    assert "safetensors checkpoint" in msg and "q4_k_m" in msg
    assert not store.entries() and not served.file_requests("model-00001-of-00002.safetensors", "GET")


def test_an_nvfp4_release_of_the_experts_becomes_policy_all(fake_hub, checkpoints, tmp_path, monkeypatch,
                                                             capsys):  # noqa: F811
    """NVIDIA's NVFP4 release (experts only) pulled with --policy all, or with --quant auto on a card where it would
    stream and `all` would not: its experts are carried over byte for byte, its 16-bit attention and dense MLP
    quantized to NVFP4 here; the entry plans and runs as NVFP4 `all`. Said in one line each time."""
    from safetensors import safe_open

    from dgemma_cli.checkpoint import footprint
    from dgemma_cli.checkpoint.layout import stored_policy
    from dgemma_cli.checkpoint.weights import load_model

    write_modelopt_checkpoint(checkpoints["five_to_one"], tmp_path / "published")
    serve_directory(fake_hub, "vendor/tiny-NVFP4", tmp_path / "published")
    assert run_main(["pull", "vendor/tiny-NVFP4", "--policy", "all"]) == 0
    assert "--policy all" in capsys.readouterr().err
    (entry,) = store.entries()
    assert entry.quant == "nvfp4" and entry.manifest["store"]["policy"] == "all"
    assert entry.manifest["store"]["published"] is False and stored_policy(entry.path) == "all"
    with safe_open(str(tmp_path / "published" / "model.safetensors"), "pt") as src:
        experts = [n for n in src.keys() if ".experts." in n]
        assert experts
        mine = {}
        for f in entry.path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as out:
                mine.update({n: out.get_tensor(n) for n in out.keys()})
        assert all(torch.equal(src.get_tensor(n), mine[n]) for n in experts)  # as published
        dense = [n for n in mine if n.endswith("self_attn.q_proj.weight")]
        assert dense and all(mine[n].dtype == torch.uint8 and n[:-len("weight")] + "input_scale" in mine
                             for n in dense)
    model, _ = load_model(entry.path, device="cpu")
    assert type(model.layers[0].self_attn.q_proj).__name__ == "NVFP4Linear"
    assert run_main(["run", "--model", "vendor/tiny-NVFP4", "--raw", "--max-new-tokens", "4", "--device", "cpu",
                     "--view", "none", "hi"]) == 0
    # --quant auto: converted where the release as published would stream and `all` fits whole
    assert run_main(["rm", "vendor/tiny-NVFP4:nvfp4", "--yes"]) == 0
    from dgemma_cli.config import ModelConfig
    from dgemma_cli.placement.plan import plan, planned_context
    from dgemma_cli.placement.cards import Card

    cfg = ModelConfig.from_dir(tmp_path / "published")

    def streamed(free, policy):
        return len(plan(cfg, "nvfp4", [Card("test card", free, 0.0, 4, 16)], context=planned_context(cfg),
                        policy=policy).streamed)

    free = next(f for f in range(1 << 20, 1 << 34, 1 << 16) if streamed(f, "all") == 0 < streamed(f, "experts"))
    monkeypatch.setattr(footprint, "free_memory", lambda: (free, "GPU test card"))
    capsys.readouterr()
    assert run_main(["pull", "vendor/tiny-NVFP4"]) == 0
    assert "would stream" in capsys.readouterr().err
    (entry,) = store.entries()
    assert entry.manifest["store"]["policy"] == "all"
    # where the release as published fits, it is stored as published
    assert run_main(["rm", "vendor/tiny-NVFP4:nvfp4", "--yes"]) == 0
    monkeypatch.setattr(footprint, "free_memory", lambda: (1 << 40, "GPU test card"))
    assert run_main(["pull", "vendor/tiny-NVFP4"]) == 0
    (entry,) = store.entries()
    assert entry.manifest["store"]["published"] is True and entry.manifest["store"]["policy"] is None
