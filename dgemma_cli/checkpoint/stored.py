"""What a `--model` path holds, without torch: a model directory (config.json and safetensors) or a GGUF file (one
file, or a split file's first part, llama.cpp's format: gguf_file.py). The commands that only read a model's
description (plan, info, show) start here."""

from __future__ import annotations

from pathlib import Path

from ..config import ModelConfig


def is_gguf(path: Path | str) -> bool:
    """Whether `path` names a GGUF file."""
    return Path(path).suffix.lower() == ".gguf"


def model_config(path: Path) -> ModelConfig:
    """A model's config: its directory's config.json, or a GGUF file's keys (refused in one line where they are not
    a DiffusionGemma's)."""
    if is_gguf(path):
        from .gguf_file import read_gguf

        return read_gguf(path)[1]
    return ModelConfig.from_dir(path)
