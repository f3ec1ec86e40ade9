"""Checkpoints on disk, read: names (names.py: file names, model names, bundled models, the store's listing and the
directory a name resolves to), their layout (layout.py: safetensors headers, where each tensor sits, the vision
tower, torch-free), loading them into the network in every format (weights.py), and what they weigh per format and
card (footprint.py).

Owns: the file formats' front, below the engine.
May import the network (dgemma_cli/model.py) that weights.py loads into, quant/, and the bottom modules (errors,
config, device); never the engine, the tuner, the store, the server or the CLI. names.py, layout.py and
footprint.py import no torch (`dgemma list`, `show` and `info` stay fast).
"""
