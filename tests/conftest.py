import os
from pathlib import Path

# Before torch loads its OpenMP runtime: threads that sleep while they wait, as dgemma sets for itself
# (dgemma_cli/device.py), so that the suite degrades gracefully on a machine shared with other busy processes.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads this once, at import: without a CUDA device its kernels run in the interpreter (tests/test_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import SPECS, build_checkpoint, make_confident


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Each test gets its own home and caches: nothing depends on, or writes to, the machine's."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("DGEMMA_MODEL", raising=False)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints written by the reference implementation, built once per session."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {name: build_checkpoint(root / name, spec, seed=i) for i, (name, spec) in enumerate(SPECS.items())}
    out["confident"] = build_checkpoint(root / "confident", SPECS["five_to_one"], seed=7, tweak=make_confident)
    out["short_context"] = build_checkpoint(root / "short_context", SPECS["five_to_one"], seed=3,
                                            max_position_embeddings=64)
    return out


@pytest.fixture(scope="session")
def reference():
    """Loads (and caches) the reference model for a checkpoint directory, in float32 on the CPU."""
    from transformers import DiffusionGemmaForBlockDiffusion

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype="float32").eval()
        return cache[path]

    return get


def pytest_collection_modifyitems(config, items):
    has_cuda = False
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        pass
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(skip_gpu)
