"""`dgemma pull`'s download side (dgemma_cli.store.hub) against a local fake Hub: what is fetched, resume, errors."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from fake_hub import (
    AUDIO_SHARD,
    TEXT_SHARD,
    VISION_SHARD,
    closed_endpoint,
    diffusion_gemma_files,
    fake_hub,  # noqa: F401  (the fixture)
    point_hub_at,
    serve_directory,
    set_offline,
)

from dgemma_cli.store import hub as hub_mod
from dgemma_cli.errors import DgemmaError
from dgemma_cli.store.hub import download

REPO = "acme/diffusion-gemma-tiny"
TEXT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
              "model.safetensors.index.json", TEXT_SHARD)
MODEL_FILES = TEXT_FILES + (VISION_SHARD,)  # the text model's files and the vision tower's shard


def fails(*args, **kwargs) -> str:
    """The message of the DgemmaError download() raises; checks that it is one line."""
    with pytest.raises(DgemmaError) as info:
        download(*args, progress=False, **kwargs)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message and message
    return message


def test_fetches_the_text_model_and_the_vision_tower_only(fake_hub):
    files = diffusion_gemma_files(audio=True)
    repo = fake_hub.add_repo(REPO, files)
    snap = download(REPO, progress=False)

    assert snap.is_dir() and snap.name == repo.sha
    assert snap.parent.parent.name == "models--acme--diffusion-gemma-tiny"
    assert Path(os.environ["HF_HOME"]) / "hub" in snap.parents
    for name in MODEL_FILES:
        assert (snap / name).read_bytes() == files[name], name
    # what is neither text stack nor vision tower (an audio tower's shard, a README) is not fetched
    assert not (snap / AUDIO_SHARD).exists() and not (snap / "README.md").exists()
    assert fake_hub.file_requests(AUDIO_SHARD) == [] and fake_hub.file_requests("README.md") == []
    assert len(fake_hub.file_requests(TEXT_SHARD, "GET")) == 1
    assert len(fake_hub.file_requests(VISION_SHARD, "GET")) == 1
    # Every file is fetched at the resolved commit, not at the moving branch.
    assert all(f"/resolve/{repo.sha}/" in r.path for r in fake_hub.requests if "/resolve/" in r.path)

    # A second pull finds everything in the cache: no file is requested again.
    fake_hub.clear()
    assert download(REPO, progress=False) == snap
    assert not [r for r in fake_hub.requests if "/resolve/" in r.path]


def test_single_file_checkpoint_from_a_directory(fake_hub, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "diffusion_gemma"}))
    (ckpt / "model.safetensors").write_bytes(diffusion_gemma_files()[TEXT_SHARD])
    (ckpt / "notes.txt").write_text("not needed")
    serve_directory(fake_hub, "acme/single", ckpt)

    snap = download("acme/single", progress=False)
    assert sorted(p.name for p in snap.iterdir()) == ["config.json", "model.safetensors"]
    assert (snap / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()


def test_repo_without_weights(fake_hub):
    fake_hub.add_repo("acme/empty", {"config.json": b"{}"})
    assert "acme/empty has no safetensors weights" in fails("acme/empty")


def test_dropped_connection_resumes_with_a_range_request(fake_hub):
    from huggingface_hub import constants

    # huggingface_hub writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB) and resumes from the last
    # chunk it wrote, so the shard must be larger than one chunk and the cut lands on a chunk boundary.
    cut = constants.DOWNLOAD_CHUNK_SIZE
    files = diffusion_gemma_files(text_floats=cut // 4 + 50_000)
    assert len(files[TEXT_SHARD]) > cut
    fake_hub.add_repo(REPO, files)
    fake_hub.cut_get(REPO, TEXT_SHARD, after=cut)

    snap = download(REPO, progress=False)

    gets = fake_hub.file_requests(TEXT_SHARD, "GET")
    assert [g.range for g in gets] == [None, f"bytes={cut}-"]
    assert (snap / TEXT_SHARD).read_bytes() == files[TEXT_SHARD]
    blobs = snap.parent.parent / "blobs"
    assert not [p for p in blobs.iterdir() if p.name.endswith(".incomplete")]


def test_gated_repo_needs_a_token_with_access(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, diffusion_gemma_files(), gated_token="hf_good")

    message = fails(REPO)
    assert "gated" in message and "license" in message and "HF_TOKEN" in message
    assert f"{fake_hub.url}/{REPO}" in message

    monkeypatch.setenv("HF_TOKEN", "hf_other")
    message = fails(REPO)
    assert "no access" in message and "license" in message

    monkeypatch.setenv("HF_TOKEN", "hf_good")
    snap = download(REPO, progress=False)
    assert (snap / TEXT_SHARD).is_file()
    assert fake_hub.file_requests(TEXT_SHARD, "GET")[-1].authorization == "Bearer hf_good"


def test_offline(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, diffusion_gemma_files())

    set_offline(monkeypatch, True)
    message = fails(REPO)
    assert message.startswith("offline (HF_HUB_OFFLINE=1)") and REPO in message and "not in the" in message
    assert fake_hub.requests == []

    set_offline(monkeypatch, False)
    snap = download(REPO, progress=False)
    fake_hub.clear()
    set_offline(monkeypatch, True)
    assert download(REPO, progress=False) == snap
    assert fake_hub.requests == []

    # Some files cached, one missing: the message names it.
    (snap / TEXT_SHARD).unlink()
    message = fails(REPO)
    assert "offline" in message and TEXT_SHARD in message
    assert fake_hub.requests == []


def test_unreachable_hub_falls_back_to_the_cache(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, diffusion_gemma_files())
    snap = download(REPO, progress=False)
    point_hub_at(monkeypatch, closed_endpoint())
    assert download(REPO, progress=False) == snap


def test_unknown_repo_and_revision(fake_hub):
    fake_hub.add_repo(REPO, diffusion_gemma_files())
    message = fails("acme/nope")
    assert "acme/nope: no such model on the Hub" in message and "HF_TOKEN" in message
    message = fails(REPO, revision="v9")
    assert "'v9'" in message and REPO in message


def test_hub_down(fake_hub, monkeypatch):
    endpoint = closed_endpoint()
    point_hub_at(monkeypatch, endpoint)
    message = fails(REPO)
    assert message.startswith(f"cannot reach the Hub ({endpoint}): ") and "Connection refused" in message
    assert "HF_HUB_OFFLINE=1" in message


def test_disk_full(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, diffusion_gemma_files())

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub_mod, "hf_hub_download", no_space)
    message = fails(REPO)
    assert "disk full" in message and str(Path(os.environ["HF_HOME"]) / "hub") in message


def test_ctrl_c_propagates(fake_hub, monkeypatch):
    fake_hub.add_repo(REPO, diffusion_gemma_files())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hub_mod, "hf_hub_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        download(REPO, progress=False)


def test_progress_bars(fake_hub, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub's switch to show bars without a terminal
    fake_hub.add_repo(REPO, diffusion_gemma_files())
    fake_hub.add_repo("acme/other", diffusion_gemma_files())
    download(REPO, progress=True)
    assert TEXT_SHARD in capsys.readouterr().err
    download("acme/other", progress=False)
    assert TEXT_SHARD not in capsys.readouterr().err
