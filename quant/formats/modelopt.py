"""NVIDIA ModelOpt NVFP4, as nvidia/diffusiongemma-26B-A4B-it-NVFP4 and dgemma's converter write it.

Description: config.json's `quantization_config` {quant_method: modelopt, quant_algo: NVFP4, group_size: 16}, or
(older exports) only `hf_quant_config.json` {quantization: {quant_algo: NVFP4, ...}}.
Tensors per quantized linear (quant/nvfp4.py): `weight` uint8 [N, K/2], `weight_scale` e4m3 [N, K/16],
`weight_scale_2` float32 [] and `input_scale` float32 [] (static activation scale; not read). Routed experts per
expert, `experts.E.{gate,up,down}_proj.*`, each projection with its own `weight_scale_2`: stacked on load into
[E, 2I, ...] buffers that keep two global scales per expert (gate, up); dgemma's converter may also write fused
stacks. Which modules are quantized: exactly those whose `weight_scale` is stored (the exclude list is globs over
names that differ between exports, so it is not used to decide).
"""

from __future__ import annotations

from pathlib import Path

from .. import modules as qmodules
from . import Format, FormatError, read_json

DESCRIPTION = "ModelOpt NVFP4"
GROUP_SIZE = 16


class ModelOptNVFP4(Format):
    label = "nvfp4"
    expert_layouts = ("per_expert", "fused")
    per_projection_parts = ("weight_scale_2",)

    def make_linear(self, in_features: int, out_features: int, device=None):
        return qmodules.NVFP4Linear(in_features, out_features, device=device)

    def make_experts(self, num: int, hidden: int, intermediate: int, layout: str, device=None):
        segments = 2 if layout == "per_expert" else 1  # per expert: gate and up keep their own global scale
        return (qmodules.NVFP4Stack(num, 2 * intermediate, hidden, segments, device=device),
                qmodules.NVFP4Stack(num, hidden, intermediate, 1, device=device))


def claim(config: dict, directory: Path) -> Format | None:
    qc = config.get("quantization_config")
    if qc is None:
        hf_quant = directory / "hf_quant_config.json"
        raw = read_json(hf_quant)
        if raw is None:
            return None
        try:
            qc = dict(raw["quantization"], quant_method="modelopt")
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{hf_quant}: not a valid ModelOpt quantization file") from None
    if str(qc.get("quant_method", "")).lower() != "modelopt":
        return None
    algo = str(qc.get("quant_algo", "")).upper()
    try:
        group = int(qc.get("group_size", GROUP_SIZE))
    except (TypeError, ValueError):
        group = None
    if algo == "NVFP4" and group == GROUP_SIZE:
        return ModelOptNVFP4()
    raise FormatError(f"config.json: ModelOpt quantization {algo or '?'} is not supported (dgemma reads NVFP4 with "
                      "group size 16)")
