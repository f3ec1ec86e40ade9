"""dgemma's own INT8, as `dgemma quantize --quant int8` writes it.

Description: config.json's `quantization_config` {quant_method: dgemma, format: int8, format_version: 1}.
Tensors per quantized linear (quant/int8.py): `weight` int8 [N, K], `weight_scale` float32 [N]. Experts fused:
`experts.gate_up_proj.{weight [E, 2I, H], weight_scale [E, 2I]}`, `experts.down_proj.{weight, weight_scale}`.
Which modules are quantized: exactly those whose `weight_scale` is stored.

dgemma no longer writes this layout (`dgemma quantize --quant int8` writes compressed-tensors W8A8, which serving
engines read too); entries and directories made by earlier versions keep loading through this module.
"""

from __future__ import annotations

from pathlib import Path

from .. import modules as qmodules
from . import Format, FormatError

DESCRIPTION = "dgemma INT8"
VERSION = 1


class DgemmaInt8(Format):
    label = "int8"
    scheme = "dgemma INT8 v1: int8 weights, one float32 scale per output channel, 16-bit activations"
    expert_layouts = ("fused",)

    def make_linear(self, in_features: int, out_features: int, device=None):
        return qmodules.Int8Linear(in_features, out_features, device=device)

    def make_experts(self, num: int, hidden: int, intermediate: int, layout: str, device=None):
        return (qmodules.Int8Stack(num, 2 * intermediate, hidden, device=device),
                qmodules.Int8Stack(num, hidden, intermediate, device=device))


def claim(config: dict, directory: Path) -> Format | None:
    qc = config.get("quantization_config")
    if qc is None or str(qc.get("quant_method", "")).lower() != "dgemma":
        return None
    fmt = str(qc.get("format", "")).lower()
    if fmt == "int8" and qc.get("format_version") == VERSION:
        return DgemmaInt8()
    raise FormatError(f"config.json: dgemma quantization format {fmt!r} version {qc.get('format_version')!r} is not "
                      "supported by this dgemma")
