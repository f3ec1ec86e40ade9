"""Checkpoint file names and text-stack prefixes: the torch-free part of the layout (see weights.py for the rest),
shared by the loader and the downloader."""

from __future__ import annotations

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Text-stack prefixes in the order they are preferred. The first one that holds the embedding wins.
TEXT_PREFIXES = ("model.decoder.", "model.encoder.language_model.", "model.language_model.")


def text_shards(weight_map: dict[str, str]) -> list[str]:
    """The shards of an index that hold at least one text-stack tensor, in index order (the others hold only the
    vision tower, which dgemma never reads, so they need not be downloaded or present)."""
    return list(dict.fromkeys(f for n, f in weight_map.items() if n.startswith(TEXT_PREFIXES)))
