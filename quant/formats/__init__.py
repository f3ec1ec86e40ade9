"""Quantized checkpoint formats, one module each, behind one small interface.

A format module knows one published layout: which checkpoints are its own (from their own description, config.json's
`quantization_config` or a file beside it, never from a file name), how its tensors are named, which modules its own
list leaves unquantized, and which `quant.modules` hold its weights. The loader (dgemma_cli.checkpoint.weights) knows none of
this: it calls `detect` and then asks the returned `Format`. A new format is one more module listed in `MODULES`.

- `modelopt`: NVIDIA ModelOpt NVFP4 (experts per expert, a global scale per projection);
- `dgemma_int8`: dgemma's own INT8 (fused experts, float32 row scales);
- `compressed_tensors`: compressed-tensors `float-quantized` FP8 and `int-quantized` INT8 (W8A8, channel weights,
  dynamic per-token activations), experts per expert or fused.

Names here are checkpoint names: a module is its weight's name without `.weight`, e.g.
`model.decoder.layers.3.mlp.gate_proj`, and a per-expert projection `model.decoder.layers.3.experts.17.up_proj`.
This package never imports dgemma_cli; a bad description raises `FormatError` (one line), which the loader turns into
its own error.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch.nn as nn

# Checked in this order; the first whose `claim` returns a Format wins.
MODULES = ("modelopt", "dgemma_int8", "compressed_tensors")


class FormatError(ValueError):
    """A quantization description this dgemma cannot read (the message is one line and names what)."""


def per_expert_name(base: str, expert: int, proj: str, part: str) -> str:
    """A per-expert tensor, e.g. model.decoder.layers.3.experts.17.gate_proj.weight_scale (base: ...experts)."""
    return f"{base}.{expert}.{proj}.{part}"


class Format:
    """What the loader asks of a checkpoint's format. Subclasses set `label` and the module factories.

    label: the short name users and the model store see ("nvfp4", "int8", "fp8"); scheme: the format in words.
    expert_layouts: which expert layouts the format stores: "per_expert" (`experts.E.{gate,up,down}_proj.*`,
    stacked into [E, ...] buffers on load) and/or "fused" (`experts.gate_up_proj.*`, `experts.down_proj.*`).
    """

    label = "?"
    scheme = "?"  # one line for `dgemma info`: what is quantized how
    expert_layouts: tuple[str, ...] = ("fused",)
    # Buffers stored once per expert projection rather than per row (ModelOpt's weight_scale_2): [E, segments].
    per_projection_parts: tuple[str, ...] = ()
    # Whether the format may store a calibrated activation scale per quantized module (`input_scale`), which the
    # modules then load where the checkpoint has it (ModelOpt NVFP4: W4A4 quantizes activations with it).
    input_scales = False

    def check_settings(self) -> None:
        """Raise ValueError (one line) when an environment switch this format reads has a bad value."""

    # ---- which modules are quantized

    def ignored(self, module: str) -> bool:
        """Whether the checkpoint's own list leaves `module` unquantized (None of the formats guess: without a
        list, nothing is ignored and a module is quantized exactly when its scale tensor is in the checkpoint)."""
        return False

    def targets(self, module: str) -> bool:
        """Whether the description says `module` (a linear layer or an expert projection) is quantized: then a
        checkpoint without its scale tensor is inconsistent. False where the format does not say (the default)."""
        return False

    def quantized_linear(self, module: str, names) -> bool:
        """Whether the checkpoint holds `module` quantized (`names`: every tensor name in the checkpoint)."""
        return module + ".weight_scale" in names

    def expert_layout(self, base: str, names) -> str | None:
        """'per_expert', 'fused' or None (float experts) for the experts at `base`, e.g. model.decoder.layers.3.experts."""
        if per_expert_name(base, 0, "gate_proj", "weight") in names:
            return "per_expert"
        if base + ".gate_up_proj.weight_scale" in names:
            return "fused"
        return None

    # ---- the modules that hold the weights

    def make_linear(self, in_features: int, out_features: int, device=None) -> nn.Module:
        raise NotImplementedError

    def make_experts(self, num: int, hidden: int, intermediate: int, layout: str, device=None):
        """(gate_up [E, 2I, H], down [E, H, I]) stacks for the experts' layout."""
        raise NotImplementedError

    # ---- where each piece of a stacked buffer is stored

    def per_expert_parts(self, name: str, shape: tuple[int, ...], base: str) -> list[tuple[str, tuple]]:
        """Where the pieces of a stacked buffer live per expert: [(checkpoint name, index into the buffer)].

        name: the buffer, e.g. `layers.3.experts.gate_up_proj.weight_scale`, of `shape` [E, N, ...]. Gate rows come
        first, then up. A part in `per_projection_parts` has shape [E, S]: one value per expert and projection.
        """
        proj, part = name.split(".")[-2:]  # e.g. gate_up_proj, weight_scale
        per_projection = part in self.per_projection_parts
        out = []
        for e in range(shape[0]):
            if proj == "down_proj":
                out.append((per_expert_name(base, e, "down_proj", part), (e, 0) if per_projection else (e,)))
                continue
            half = shape[1] // 2
            for j, sub in enumerate(("gate_proj", "up_proj")):
                idx = (e, j) if per_projection else (e, slice(j * half, (j + 1) * half))
                out.append((per_expert_name(base, e, sub, part), idx))
        return out


def read_json(path: Path) -> dict | None:
    """A JSON object from `path`, None when the file is absent; FormatError when it is not an object."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        raise FormatError(f"{path}: not valid JSON") from None
    if not isinstance(value, dict):
        raise FormatError(f"{path}: not a JSON object")
    return value


def detect(directory: Path, config: dict) -> Format | None:
    """The checkpoint's format from its own description, or None (unquantized).

    config: config.json as a dict. Each format module's `claim(config, directory)` returns a Format, None (not its
    own) or raises FormatError (its own, but a variant this dgemma does not read). A `quantization_config` nobody
    claims is refused by its `quant_method`.
    """
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise FormatError("config.json: quantization_config is not an object")
    names = []
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        found = module.claim(config, Path(directory))
        if found is not None:
            return found
        names.append(module.DESCRIPTION)
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    raise FormatError(f"config.json: quantization method {method or '?'!r} is not supported (dgemma reads "
                      f"{', '.join(names)})")
