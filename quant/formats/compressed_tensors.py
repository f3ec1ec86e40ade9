"""compressed-tensors W8A8, as RedHatAI's FP8-dynamic and the INT8-dynamic DiffusionGemma releases store it.

Description, config.json's `quantization_config`:
    {quant_method: "compressed-tensors", format: "float-quantized" | "int-quantized" (or "naive-quantized"),
     quantization_status: "compressed",
     config_groups: {NAME: {targets: ["Linear", ...], weights: {num_bits: 8, type: "float" | "int",
                            strategy: "channel", symmetric: true, dynamic: false},
                            input_activations: {num_bits: 8, type: (the same), strategy: "token",
                                                symmetric: true, dynamic: true}}},
     ignore: ["lm_head", "re:.*router.*", ...]}
Those are the two published schemes (llmcompressor's FP8_DYNAMIC and W8A8): 8-bit weights per output channel and
8-bit activations quantized per token at run time (nothing stored for them). Every other scheme, format or option
(groups, blocks, asymmetric weights, static activation scales, packed 4-bit, sparsity, transforms, several
different schemes in one checkpoint) is refused by name.

Tensors per quantized module (a linear layer, or one expert's gate_proj / up_proj / down_proj): `weight` float8_e4m3fn
or int8 [N, K] and `weight_scale` bfloat16 (or float) [N, 1]; value = float32(weight) * float32(weight_scale).
Routed experts are stored per expert, `...experts.E.{gate,up,down}_proj.*` (as llmcompressor's `model_free_ptq`
splits the fused tensors), or fused, `experts.gate_up_proj.{weight [E, 2I, H], weight_scale [E, 2I, 1]}` and
`experts.down_proj.*`. A module is quantized exactly when its `weight_scale` is stored, and that must agree with
the description: a stored scale on a module the ignore list names, or a targeted module stored in float, is an
inconsistent checkpoint and refused.

A `kv_cache_scheme`, where present, is not applied: the KV cache stays 16-bit, as for ModelOpt checkpoints.

Ignore and target entries follow compressed-tensors: an entry is an exact module name, or `re:` and a regular
expression matched at the start of the name (`re.match`); the target `Linear` (and vLLM's `MoELinear`) means every
linear layer and expert projection.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .. import modules as qmodules
from .. import w8a8
from ..w8a8 import SEARCH_FACTORS, quantize  # noqa: F401 - the format's weight quantization
from . import Format, FormatError

DESCRIPTION = "compressed-tensors FP8/INT8 W8A8 (channel weights, dynamic per-token activations)"
METHOD = "compressed-tensors"
FORMATS = {"float-quantized": "float", "int-quantized": "int", "naive-quantized": None}
KIND = {"float": "fp8", "int": "int8"}
CLASS_TARGETS = ("Linear", "MoELinear")  # class names that cover every linear layer and expert projection
# What a QuantizationArgs of the two published schemes holds; keys not listed must be absent, null or empty.
WEIGHTS = {"num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
ACTIVATIONS = {"num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True}
MUST_BE_UNSET = ("group_size", "block_structure", "actorder")


class CompressedTensorsW8A8(Format):
    expert_layouts = ("per_expert", "fused")

    def __init__(self, kind: str, targets: list[str], ignore: list[str]):
        self.kind = kind  # "fp8" or "int8"
        self.label = kind
        self.scheme = (f"compressed-tensors {kind.upper()} W8A8: 8-bit weights, one scale per output channel; "
                       "activations 8-bit per token at run time")
        self._targets = targets
        self._ignore = ignore

    def check_settings(self) -> None:
        w8a8.requested()  # DGEMMA_W8A8

    def ignored(self, module: str) -> bool:
        return any(_matches(module, entry) for entry in self._ignore)

    def targets(self, module: str) -> bool:
        return not self.ignored(module) and any(
            entry in CLASS_TARGETS or _matches(module, entry) for entry in self._targets)

    def make_linear(self, in_features: int, out_features: int, device=None):
        return qmodules.W8A8Linear(in_features, out_features, self.kind, act=True, device=device)

    def make_experts(self, num: int, hidden: int, intermediate: int, layout: str, device=None):
        return (qmodules.W8A8Stack(num, 2 * intermediate, hidden, self.kind, act=True, device=device),
                qmodules.W8A8Stack(num, hidden, intermediate, self.kind, act=True, device=device))


def _matches(name: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return name == entry


def _check_args(args, want: dict, where: str, kind_type: str | None) -> str:
    """Check one QuantizationArgs against the published scheme; returns its type ("float" or "int")."""
    if not isinstance(args, dict):
        raise FormatError(f"config.json: compressed-tensors {where} is not an object")
    qtype = str(args.get("type", "")).lower()
    if qtype not in KIND:
        raise FormatError(f"config.json: compressed-tensors {where} of type {qtype or '?'!r} is not supported "
                          "(dgemma reads 8-bit float and int)")
    if kind_type is not None and qtype != kind_type:
        raise FormatError(f"config.json: compressed-tensors {where} are {qtype} but the checkpoint format says "
                          f"{kind_type}")
    for key, value in want.items():
        if args.get(key, None if key != "symmetric" else True) != value:
            raise FormatError(f"config.json: compressed-tensors {where} with {key}={args.get(key)!r} are not "
                              f"supported (dgemma reads {key}={value!r})")
    for key in MUST_BE_UNSET:
        if args.get(key) not in (None, [], {}):
            raise FormatError(f"config.json: compressed-tensors {where} with {key}={args.get(key)!r} are not "
                              "supported")
    return qtype


def claim(config: dict, directory: Path) -> Format | None:
    qc = config.get("quantization_config")
    if qc is None or str(qc.get("quant_method", "")).lower() != METHOD:
        return None
    fmt = str(qc.get("format", "")).lower()
    if fmt == "mixed-precision":
        raise FormatError("config.json: compressed-tensors mixed-precision checkpoints are not supported (dgemma reads "
                          "one FP8 or INT8 W8A8 scheme for every quantized module)")
    if fmt not in FORMATS:
        raise FormatError(f"config.json: compressed-tensors format {fmt or '?'!r} is not supported (dgemma reads "
                          "float-quantized FP8 and int-quantized INT8)")
    status = str(qc.get("quantization_status", "compressed")).lower()
    if status != "compressed":
        raise FormatError(f"config.json: compressed-tensors quantization_status {status!r} is not supported (dgemma "
                          "reads compressed checkpoints)")
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key) not in (None, {}, []):
            raise FormatError(f"config.json: compressed-tensors {key} is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise FormatError("config.json: compressed-tensors quantization_config has no config_groups")
    want_type = FORMATS[fmt]
    targets: list[str] = []
    seen: dict[str, str] = {}
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise FormatError(f"config.json: compressed-tensors group {name!r} is not an object")
        group_fmt = group.get("format")
        if group_fmt is not None and str(group_fmt).lower() not in (fmt, "naive-quantized"):
            raise FormatError(f"config.json: compressed-tensors group {name!r} has format {group_fmt!r} but the "
                              f"checkpoint says {fmt!r} (mixed formats are not supported)")
        if group.get("weights") is None:
            raise FormatError(f"config.json: compressed-tensors group {name!r} does not quantize weights")
        wtype = _check_args(group["weights"], WEIGHTS, f"weights (group {name!r})", want_type)
        if group.get("input_activations") is None:
            raise FormatError(f"config.json: compressed-tensors group {name!r} is weight-only; dgemma reads the "
                              "W8A8 schemes with dynamic per-token activations")
        _check_args(group["input_activations"], ACTIVATIONS, f"input activations (group {name!r})", wtype)
        if group.get("output_activations") is not None:
            raise FormatError(f"config.json: compressed-tensors group {name!r} quantizes output activations, which "
                              "is not supported")
        seen[name] = wtype
        group_targets = group.get("targets")
        if not isinstance(group_targets, list) or not all(isinstance(t, str) for t in group_targets):
            raise FormatError(f"config.json: compressed-tensors group {name!r} has no list of targets")
        for t in group_targets:
            if not (t.startswith("re:") or t in CLASS_TARGETS or "." in t):
                raise FormatError(f"config.json: compressed-tensors target {t!r} is not supported (dgemma reads "
                                  f"{', '.join(CLASS_TARGETS)}, module names and re: patterns)")
        targets += group_targets
    if len(set(seen.values())) > 1:
        desc = ", ".join(f"{n}: {t}" for n, t in seen.items())
        raise FormatError(f"config.json: compressed-tensors groups mix schemes ({desc}); dgemma reads one FP8 or INT8 "
                          "scheme for every quantized module")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise FormatError("config.json: compressed-tensors ignore is not a list of names")
    for entry in ignore + targets:
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error:
                raise FormatError(f"config.json: compressed-tensors entry {entry!r} is not a valid regular "
                                  "expression") from None
    return CompressedTensorsW8A8(KIND[next(iter(seen.values()))], targets, ignore)


# ------------------------------------------------------------------- writing (`dgemma quantize --quant fp8|int8`)

# llmcompressor's preset names, which the releases carry as their group's name.
SCHEME_NAMES = {"fp8": "FP8_DYNAMIC", "int8": "W8A8"}
FORMAT_OF = {"fp8": "float-quantized", "int8": "int-quantized"}
# What the releases leave in 16 bits, in compressed-tensors' syntax. The vision tower and its projection are carried
# over unquantized (as in the releases), so they must be ignored: a reader would otherwise expect them quantized.
IGNORE = ["lm_head", "re:.*embed_tokens$", "re:.*router.*", "re:.*vision_tower.*", "re:.*embed_vision.*",
          "re:.*self_conditioning.*"]
# Added by dgemma's `experts` policy: attention and the dense MLP stay 16-bit too.
IGNORE_DENSE = [r"re:.*self_attn\..*", r"re:.*\.mlp\..*"]
def quantization_config(kind: str, quantize_dense: bool) -> dict:
    """config.json's `quantization_config` as llmcompressor writes it for FP8_DYNAMIC / W8A8 (the releases' form):
    every Linear targeted, weights per channel, activations dynamic per token, the ignore list above. Experts are
    stored per expert, which compressed-tensors and vLLM read as Linear modules."""
    qtype = "float" if kind == "fp8" else "int"

    def args(strategy: str, dynamic: bool) -> dict:
        return {"num_bits": 8, "type": qtype, "symmetric": True, "strategy": strategy, "dynamic": dynamic,
                "group_size": None, "block_structure": None, "actorder": None, "observer": None,
                "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}

    return {
        "quant_method": METHOD, "format": FORMAT_OF[kind], "quantization_status": "compressed",
        "config_groups": {SCHEME_NAMES[kind]: {"targets": ["Linear"], "weights": args("channel", False),
                                               "input_activations": args("token", True), "output_activations": None,
                                               "format": FORMAT_OF[kind]}},
        "ignore": IGNORE + ([] if quantize_dense else IGNORE_DENSE),
        "kv_cache_scheme": None, "global_compression_ratio": None, "transform_config": {},
    }
