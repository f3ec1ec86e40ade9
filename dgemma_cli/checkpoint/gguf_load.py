"""A DiffusionGemma GGUF into the network: the config from the file's keys, every tensor found by its converter name
(gguf_names.py) and checked before any is decoded, then each decoded with torch (quant/ggml.py) into the compute
dtype where it runs: the CPU path of every block type. No kernel reads the blocks in place yet, so a GGUF's weights
take their dequantized size in memory (the 26B model: 52 GB in bfloat16), which the planner counts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import ModelError
from .gguf_file import GGUFFile
from .gguf_names import find, gguf_name
from .weights import expected_tensors


def load_gguf_model(path: Path | GGUFFile, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                    host_layers=frozenset(), layer_devices: list | None = None):
    """Build the network on the meta device and fill it from a GGUF file (or a split file's first part; or the file
    read_gguf read), as weights.load_model does from a directory: dtype None is float32; host_layers' experts are
    decoded into host memory (pinned for a card), never onto `device`; layer_devices places each layer. Returns
    (model, ModelConfig)."""
    from ..model import DiffusionGemma
    from quant import ggml

    f = path if isinstance(path, GGUFFile) else GGUFFile(Path(path))
    cfg = ModelConfig.from_dict(f.config_dict())
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = DiffusionGemma(cfg)
    expected = expected_tensors(model)
    found = {}
    for name, meta in expected.items():  # every name and shape checked before a block is decoded
        t = find(f.tensors, name)
        if t is None:
            raise ModelError(f"{f.path.name}: the file has no tensor {gguf_name(name)} (the model's {name})")
        if int(np.prod(t.shape, dtype=np.int64)) != meta.numel() or (meta.dim() > 1 and tuple(t.shape) != tuple(
                meta.shape)):
            raise ModelError(f"{f.path.name}: tensor {t.name} is {list(t.shape)}, the model's {name} is "
                             f"{list(meta.shape)}")
        found[name] = t
    L = cfg.text.num_hidden_layers
    state, scalars = {}, {"encoder_layer_scalar": [None] * L, "decoder_layer_scalar": [None] * L}
    host_prefixes = tuple(f"layers.{i}.experts." for i in host_layers)
    pin = torch.device(device).type == "cuda"
    for name, t in found.items():
        target = device
        if layer_devices is not None and name.startswith("layers."):
            target = layer_devices[int(name.split(".")[1])]
        raw = torch.from_numpy(np.asarray(t.data).copy())  # the mapped blocks are read-only: one tensor's copy
        value = ggml.decode(raw, t.kind, tuple(expected[name].shape), dtype)
        del raw
        if name.startswith(host_prefixes):
            state[name] = value.pin_memory() if pin else value
            continue
        value = value.to(target)
        if name.split(".")[0] in scalars:
            kind, i = name.split(".")
            scalars[kind][int(i)] = value.reshape(())
        else:
            state[name] = value
    for kind, parts in scalars.items():
        state[kind] = torch.stack(parts).to(device=device, dtype=dtype)
    model.load_state_dict(state, assign=True, strict=True)
    if layer_devices is not None:
        model.layer_devices = [torch.device(d) for d in layer_devices]
    model.eval().requires_grad_(False)
    return model, cfg

