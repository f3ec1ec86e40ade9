"""The model store: `dgemma pull` (models.py: download, keep a published release as it is or quantize it into the
store, describe, remove), the Hub's downloads (hub.py), and quantizing a checkpoint into the ecosystem's formats
(quantize.py: ModelOpt NVFP4, compressed-tensors FP8 and INT8).

Owns: writing models to disk (atomically, resumable), what `dgemma list`, `info` and `rm` act on.
May import the engine's modules, the checkpoint package and the tuner (adapters are stored too); never the server or
the CLI. The engine never imports it: a model's name resolves through dgemma_cli/checkpoint/names.py.
"""
