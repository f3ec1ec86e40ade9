"""A DiffusionGemma GGUF into the network: the config from the file's keys, every tensor found by its converter name
(gguf_names.py) and checked before any is read; the routed experts and the block-typed projections kept as the file's
bytes (quant/ggml_modules.py, decoded where they are used), the rest decoded to the compute dtype here. The model
takes about its file's size in memory (the 26B Q4_K_M: its blocks, the embedding's included), which the planner counts
from the file (gguf_file.GGUFFile.footprint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import ModelError
from .gguf_file import GGUFFile, read_gguf
from .gguf_names import find, gguf_name, kept_packed
from .weights import _set_module, assign_weights, expected_tensors


def load_gguf_model(path: Path | GGUFFile, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    host_layers=frozenset(), layer_devices: list | None = None):
    """Build the network on the meta device and fill it from a GGUF file (or a split file's first part; or the file
    gguf_file.read_gguf read), as weights.load_model does from a directory: dtype None is float32; host_layers'
    experts are read into host memory (pinned for a card), never onto `device`; layer_devices places each layer.
    Every routed expert stack and every block-typed projection of attention, the dense MLP and self-conditioning is
    kept as the file's bytes (gguf_names.kept_packed; quant/ggml_modules.py decodes them where they are used); the
    rest is decoded here. Returns (model, ModelConfig)."""
    from ..model import DiffusionGemma, QuantizedExperts
    from quant import ggml

    f, cfg = (path, ModelConfig.from_dict(path.config_dict())) if isinstance(path, GGUFFile) else read_gguf(path)
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    found = {}
    for name, meta in expected_tensors(model).items():  # every name and shape checked before a block is read
        t = find(f.tensors, name)
        if t is None:
            raise ModelError(f"{f.path.name}: the file has no tensor {gguf_name(name)} (the model's {name})")
        if int(np.prod(t.shape, dtype=np.int64)) != meta.numel() or (meta.dim() > 1 and tuple(t.shape) != tuple(
                meta.shape)):
            raise ModelError(f"{f.path.name}: tensor {t.name} is {list(t.shape)}, the model's {name} is "
                             f"{list(meta.shape)}")
        found[name] = t
    hold_as_blocks(model, lambda name: found[name].kind)
    for path_, mod in list(model.named_modules()):
        if isinstance(mod, QuantizedExperts):
            for proj in ("gate_up_proj", "down_proj"):
                found[f"{path_}.{proj}.weight"] = found.pop(f"{path_}.{proj}")
    expected = expected_tensors(model)
    state = {}
    host_prefixes = tuple(f"layers.{i}.experts." for i in host_layers)
    pin = torch.device(device).type == "cuda"
    for name, meta in expected.items():
        t = found[name]
        target = device
        if layer_devices is not None and name.startswith("layers."):
            target = layer_devices[int(name.split(".")[1])]
        raw = torch.from_numpy(np.asarray(t.data).copy())  # the mapped blocks are read-only: one tensor's copy
        if meta.dtype == torch.uint8:  # kept as the file's bytes
            value = raw.view(torch.uint8).reshape(meta.shape)
        else:
            value = ggml.decode(raw, t.kind, tuple(meta.shape), dtype)
        del raw
        if name.startswith(host_prefixes):
            state[name] = value.pin_memory() if pin else value
            continue
        state[name] = value.to(target)
    assign_weights(model, state, device, dtype, layer_devices)
    return model, cfg


def hold_as_blocks(model, kind: Callable[[str], str]) -> None:
    """Swap the modules of `model` (built on the meta device) that a GGUF holds as its blocks for quant's block
    modules, each tensor in its block type `kind(our name)`: every routed expert stack (GGUFStack, named
    `...experts.gate_up_proj` / `...experts.down_proj`), and the embedding (GGUFEmbedding) and the attention, dense MLP
    and self-conditioning projections (GGUFLinear) whose type is a block type (gguf_names.kept_packed). The loader
    gives the file's types; the step trace (dgemma_cli/step_trace.py) a mix's."""
    from quant.ggml_modules import GGUFEmbedding, GGUFLinear, GGUFStack

    from ..model import Experts, QuantizedExperts

    for path, mod in list(model.named_modules()):
        if isinstance(mod, Experts):
            E, two_i, H = mod.gate_up_proj.shape
            _set_module(model, path, QuantizedExperts(E, GGUFStack(E, two_i, H, kind(path + ".gate_up_proj"), "meta"),
                                                      GGUFStack(E, H, two_i // 2, kind(path + ".down_proj"), "meta")))
        elif path == "embed_tokens" and kept_packed("embed_tokens.weight", kind("embed_tokens.weight")):
            _set_module(model, path, GGUFEmbedding(mod.num_embeddings, mod.embedding_dim, kind("embed_tokens.weight"),
                                                   "meta"))
        elif isinstance(mod, torch.nn.Linear) and kept_packed(path + ".weight", kind(path + ".weight")):
            _set_module(model, path, GGUFLinear(mod.in_features, mod.out_features, kind(path + ".weight"), "meta"))
